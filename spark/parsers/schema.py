"""Typing of XML-format parameter values by the tool's JSON schema.

In the qwen3_coder and minimax formats every value is bare text; the schema of the
parameter says what it was meant to be. A value that does not convert to any of the
schema's types stays a string, so nothing the model wrote is lost.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Any


def strip_format_newlines(raw: str) -> str:
    """Remove the single newline the format puts after the open tag and before the close tag."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    return raw


def convert_value(text: str, schema: dict[str, Any] | None) -> Any:
    """Convert a parameter's text to the first type of `schema` that accepts it.

    Args:
      text: the value, format newlines already stripped.
      schema: the parameter's JSON schema; None (unknown tool or parameter) keeps a string.

    Returns:
      An int, float, bool, None, dict or list that survives a JSON round trip, or `text`.
    """
    for kind in _types(schema):
        convert = _CONVERTERS.get(kind)
        if convert is None:  # "string", or a type we do not know
            continue
        ok, value = convert(text.strip())
        if ok:
            return value
    if text != text.strip() and not _string_fits(text, schema) and _string_fits(text.strip(), schema):
        return text.strip()  # the blanks a grammar may let a forced call put around a value are the format's
    return text


def _string_fits(text: str, schema: Any) -> bool:
    """Whether ``text`` meets a string schema's enum, length and pattern (True without such a schema)."""
    if not isinstance(schema, dict):
        return True
    if isinstance(schema.get("enum"), list) and text not in schema["enum"]:
        return False
    if isinstance(schema.get("maxLength"), int) and len(text) > schema["maxLength"]:
        return False
    if isinstance(schema.get("minLength"), int) and len(text) < schema["minLength"]:
        return False
    if isinstance(schema.get("pattern"), str):
        try:
            return re.search(schema["pattern"], text) is not None
        except re.error:
            return True
    return True


def _types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    kinds = [k for key in ("anyOf", "oneOf") for sub in schema.get(key) or () for k in _types(sub)]
    if not kinds and isinstance(schema.get("properties"), dict):
        kinds = ["object"]
    return kinds


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json(text: str) -> tuple[bool, Any]:
    """`json.loads` that refuses NaN and Infinity (they are not JSON); returns (ok, value)."""
    try:
        return True, json.loads(text, parse_constant=_reject_constant, strict=False)  # raw control characters in strings: taken
    except (ValueError, RecursionError):
        return False, None


def _integer(text: str) -> tuple[bool, Any]:
    ok, value = load_json(text)
    if ok and isinstance(value, float) and value.is_integer():
        value = int(value)
    return (ok and isinstance(value, int) and not isinstance(value, bool)), value


def _number(text: str) -> tuple[bool, Any]:
    ok, value = load_json(text)
    return (ok and isinstance(value, (int, float)) and not isinstance(value, bool)), value


def _boolean(text: str) -> tuple[bool, Any]:
    lowered = text.lower()
    return lowered in ("true", "false"), lowered == "true"


def _null(text: str) -> tuple[bool, Any]:
    return text in ("null", "None"), None


def _container(kind: type) -> Callable[[str], tuple[bool, Any]]:
    def convert(text: str) -> tuple[bool, Any]:
        ok, value = load_json(text)
        if not ok:  # models sometimes write a Python literal: {'a': True}
            try:
                value = ast.literal_eval(text)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return False, None
        if not isinstance(value, kind):
            return False, None
        try:  # tuples, sets, NaN or non-string keys would not stream back as the same value
            return json.loads(json.dumps(value)) == value, value
        except (TypeError, ValueError, RecursionError):
            return False, None

    return convert


_CONVERTERS: dict[str, Callable[[str], tuple[bool, Any]]] = {
    "integer": _integer,
    "number": _number,
    "boolean": _boolean,
    "null": _null,
    "object": _container(dict),
    "array": _container(list),
}
