"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Used by Qwen2.5/Qwen3, Hermes and many others. A block closes at the first
`</tool_call>` that is not inside a JSON string, so a string argument may contain the
closing tag. The block becomes a call only if its body is a JSON object with a string
`name` and an object `arguments` (or `parameters`, or a JSON string holding an object);
anything else is given back as content. One still open when the next `<tool_call>` comes is
content. The arguments stream in one fragment, when the block closes.

At the end of the output a block still open is a call when its whole body is one (the model
forgot `</tool_call>`). Else, when its body is a JSON object cut short (the token limit stopped
the model inside the call), it is an incomplete call if its name was whole, with the arguments
as far as they went (`ToolCall.cut_arguments`), and nothing if not: the markup of a cut call
is never content. A body that begins no JSON object stays content. A `<tool_call>` tag the
output ends inside is dropped too (what stays is still the model's text, only shorter).
"""

from __future__ import annotations

import re
from typing import Any

from spark.parsers.cut_json import cut_object_members
from spark.parsers.events import ToolCall, ToolParseResult
from spark.parsers.scan import MORE, Calls, Content, TextMachine, find_tag, first_non_space, tag_at
from spark.parsers.schema import load_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Inside a JSON string only a quote or a backslash matters; outside, a quote or a tag.
_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'["<]')


class HermesStream(TextMachine):
    """Incremental hermes parser; see `spark.parsers.tool_parser`."""

    def __init__(self, calls: Calls) -> None:
        super().__init__()
        self._calls = calls
        self._content = Content(self._sink)
        self._in_block = False
        self._body: list[str] = []  # block text consumed so far, after the open tag
        self._seen_brace = False
        self._in_string = False

    def _step(self, final: bool) -> bool:
        return self._block(final) if self._in_block else self._text(final)

    def _text(self, final: bool) -> bool:
        i, tag = find_tag(self._buf, self._pos, (OPEN,), False)
        self._content.text(self._buf[self._pos:i])
        self._pos = i
        if tag is None:
            if final and i < len(self._buf):  # the output ended inside the open tag
                self._pos = len(self._buf)
                self._content.boundary()
            return False
        self._pos += len(OPEN)
        self._in_block, self._body, self._seen_brace, self._in_string = True, [], False, False
        return True

    def _block(self, final: bool) -> bool:
        buf, i, n = self._buf, self._pos, len(self._buf)
        if not self._seen_brace:
            j = first_non_space(buf, i)
            if j < 0:
                self._keep(n)
                return self._close_at_end() if final else False
            if buf[j] != "{":  # not JSON: the open tag was just text
                self._keep(j)
                return self._give_up()
            self._seen_brace = True
        while True:
            if self._in_string:
                m = _IN_STRING.search(buf, i)
                if m is None:
                    i = n
                    break
                if m.group() == '"':
                    self._in_string, i = False, m.end()
                elif m.end() < n:
                    i = m.end() + 1  # skip the escaped character
                else:
                    i = m.start()  # wait for the escaped character
                    break
                continue
            m = _OUTSIDE.search(buf, i)
            if m is None:
                i = n
                break
            if m.group() == '"':
                self._in_string, i = True, m.end()
                continue
            tag = tag_at(buf, m.start(), (CLOSE, OPEN), final)
            if tag is MORE:
                i = m.start()
                break
            if tag is None:
                i = m.end()
                continue
            self._keep(m.start())
            if tag == CLOSE:
                self._pos += len(CLOSE)
                self._close()
                return True
            return self._give_up()  # a new block opens: this one was never closed
        self._keep(n if final else i)
        return self._close_at_end() if final else False

    def _keep(self, upto: int) -> None:
        self._body.append(self._buf[self._pos:upto])
        self._pos = upto

    def _give_up(self) -> bool:
        self._content.text(OPEN + "".join(self._body))
        self._in_block = False
        return True

    def _close_at_end(self) -> bool:
        body = "".join(self._body)
        whole = _without_cut_tag(body)  # a cut `</tool_call>` (or the next `<tool_call>`) after the object
        call = _parse_call(whole)
        if call is not None:
            self._in_block = False
            self._emit_call(*call)
            return True
        # A cut string argument may end in what looks like a cut tag: keep it when it reads so.
        members = next((m for m in map(cut_object_members, (body, whole)) if m is not None), None)
        if members is None:
            return self._give_up()
        self._in_block = False
        ok, name = load_json(members.get("name", ""))
        if ok and isinstance(name, str) and name:
            self._emit_call(name, *_cut_arguments(members), incomplete=True)
        else:  # cut before its name was whole: nothing to say of it
            self._content.boundary()
        return True

    def _close(self) -> None:
        self._in_block = False
        body = "".join(self._body)
        call = _parse_call(body)
        if call is None:
            self._content.text(OPEN + body + CLOSE)
            return
        self._emit_call(*call)

    def _emit_call(self, name: str, arguments: dict[str, Any], cut: str | None = None,
                   incomplete: bool = False) -> None:
        self._content.boundary()
        index, call_id = self._calls.start()
        call = ToolCall(name, arguments, call_id, self._calls.unknown(name), incomplete, cut)
        self._sink.tool(index, call_id, name, call.arguments_json())
        self._calls.done.append(call)
        self._content.boundary()

    def _end(self) -> None:
        self._content.end()

    def _result(self) -> ToolParseResult:
        return ToolParseResult(self._content.value, list(self._calls.done))


def _parse_call(body: str) -> tuple[str, dict[str, Any]] | None:
    _, obj = load_json(body.strip())  # str.strip: also the white space JSON does not take (U+2028, ...)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models double-encode the arguments
        arguments = load_json(arguments)[1] if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return None
    return obj["name"], arguments


def _without_cut_tag(body: str) -> str:
    """`body` less a tag the output ended inside, if it ends in one."""
    i = body.rfind("<")
    tail = body[i:]
    return body[:i] if i >= 0 and (CLOSE.startswith(tail) or OPEN.startswith(tail)) else body


def _cut_arguments(members: dict[str, str]) -> tuple[dict[str, Any], str | None]:
    """The arguments of a call cut short: ``(arguments, None)`` when they were whole, else
    ``({}, their text as far as it went)`` ("" when they had not begun)."""
    text = members.get("arguments", members.get("parameters", ""))
    ok, value = load_json(text)
    if ok and isinstance(value, str):  # double-encoded
        text = value
        ok, value = load_json(value) if value.strip() else (True, {})
    elif text.startswith('"'):  # double-encoded and cut: the string's own text so far
        decoded, inner = load_json(text + '"')
        ok, text = False, inner if decoded else text
    return (value, None) if ok and isinstance(value, dict) else ({}, text)
