"""XML-style tool calls: qwen3_coder and minimax.

    <tool_call>                              <minimax:tool_call>
    <function=NAME>                          <invoke name="NAME">
    <parameter=P>                            <parameter name="P">VALUE</parameter>
    VALUE                                    </invoke>
    </parameter>                             </minimax:tool_call>
    </function>
    </tool_call>

A call is committed when its header (`<function=NAME>`) is complete: its id and name are
sent, then each parameter as it completes, as the next fragment of the canonical JSON
arguments (`{"p": v`, `, "q": w`, then `}`). A block open tag not followed by a call header is text.

The output may end anywhere (the token limit cuts it): a call still open there is closed with
what it has and marked `incomplete`, its last value as far as it went; markup the output ended
inside (a tag or header not yet whole, a block open tag with no call header yet) is dropped,
never content.

Where a value ends: at the first `</parameter>` or next parameter header; but when a
`</function>` or `</tool_call>` comes first and no `</parameter>` / parameter header
follows before the next `<tool_call>` (or the end), the model forgot `</parameter>` and the
value ends at that earlier tag (unless the output ends with text, not markup, right after that
tag: then the value held it and was cut). So a value may contain the call and block closing
tags, but not `</parameter>` or a parameter header (the format cannot tell those apart).
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from spark.parsers.events import ToolCall, ToolParseResult
from spark.parsers.scan import MORE, Calls, Content, TextMachine, find_tag, first_non_space, tag_at
from spark.parsers.schema import convert_value, strip_format_newlines

# A header's name runs to ">" on the same line; past this length it is not a header.
_MAX_NAME = 256


@attrs.frozen
class XmlDialect:
    """The six tags of one XML tool-call format. Headers are `call_open NAME>`."""

    block_open: str
    block_close: str
    call_open: str
    call_close: str
    param_open: str
    param_close: str


QWEN3_CODER = XmlDialect("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")
MINIMAX = XmlDialect("<minimax:tool_call>", "</minimax:tool_call>", "<invoke name=", "</invoke>",
                     "<parameter name=", "</parameter>")


class XmlStream(TextMachine):
    """Incremental parser for one XML dialect; see `spark.parsers.tool_parser`."""

    def __init__(self, dialect: XmlDialect, calls: Calls) -> None:
        super().__init__()
        self._d = dialect
        self._calls = calls
        self._content = Content(self._sink)
        self._state = self._text
        self._junk_return = self._text  # the state to go back to after stray text
        self._stray: list[str] = []  # stray text inside the open call, content once it closes
        self._held = ""  # the block open tag and whitespace, until a call header commits the block
        self._block_calls = 0
        # The call being parsed.
        self._index, self._id, self._name = 0, "", ""
        self._args: dict[str, Any] = {}
        # The parameter being parsed.
        self._param = ""
        self._value: list[str] = []
        self._tentative = 0  # the length of a call/block closing tag seen in the value (0: none yet)
        self._scan = 0  # where the search resumes, relative to self._pos

    def _step(self, final: bool) -> bool:
        return self._state(final)

    # Outside blocks.
    def _text(self, final: bool) -> bool:
        i, tag = find_tag(self._buf, self._pos, (self._d.block_open,), False)
        self._content.text(self._buf[self._pos:i])
        self._pos = i
        if tag is None:
            return self._cut() if final and i < len(self._buf) else False
        self._pos += len(tag)
        self._held, self._block_calls, self._state = tag, 0, self._block
        return True

    # Inside a block, outside calls.
    def _block(self, final: bool) -> bool:
        j = self._skip_space()
        if j < 0:
            return self._cut() if final else False
        d = self._d
        tag = tag_at(self._buf, j, (d.call_open, d.block_close, d.block_open), False)
        if tag is MORE:
            return self._cut() if final else False
        if tag == d.call_open:
            self._state = self._call_header
        elif tag == d.block_close and self._block_calls:
            self._pos += len(tag)
            self._state = self._text
        elif tag == d.block_open or not self._block_calls:
            self._leave_block()
        else:
            self._junk(self._block)
        return True

    def _leave_block(self) -> bool:
        # With no call yet the open tag and whitespace were just text.
        self._content.text(self._held)
        self._held, self._state = "", self._text
        return True

    def _call_header(self, final: bool) -> bool:
        name, end = self._header(self._d.call_open)
        if name is MORE:
            return self._cut() if final else False
        if name is None:
            if self._block_calls:
                self._junk(self._block)
            else:
                self._leave_block()
            return True
        self._pos = end
        self._held = ""
        self._block_calls += 1
        self._content.boundary()
        self._index, self._id = self._calls.start()
        self._name, self._args = name, {}
        self._sink.tool(self._index, self._id, name, "")
        self._state = self._call
        return True

    # Inside a call, between parameters.
    def _call(self, final: bool) -> bool:
        j = self._skip_space()
        if j < 0:
            return self._cut_call() if final else False
        d = self._d
        tag = tag_at(self._buf, j, (d.param_open, d.call_close, d.block_close, d.block_open, d.call_open), False)
        if tag is MORE:
            return self._cut_call() if final else False
        if tag == d.param_open:
            self._state = self._param_header
        elif tag == d.call_close:
            self._pos += len(tag)
            self._close_call(self._block)
        elif tag == d.block_close:
            self._pos += len(tag)
            self._close_call(self._text)
        elif tag == d.block_open:
            self._close_call(self._text)
        elif tag == d.call_open:
            self._close_call(self._block)
        else:
            self._junk(self._call)
        return True

    def _close_call(self, then: Any, incomplete: bool = False) -> None:
        self._sink.tool(self._index, None, None, "}" if self._args else "{}")
        unknown = self._calls.unknown(self._name)
        self._calls.done.append(ToolCall(self._name, self._args, self._id, unknown, incomplete))
        self._content.text("".join(self._stray))
        self._stray = []
        self._content.boundary()
        self._state = then

    def _cut_call(self) -> bool:
        self._close_call(self._text, incomplete=True)
        return self._cut()

    def _cut(self) -> bool:
        """The output ended inside markup: drop it (and a block open tag waiting for its call)."""
        self._held, self._pos, self._state = "", len(self._buf), self._text
        self._content.boundary()
        return True

    def _param_header(self, final: bool) -> bool:
        name, end = self._header(self._d.param_open)
        if name is MORE:
            return self._cut_call() if final else False
        if name is None:
            self._junk(self._call)
            return True
        self._pos, self._param = end, name
        self._value, self._tentative, self._scan = [], 0, 0
        self._state = self._param_value
        return True

    def _param_value(self, final: bool) -> bool:
        d, buf = self._d, self._buf
        if not self._tentative:
            i, tag = find_tag(buf, self._pos, (d.param_close, d.param_open, d.call_close, d.block_close), False)
            self._value.append(buf[self._pos:i])
            self._pos = i
            if tag is None:
                if final:  # the value ends with the output, less a tag cut short
                    self._end_param(self._call, skip=len(buf) - i)
                return final
            if tag in (d.param_close, d.param_open):
                self._end_param(self._call, skip=len(tag) if tag == d.param_close else 0)
            else:  # the value text stays in the buffer from here until we know
                self._tentative = self._scan = len(tag)
            return True
        i, tag = find_tag(buf, self._pos + self._scan, (d.param_close, d.param_open, d.block_open), False)
        self._scan = i - self._pos
        if tag is None and not final:
            return False
        after = first_non_space(buf, self._pos + self._tentative) if tag is None else -1
        if after >= 0 and buf[after] != "<":
            # Text, not markup, after the closing tag, up to the end: the tag was the value's, cut with it.
            self._value.append(buf[self._pos:i])
            self._pos = len(buf)
            self._end_param(self._call)
        elif tag in (d.param_close, d.param_open):  # the closing tag was part of the value
            self._value.append(buf[self._pos:i])
            self._pos = i
            self._end_param(self._call, skip=len(tag) if tag == d.param_close else 0)
        else:  # `</parameter>` was forgotten: the value ended at the closing tag
            self._end_param(self._call)
        return True

    def _end_param(self, then: Any, skip: int = 0) -> None:
        self._pos += skip
        self._state = then
        if self._param in self._args:  # a repeated parameter: the first one stands
            return
        schema = self._calls.param_schema(self._name, self._param)
        value = convert_value(strip_format_newlines("".join(self._value)), schema)
        head = ", " if self._args else "{"
        self._args[self._param] = value
        fragment = head + json.dumps(self._param, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
        self._sink.tool(self._index, None, None, fragment)

    # Helpers.
    def _skip_space(self) -> int:
        """Move past whitespace (kept in `_held` while the block has no call); -1 at the end."""
        j = first_non_space(self._buf, self._pos)
        upto = len(self._buf) if j < 0 else j
        if self._state == self._block and not self._block_calls:
            self._held += self._buf[self._pos:upto]
        self._pos = upto
        return j

    def _header(self, prefix: str) -> tuple[Any, int]:
        """Parse `prefix NAME>` at the buffer position: (name, end), (MORE, 0) or (None, 0).

        MORE: the buffer ends before the header does (at the end of the output: cut short).
        """
        start = self._pos + len(prefix)
        window = self._buf[start:start + _MAX_NAME + 1]
        close = window.find(">")
        head = window if close < 0 else window[:close]
        if "<" in head or "\n" in head:
            return None, 0
        if close < 0:
            return (None, 0) if len(window) > _MAX_NAME else (MORE, 0)
        name = head.strip().strip("\"'").strip()
        return (name or None), start + close + 1

    def _junk(self, back: Any) -> None:
        # Stray text inside a block goes to content, up to the next "<"; inside a call, once the call
        # is closed, so that a call's deltas come one after another (the APIs stream a call as one item).
        self._junk_return, self._state = back, self._junk_run
        self._stray_text(self._buf[self._pos])
        self._pos += 1

    def _stray_text(self, text: str) -> None:
        if self._junk_return == self._call:
            self._stray.append(text)
        else:
            self._content.text(text)

    def _junk_run(self, final: bool) -> bool:
        i = self._buf.find("<", self._pos)
        upto = len(self._buf) if i < 0 else i
        self._stray_text(self._buf[self._pos:upto])
        self._pos = upto
        if i < 0 and not final:
            return False
        self._state = self._junk_return
        return True

    def _end(self) -> None:
        self._content.end()

    def _result(self) -> ToolParseResult:
        return ToolParseResult(self._content.value, list(self._calls.done))
