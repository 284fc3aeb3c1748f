"""Render Hugging Face style Jinja chat templates.

The environment mirrors what `transformers` gives a template, because model authors
test their templates there: a sandbox with `trim_blocks` and `lstrip_blocks`, the
`loopcontrols` extension, a no-op `{% generation %}` block, a `tojson` filter that keeps
non-ASCII text as is, and the `raise_exception` / `strftime_now` globals.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Older names under which a message's reasoning arrives; templates read `reasoning_content`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(Exception):
    """A chat template failed to compile or render; the message is one line."""


class _GenerationBlock(jinja2.ext.Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    # for serving it only has to render its body.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _SafeNamespace(jinja2.utils.Namespace):
    # Underscore attributes on a namespace are a known path to interpreter internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    env.globals["dict"] = dict
    return env


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once; later calls with the same text reuse it.

    Args:
      source: the Jinja source of the template.

    Returns:
      The compiled template.

    Raises:
      ChatTemplateError: the template has a syntax error.
    """
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {_one_line(e.message)}") from e


def select_template(templates: str | Mapping[str, str] | None, *, name: str | None = None,
                    has_tools: bool = False) -> str:
    """Pick the template text to render, the way transformers chooses among named templates.

    Args:
      templates: one template, or named templates (`default`, `tool_use`, ...), or None.
      name: a template name to use instead of the default choice.
      has_tools: whether tools were passed; prefers the `tool_use` template then.

    Returns:
      The template source.

    Raises:
      ChatTemplateError: there is no template, or no template fits.
    """
    if templates is None:
        raise ChatTemplateError("the model has no chat template")
    if isinstance(templates, str):
        return templates
    if name is not None:
        if name not in templates:
            raise ChatTemplateError(f"no chat template named {name!r}; have {sorted(templates)}")
        return templates[name]
    if has_tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise ChatTemplateError(f"several chat templates and none is 'default': {sorted(templates)}")


def render(source: str, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping] | None = None,
           documents: Sequence[Mapping] | None = None, add_generation_prompt: bool = True,
           **variables: Any) -> str:
    """Render a chat template.

    Args:
      source: the Jinja source of the template.
      messages: chat messages, dicts with at least `role`; keys whose value is None are
        dropped first, since templates test for a key's presence, not for None.
      tools: JSON schemas of the tools the model may call, or None.
      documents: retrieval documents, or None.
      add_generation_prompt: end with the header that opens the assistant's turn.
      **variables: more template variables (`bos_token`, `enable_thinking`, ...).

    Returns:
      The rendered prompt text.

    Raises:
      ChatTemplateError: the template is invalid, raised an exception, or failed to render.
    """
    template = compile_template(source)
    chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
    try:
        return template.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {_one_line(str(e))}") from e
    except Exception as e:  # a template can index a missing key, divide by zero, ...
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {_one_line(str(e))}") from e


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(no message)"
