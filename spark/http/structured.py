"""Structured output: a request's JSON schema or forced tool call as the grammar its decoding follows.

One grammar per turn, from what the APIs ask:
  * a forced tool call (OpenAI ``tool_choice`` "required" or a named function, Anthropic ``any`` /
    ``tool``, Responses ``tool_choice``): the call in the model's own format (hermes, qwen3_coder,
    minimax; hermes for a model whose template names none), its arguments per the tool's JSON schema;
    xgrammar's builders for those formats (``get_model_structural_tag``) make it;
  * tools offered with ``strict: true`` under "auto": text stays free, and a call, once begun, follows
    its schema;
  * a JSON answer (OpenAI ``response_format`` json_object / json_schema, Responses ``text.format``).
With reasoning on, the grammar starts after the reasoning block (the block itself stays free): from
the first token when the template opened it, else after an optional ``<think>...</think>``.
A grammar xgrammar cannot build is a 400 naming the field; nothing else about the request changes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from spark.core.grammar import GrammarSpec
from spark.engine.grammar import JSON_MAX_WHITESPACE
from spark.http.errors import ApiError

# Spark's tool-call parsers -> xgrammar's model formats that write the same syntax
_FORMATS = {"hermes": "qwen_3", "qwen3_coder": "qwen_3_coder", "minimax": "minimax"}
FORCED_DEFAULT_PARSER = "hermes"
MAX_WHITESPACE = 1  # blanks in a row in a forced call: a model that spins on them cannot run out its max_tokens so


def output_schema(fmt: Mapping[str, Any] | None, *, param: str) -> str | None:
    """The JSON schema text a ``response_format`` (or Responses ``text.format``) asks for; None: free text.

    Accepts ``{"type": "text"}``, ``{"type": "json_object"}`` and ``{"type": "json_schema", ...}`` with the
    schema under ``json_schema.schema`` (chat) or ``schema`` (Responses)."""
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise ApiError(400, f"{param} must be an object", param=param)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        inner = fmt.get("json_schema", fmt)
        schema = inner.get("schema") if isinstance(inner, Mapping) else None
        if schema is None:
            schema = {}
        if not isinstance(schema, (Mapping, bool)):
            raise ApiError(400, f"{param} json_schema.schema must be an object", param=f"{param}.json_schema.schema")
        return json.dumps(schema)
    raise ApiError(400, f"{param} type must be text, json_object or json_schema, got {kind!r}", param=f"{param}.type")


def reasoning_mode(reasoning: bool, thinking_enabled: bool, prompt_ends_in_thinking: bool) -> str:
    """xgrammar's reasoning mode: "enabled" (the template opened the block), "auto" (the model may open
    one), "disabled"."""
    if not reasoning or not thinking_enabled:
        return "disabled"
    return "enabled" if prompt_ends_in_thinking else "auto"


def turn_grammar(*, tool_parser: str | None, tools: Sequence[Mapping[str, Any]] | None, tool_choice,
                 parallel_tool_calls: bool, schema: str | None, reasoning: str) -> GrammarSpec | None:
    """The turn's grammar (see the module docstring), checked; None when decoding stays free.

    Raises:
        ApiError: 400 when xgrammar cannot build it.
    """
    if constrains_calls(tools, tool_choice):
        spec = _tool_call_spec(tool_parser or FORCED_DEFAULT_PARSER, tools, tool_choice, parallel_tool_calls, reasoning)
        param = "tools" if tool_choice.mode == "auto" else "tool_choice"
    elif schema is not None:
        spec, param = _json_spec(schema, reasoning), "response_format"
    else:
        return None
    from spark.engine.grammar import check

    try:
        check(spec)
    except ValueError as exc:
        raise ApiError(400, f"cannot build the grammar of {param}: {exc}", param=param) from None
    return spec


def constrains_calls(tools: Sequence[Mapping[str, Any]] | None, tool_choice) -> bool:
    """Whether the turn's grammar is of tool calls: one is forced, or a strict tool is offered."""
    if not tools:
        return False
    if tool_choice.mode == "required" or tool_choice.name is not None:
        return True
    return tool_choice.mode == "auto" and any((t.get("function") or {}).get("strict") for t in tools)


def _tool_call_spec(parser: str, tools, tool_choice, parallel: bool, reasoning: str) -> GrammarSpec:
    import xgrammar

    if tool_choice.name is not None:
        choice: Any = {"type": "function", "function": {"name": tool_choice.name}}
    else:
        choice = "required" if tool_choice.mode == "required" else "auto"
    try:
        tag = xgrammar.get_model_structural_tag(_FORMATS[parser], tools=[dict(t) for t in tools], tool_choice=choice,
                                                reasoning=reasoning, parallel_tool_calls=parallel,
                                                max_whitespace_cnt=MAX_WHITESPACE)
    except Exception as exc:
        raise ApiError(400, f"cannot build the tool-call grammar: {exc}", param="tools") from None
    tag = tag.model_dump(mode="json")
    if choice != "auto":
        tag["format"] = _calls_only(tag["format"], parallel)
    if reasoning == "disabled":  # (xgrammar's minimax closes a think block it takes the template to open)
        tag["format"] = _no_think_close(tag["format"])
    return GrammarSpec("structural_tag", json.dumps(tag))


def _no_think_close(node: Any) -> Any:
    """``node`` without the constant strings that close a reasoning block: none is open."""
    if isinstance(node, dict) and node.get("type") == "sequence":
        kept = [_no_think_close(e) for e in node["elements"]
                if not (isinstance(e, dict) and e.get("type") == "const_string" and "</think>" in e.get("value", ""))]
        return dict(node, elements=kept)
    return node


def _calls_only(node: Any, parallel: bool) -> Any:
    """A forced choice's format with no free text around the calls: xgrammar's triggered tags let text
    follow the first call, which a client would then read as the reply's content."""
    if isinstance(node, list):
        return [_calls_only(n, parallel) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "triggered_tags":
        return {"type": "tags_with_separator", "tags": node["tags"], "separator": "\n", "at_least_one": True,
                "stop_after_first": not parallel}
    return {k: _calls_only(v, parallel) for k, v in node.items()}


def _json_spec(schema: str, reasoning: str) -> GrammarSpec:
    if reasoning == "disabled":
        return GrammarSpec("json_schema", schema)
    answer = {"type": "json_schema", "json_schema": json.loads(schema), "max_whitespace_cnt": JSON_MAX_WHITESPACE}
    think = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"}
    if reasoning == "enabled":
        fmt: dict = {"type": "sequence", "elements": [think, answer]}
    else:
        fmt = {"type": "or", "elements": [{"type": "sequence", "elements": [dict(think, begin="<think>"), answer]},
                                         answer]}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))
