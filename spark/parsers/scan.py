"""Machinery shared by the incremental parsers.

Every parser is a state machine over a buffer of not-yet-consumed text. `feed` appends a
delta and lets the current state consume what it can decide; a state stops when the answer
depends on text that has not arrived (a possible tag prefix such as "<to"). Since each
decision looks only at the text itself, never at where the deltas were cut, any split of
an output yields the same events, concatenated, as the one-piece parse, which is simply
`feed(text)` then `finish()`. Consumed text is dropped at the next feed, and states keep
scan positions, so a long output fed one character at a time is parsed in linear time.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

import attrs

from spark.parsers.events import ContentDelta, Event, ReasoningDelta, ToolCall, ToolCallDelta, merge_events

# `tag_at` answer when the buffer ends inside what could still become one of the tags.
MORE = "<more>"
_NON_SPACE = re.compile(r"\S")


def find_tag(buf: str, start: int, tags: Sequence[str], final: bool) -> tuple[int, str | None]:
    """Find the first of `tags` (each starting with "<") in `buf[start:]`.

    Args:
      buf: the buffer.
      start: where to start looking.
      tags: the tags.
      final: no more text will come, so a tag prefix at the end is plain text.

    Returns:
      `(i, tag)` for the first tag found at `i`; else `(safe, None)` where `buf[start:safe]`
      holds no tag and `buf[safe:]` is a proper prefix of a tag, held back (empty if final).
    """
    i = buf.find("<", start)
    while i >= 0:
        tag = tag_at(buf, i, tags, final)
        if tag is MORE:
            return i, None
        if tag is not None:
            return i, tag
        i = buf.find("<", i + 1)
    return len(buf), None


def tag_at(buf: str, i: int, tags: Sequence[str], final: bool) -> str | None:
    """Which of `tags` starts at `buf[i]`: the tag, None, or MORE when undecided yet."""
    for tag in tags:
        if buf.startswith(tag, i):
            return tag
    rest = len(buf) - i
    if not final and any(rest < len(tag) and tag.startswith(buf[i:]) for tag in tags):
        return MORE
    return None


def first_non_space(buf: str, start: int) -> int:
    """Index of the first non-whitespace character at or after `start`, or -1."""
    m = _NON_SPACE.search(buf, start)
    return -1 if m is None else m.start()


class Sink:
    """Collects the events of one `feed`, joining those that continue each other."""

    def __init__(self) -> None:
        self._events: list[Event] = []

    def content(self, text: str) -> None:
        if text:
            self._events.append(ContentDelta(text))

    def reasoning(self, text: str) -> None:
        if text:
            self._events.append(ReasoningDelta(text))

    def tool(self, index: int, call_id: str | None, name: str | None, arguments: str) -> None:
        self._events.append(ToolCallDelta(index, call_id, name, arguments))

    def take(self) -> list[Event]:
        events, self._events = merge_events(self._events), []
        return events


class TextMachine:
    """Base of the incremental parsers: owns the buffer and the feed/flush/finish protocol.

    Subclasses implement `_step(final) -> bool`, which consumes from `self._buf[self._pos:]`
    what it can decide and returns whether it made progress; with `final` it must consume
    everything eventually. `_end()` then settles what the last state still holds, and
    `_result()` builds the result.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._pos = 0
        self._sink = Sink()
        self._flushed = False
        self._result_value: Any = None

    def feed(self, delta: str) -> list[Event]:
        """Add the next piece of model output.

        Args:
          delta: any amount of text, down to one character.

        Returns:
          The events that this text made certain, possibly none.
        """
        if self._flushed:
            raise RuntimeError("feed() after the end of the output")
        if self._pos:
            self._buf = self._buf[self._pos:]
            self._pos = 0
        self._buf += delta
        while self._step(False):
            pass
        return self._sink.take()

    def flush(self) -> list[Event]:
        """Mark the end of the output and return the events of the text held until now.

        A streaming caller sends these before calling `finish()`; calling it twice returns [].
        """
        if self._flushed:
            return []
        self._flushed = True
        while self._step(True):
            pass
        self._end()
        return self._sink.take()

    def finish(self) -> Any:
        """End the output and return the parse result.

        If `flush()` was not called, the events it would have returned are in the result's
        `final_events`.
        """
        if self._result_value is None:
            tail = self.flush()
            self._result_value = attrs.evolve(self._result(), final_events=tuple(tail))
        return self._result_value

    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    def _end(self) -> None:
        pass

    def _result(self) -> Any:
        raise NotImplementedError


class Content:
    """The content side of a tool-call stream.

    Text is passed on as it comes, except that a segment holding only whitespace between
    a tool call and the next call, the start or the end (the newlines around calls) is
    dropped: while a segment has no other text yet, its whitespace is held.
    """

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._parts: list[str] = []
        self._held = ""
        self._has_text = False
        self._calls = False

    def text(self, text: str) -> None:
        if not self._has_text:
            if not text or text.isspace():
                self._held += text
                return
            text, self._held, self._has_text = self._held + text, "", True
        self._emit(text)

    def boundary(self) -> None:
        """A tool call starts or ends here."""
        self._held, self._has_text, self._calls = "", False, True

    def end(self) -> None:
        """The output ended: with no call at all, held whitespace is the whole answer."""
        if not self._calls:
            self._emit(self._held)

    def _emit(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._sink.content(text)

    @property
    def value(self) -> str:
        return "".join(self._parts)


def tool_schemas(tools: Sequence[dict[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
    """Map tool name -> JSON schema of its parameters, from OpenAI-shaped tools.

    Args:
      tools: `[{"type": "function", "function": {"name", "parameters"}}]`; a bare
        `{"name", "parameters"}` item is accepted too. None when the request has no tools.

    Returns:
      The map, or None when `tools` is None.
    """
    if tools is None:
        return None
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            schemas[function["name"]] = parameters if isinstance(parameters, dict) else {}
    return schemas


def new_id_prefix() -> str:
    """A fresh `call_<16 hex>` prefix; seed `random` to make it reproducible."""
    return f"call_{random.getrandbits(64):016x}"


class Calls:
    """The tool calls of one stream: ids, the unknown flag, parameter schemas, the results."""

    def __init__(self, tools: dict[str, dict[str, Any]] | None, id_prefix: str) -> None:
        self._tools = tools
        self._id_prefix = id_prefix
        self.done: list[ToolCall] = []
        self.started = 0

    def start(self) -> tuple[int, str]:
        """Number the next call; returns its index and id."""
        index, self.started = self.started, self.started + 1
        return index, f"{self._id_prefix}{index:08x}"

    def unknown(self, name: str) -> bool:
        return self._tools is not None and name not in self._tools

    def param_schema(self, tool: str, param: str) -> dict[str, Any] | None:
        properties = (self._tools or {}).get(tool, {}).get("properties")
        schema = properties.get(param) if isinstance(properties, dict) else None
        return schema if isinstance(schema, dict) else None
