"""Parser objects: a tool-call parser, a reasoning parser, and both composed for a chat reply.

Each parser object is configuration only; `.stream()` makes an incremental parser for one
output (`feed` / `flush` / `finish`) and `.parse(text)` is a stream fed the whole text.
Call ids come from the parser object's id prefix plus the call's index, so `.parse` and
every `.stream()` of one object give the same ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spark.parsers.events import (ChatOutput, ContentDelta, Event, ReasoningResult, ToolParseResult,
                                  merge_events)
from spark.parsers.hermes import HermesStream
from spark.parsers.reasoning import ThinkStream
from spark.parsers.scan import Calls, TextMachine, new_id_prefix, tool_schemas
from spark.parsers.xml_calls import MINIMAX, QWEN3_CODER, XmlStream

_TOOL_STREAMS: dict[str, Callable[[Calls], TextMachine]] = {
    "hermes": HermesStream,
    "qwen3_coder": lambda calls: XmlStream(QWEN3_CODER, calls),
    "minimax": lambda calls: XmlStream(MINIMAX, calls),
}
TOOL_PARSERS = tuple(_TOOL_STREAMS)
REASONING_PARSERS = ("think",)


class ToolParser:
    """A tool-call format plus the request's tools.

    Args:
      name: one of `TOOL_PARSERS`.
      tools: the request's tools in OpenAI shape, or None.
      id_prefix: call ids are `id_prefix` + 8 hex digits of the index; by default
        `call_` + 16 random hex digits from `random` (seed it for reproducible ids).
    """

    def __init__(self, name: str, tools: Sequence[dict[str, Any]] | None = None, *, id_prefix: str | None = None):
        if name not in _TOOL_STREAMS:
            raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
        self.name = name
        self._schemas = tool_schemas(tools)
        self.id_prefix = new_id_prefix() if id_prefix is None else id_prefix

    def stream(self) -> TextMachine:
        """A fresh incremental parser: `.feed(delta) -> events`, `.flush() -> events`, `.finish() -> result`."""
        return _TOOL_STREAMS[self.name](Calls(self._schemas, self.id_prefix))

    def parse(self, text: str) -> ToolParseResult:
        """Parse a whole output; the result has `.content` and `.tool_calls`."""
        stream = self.stream()
        stream.feed(text)
        return stream.finish()


class ReasoningParser:
    """The `<think>` reasoning format.

    Args:
      name: one of `REASONING_PARSERS`.
      prompt_ends_in_thinking: the prompt left a `<think>` open, so the output starts inside it.
    """

    def __init__(self, name: str = "think", prompt_ends_in_thinking: bool = False):
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
        self.name = name
        self.prompt_ends_in_thinking = prompt_ends_in_thinking

    def stream(self) -> ThinkStream:
        """A fresh incremental parser: `.feed(delta) -> events`, `.flush() -> events`, `.finish() -> result`."""
        return ThinkStream(self.prompt_ends_in_thinking)

    def parse(self, text: str) -> ReasoningResult:
        """Parse a whole output; the result has `.reasoning` and `.content`."""
        stream = self.stream()
        stream.feed(text)
        return stream.finish()


class ChatStream:
    """Reasoning split off first; the tool parser sees only the content that remains."""

    def __init__(self, reasoning: ThinkStream | None, tools: TextMachine | None):
        self._reasoning = reasoning
        self._tools = tools
        self._plain: list[str] = []  # the content when there is no tool parser
        self._flushed = False
        self._result: ChatOutput | None = None

    def feed(self, delta: str) -> list[Event]:
        """Add output text; returns content, reasoning and tool-call events."""
        if self._flushed:
            raise RuntimeError("feed() after the end of the output")
        events = self._reasoning.feed(delta) if self._reasoning else [ContentDelta(delta)]
        return self._route(events)

    def flush(self) -> list[Event]:
        """Mark the end of the output; returns the events of the text held until now."""
        if self._flushed:
            return []
        self._flushed = True
        events = self._route(self._reasoning.flush()) if self._reasoning else []
        if self._tools:
            events = merge_events(events + self._tools.flush())
        return events

    def finish(self) -> ChatOutput:
        """End the output and return reasoning, content and tool calls.

        If `flush()` was not called, the events it would have returned are in the result's
        `final_events`.
        """
        if self._result is None:
            tail = self.flush()
            reasoning = self._reasoning.finish() if self._reasoning else None
            tools = self._tools.finish() if self._tools else None
            content = tools.content if tools else "".join(self._plain)
            self._result = ChatOutput(reasoning.reasoning if reasoning else "", content,
                                      tools.tool_calls if tools else [], final_events=tuple(tail))
        return self._result

    def _route(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if not isinstance(event, ContentDelta):
                out.append(event)
            elif self._tools:
                out += self._tools.feed(event.text)
            elif event.text:
                self._plain.append(event.text)
                out.append(event)
        return merge_events(out)


class ChatOutputParser:
    """Reasoning and tool-call parsing of chat replies, composed.

    The object is itself a stream for one reply (`feed` / `flush` / `finish`); `.stream()`
    makes more and `.parse(text)` parses a whole reply, sharing the call-id prefix.

    Args:
      tool_parser_name: one of `TOOL_PARSERS`, or None for no tool-call parsing.
      reasoning: split `<think>` blocks off as reasoning.
      tools: the request's tools in OpenAI shape, or None.
      prompt_ends_in_thinking: the prompt left a `<think>` open (see `prompt_ends_in_thinking`).
      id_prefix: as for `ToolParser`.
    """

    def __init__(self, tool_parser_name: str | None, reasoning: bool, tools: Sequence[dict[str, Any]] | None = None,
                 prompt_ends_in_thinking: bool = False, *, id_prefix: str | None = None):
        self._tool_parser = ToolParser(tool_parser_name, tools, id_prefix=id_prefix) if tool_parser_name else None
        self._reasoning_parser = ReasoningParser("think", prompt_ends_in_thinking) if reasoning else None
        self._own: ChatStream | None = None

    def stream(self) -> ChatStream:
        """A fresh stream for one reply."""
        return ChatStream(self._reasoning_parser.stream() if self._reasoning_parser else None,
                          self._tool_parser.stream() if self._tool_parser else None)

    def parse(self, text: str) -> ChatOutput:
        """Parse a whole reply."""
        stream = self.stream()
        stream.feed(text)
        return stream.finish()

    def feed(self, delta: str) -> list[Event]:
        """`feed` on this object's own stream."""
        return self._own_stream().feed(delta)

    def flush(self) -> list[Event]:
        """`flush` on this object's own stream."""
        return self._own_stream().flush()

    def finish(self) -> ChatOutput:
        """`finish` on this object's own stream."""
        return self._own_stream().finish()

    def _own_stream(self) -> ChatStream:
        if self._own is None:
            self._own = self.stream()
        return self._own
