"""Tools for a chat template that shows none (SmolLM2's, the default model's, among others).

Such a template renders each message's role and text and drops the rest: the tools a request
offers, an assistant's ``tool_calls``, the meaning of a ``tool`` message. The model would answer
blind, and an agent's history would read as empty assistant turns. As llama.cpp does for such
templates, Spark then writes the tools into the conversation itself, in the hermes format that
the parser (and a forced call's grammar) reads:
- the offered tools, one JSON object a line in ``<tools>`` tags, with how to call them, at the
  end of the system message (a new one first when the conversation has none);
- each assistant call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` text after
  the message's own;
- tool results as a user turn of ``<tool_response>`` blocks (consecutive results in one turn).

``template_shows_tools`` decides once per template, from a render with a probe tool.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

_PROBE = "spark_probe_tool_7f3a"  # a name no template writes unless it writes the tools it is given
_shown_by_template: dict[str, bool] = {}  # template text -> whether it shows tools (asked at every request)


def template_shows_tools(tokenizer, template: str) -> bool:
    """Whether the tokenizer's chat template (its text, ``template``) writes the tools it is given: a
    probe tool's name is in its render. A template that fails on the probe is taken to show them:
    nothing changes for it."""
    shown = _shown_by_template.get(template)
    if shown is None:
        probe = {"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {"type": "object"}}}
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe],
                                                 add_generation_prompt=True)
        except Exception:  # noqa: BLE001 (any template error: keep today's rendering)
            text = _PROBE
        shown = _shown_by_template[template] = _PROBE in text
    return shown


def with_tool_prompt(messages: Sequence[Mapping[str, Any]],
                     tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` (as ``chat_prompt.template_messages`` gives them: a call's arguments a mapping)
    with the tools, calls and results written as text (the module docstring's format); ``tools``
    None or empty: only the history is rewritten."""
    out: list[dict[str, Any]] = []
    results: dict[str, Any] | None = None  # the user turn the latest run of tool results goes in
    for message in messages:
        m = dict(message)
        if m.get("role") == "tool":
            response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if results is not None:
                results["content"] += "\n" + response
                continue
            m = results = {"role": "user", "content": response}
        else:
            results = None
            if m.get("role") == "assistant" and m.get("tool_calls"):
                calls = "\n".join(_call_text(call) for call in m.pop("tool_calls"))
                m["content"] = f"{m['content']}\n{calls}" if m.get("content") else calls
        out.append(m)
    if tools:
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{_tools_text(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": _tools_text(tools)})
    return out


def _tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    listed = "\n".join(json.dumps(dict(tool), ensure_ascii=False) for tool in tools)
    return ("You can use these functions, each described by a JSON Schema of its arguments:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call a function, write its name and its arguments as a JSON object inside <tool_call></tool_call> "
            "tags, one block per call, and nothing after the last block:\n"
            '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>\n'
            "What a call returns comes back inside <tool_response></tool_response> tags.")


def _call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function") or {}
    body = json.dumps({"name": function.get("name"), "arguments": function.get("arguments")}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"
