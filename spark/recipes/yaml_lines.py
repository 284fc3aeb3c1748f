"""The recipes directory's YAML: read strictly, with the line of every path, and its errors as one line.

    data, lines = parse_yaml(text)               # lines["$.context.default"] == 7
    except yaml.YAMLError as exc:
        print(yaml_problem("recipes/x.yaml", exc))  # recipes/x.yaml: $: YAML syntax error: ... (line 3)

Recipes and ``roi-profiles.yaml`` are read so, and report their problems alike.
"""

from __future__ import annotations

import re

import attrs
import yaml


@attrs.frozen
class Problem:
    """One thing wrong with one file of the recipes directory (or of the host's config)."""

    file: str  # as given, relative to the working directory when it can be
    path: str  # "$.context.default"; "$" for the whole file
    message: str
    line: int | None = None  # 1-based

    def __str__(self) -> str:
        return f"{self.file}: {self.path}: {self.message}" + (f" (line {self.line})" if self.line else "")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML keeps the last one silently) and aliases.

    These files have no use for ``*alias``, and an alias makes the document a graph: ``&a [*a]`` is a
    cycle (a RecursionError walking it), nested aliases a billion nodes (a walk that never ends).
    """

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None, None, f"YAML aliases (*{event.anchor}) are not allowed: write the value out", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        keys = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in keys:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            keys.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str) -> tuple[object, dict[str, int]]:
    """The document, and the 1-based line of every ``$.a.b[0]`` path in it.

    Raises:
        yaml.YAMLError: not YAML, a duplicate key or an alias (``yaml_problem`` says it in one line).
    """
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    lines: dict[str, int] = {}
    if node is not None:
        _index_lines(node, "$", lines)
    return data, lines


def yaml_problem(shown: str, exc: yaml.YAMLError) -> Problem:
    """``parse_yaml``'s error as one problem: what is wrong (not only its context) and its line."""
    mark, what = getattr(exc, "problem_mark", None), getattr(exc, "problem", None) or str(exc)
    if isinstance(exc, yaml.constructor.ConstructorError):  # ours: a duplicate key, an alias
        return Problem(shown, "$", what, mark.line + 1 if mark else None)
    context, where = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and where is not None:
        what = f"{what}, {context} that starts at line {where.line + 1}"
    return Problem(shown, "$", f"YAML syntax error: {what}", mark.line + 1 if mark else None)


def line_of(lines: dict[str, int], path: str) -> int | None:
    """The line of ``path``, or of its nearest ancestor that has one (a missing field: its section)."""
    path = re.sub(r"\['([^']*)'\]", r".\1", path)  # cattrs writes dict keys as ['k']
    while path:
        if path in lines:
            return lines[path]
        cut = max(path.rfind("."), path.rfind("["))
        path = path[:cut] if cut > 0 else ""
    return None


def _index_lines(node, path: str, lines: dict[str, int]) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            child = f"{path}.{key.value}"
            lines[child] = key.start_mark.line + 1
            _index_lines(value, child, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index_lines(item, f"{path}[{i}]", lines)
