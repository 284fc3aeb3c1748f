"""What the output parsers produce: streamed events and one-piece results.

A stream of events and the final result describe the same thing: the `ContentDelta` texts
concatenate to `result.content`, the `ReasoningDelta` texts to `result.reasoning`, and the
`ToolCallDelta.arguments` fragments of call `i` to `result.tool_calls[i].arguments_json()`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import attrs


@attrs.frozen
class ContentDelta:
    """A piece of the answer text."""

    text: str


@attrs.frozen
class ReasoningDelta:
    """A piece of the text the model wrote inside `<think>...</think>`."""

    text: str


@attrs.frozen
class ToolCallDelta:
    """A piece of tool call number `index` (0-based, in order of appearance).

    `id` and `name` are set on the call's first event only; `arguments` is the next fragment
    of the call's canonical JSON arguments string (possibly empty).
    """

    index: int
    id: str | None
    name: str | None
    arguments: str


Event = ContentDelta | ReasoningDelta | ToolCallDelta


@attrs.frozen
class ToolCall:
    """One parsed call. `unknown` is True when tools were given and `name` is not among them.

    A call the output ended inside (cut off by the token limit) is `incomplete`: its name was
    whole, its arguments are what came before the end. Where those are a JSON object cut short
    (hermes), `arguments` is {} and `cut_arguments` holds the text as far as it went, which is
    what streams (OpenAI's `arguments` is a string and carries it; an API that needs an object
    takes `arguments`).
    """

    name: str
    arguments: dict[str, Any]
    id: str
    unknown: bool = False
    incomplete: bool = False
    cut_arguments: str | None = None

    def arguments_json(self) -> str:
        """The arguments as the JSON text that streamed: canonical, or the cut text."""
        return canonical_arguments(self.arguments) if self.cut_arguments is None else self.cut_arguments


@attrs.frozen
class ToolParseResult:
    """Output of a tool-call parser: the text outside the calls, and the calls."""

    content: str
    tool_calls: list[ToolCall]
    final_events: tuple[Event, ...] = attrs.field(default=(), eq=False, repr=False)
    """The events that `finish()` released when `flush()` was not called; send them last."""


@attrs.frozen
class ReasoningResult:
    """Output of a reasoning parser."""

    reasoning: str
    content: str
    final_events: tuple[Event, ...] = attrs.field(default=(), eq=False, repr=False)
    """The events that `finish()` released when `flush()` was not called; send them last."""


@attrs.frozen
class ChatOutput:
    """Output of `ChatOutputParser`: reasoning split off first, then tool calls out of the rest."""

    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    final_events: tuple[Event, ...] = attrs.field(default=(), eq=False, repr=False)
    """The events that `finish()` released when `flush()` was not called; send them last."""


def canonical_arguments(arguments: dict[str, Any]) -> str:
    """The one JSON spelling of a call's arguments that the streams produce, fragment by fragment.

    Args:
      arguments: the call's arguments.

    Returns:
      `json.dumps` with its default separators, non-ASCII kept as is.
    """
    return json.dumps(arguments, ensure_ascii=False)


def to_openai_tool_call_deltas(events: Iterable[Event]) -> list[dict[str, Any]]:
    """Turn the tool-call events of one feed into OpenAI `choices[].delta.tool_calls` items.

    Consecutive events of the same call are merged into one item. Content and reasoning
    events are skipped (they go to `delta.content` / `delta.reasoning_content`).

    Args:
      events: events from `feed` or `flush`.

    Returns:
      Dicts `{"index", "id", "type", "function": {"name", "arguments"}}` for a call's first
      item, `{"index", "function": {"arguments"}}` for the later ones.
    """
    items: list[dict[str, Any]] = []
    for event in events:
        if not isinstance(event, ToolCallDelta):
            continue
        if items and items[-1]["index"] == event.index and event.id is None:
            items[-1]["function"]["arguments"] += event.arguments
            continue
        if event.id is None:
            items.append({"index": event.index, "function": {"arguments": event.arguments}})
        else:
            function = {"name": event.name, "arguments": event.arguments}
            items.append({"index": event.index, "id": event.id, "type": "function", "function": function})
    return items


def to_openai_tool_calls(tool_calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """Turn parsed calls into an OpenAI (non-streamed) `message.tool_calls` list.

    Args:
      tool_calls: `result.tool_calls`.

    Returns:
      Dicts `{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}`.
    """
    return [{"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments_json()}}
            for call in tool_calls]


def merge_events(events: Iterable[Event]) -> list[Event]:
    """Join neighbouring events that continue each other (same kind of text, same call)."""
    if isinstance(events, list) and len(events) <= 1:  # the common case when streaming
        return [e for e in events if not isinstance(e, (ContentDelta, ReasoningDelta)) or e.text]
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + event.text)
        elif isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + event.text)
        elif (isinstance(event, ToolCallDelta) and isinstance(last, ToolCallDelta)
              and event.index == last.index and event.id is None):
            out[-1] = attrs.evolve(last, arguments=last.arguments + event.arguments)
        elif not (isinstance(event, (ContentDelta, ReasoningDelta)) and not event.text):
            out.append(event)
    return out
