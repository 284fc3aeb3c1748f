"""Test helpers: feed an output in pieces and check the events against the result."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from spark.parsers import ContentDelta, ReasoningDelta, ToolCallDelta


def pieces_at(text: str, cuts: Sequence[int]) -> list[str]:
    """Cut `text` at the given positions (any order, duplicates give empty pieces)."""
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def random_cuts(text: str, rng: random.Random) -> list[int]:
    return [rng.randint(0, len(text)) for _ in range(rng.randint(1, max(1, len(text) // 3)))]


def stream_pieces(make_stream: Callable[[], Any], pieces: Sequence[str], flush: bool = True) -> tuple[Any, list[Any]]:
    """Feed `pieces` to a fresh stream; returns (result, all events).

    The last events come from `flush()`, or with `flush=False` from `finish().final_events`.
    """
    stream = make_stream()
    events: list[Any] = []
    for piece in pieces:
        events += stream.feed(piece)
    if flush:
        events += stream.flush()
        result = stream.finish()
        assert result.final_events == ()
    else:
        result = stream.finish()
        events += result.final_events
    return result, events


def check_events(result: Any, events: Sequence[Any]) -> None:
    """The events must concatenate to `result` (content, reasoning, calls in order, ids, names)."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert content == result.content
    if hasattr(result, "reasoning"):
        assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == result.reasoning
    else:
        assert not any(isinstance(e, ReasoningDelta) for e in events)
    # A call's deltas come one after another, text between them waits (the APIs stream a call as
    # one item or block). Not yet reasoning: a <think> block written inside an XML call splits it.
    kinds = [e.index if isinstance(e, ToolCallDelta) else None for e in events if not isinstance(e, ReasoningDelta)]
    runs = [k for i, k in enumerate(kinds) if k is not None and (i == 0 or kinds[i - 1] != k)]
    assert len(runs) == len(set(runs)), events
    calls: list[dict[str, Any]] = []
    for event in events:
        if not isinstance(event, ToolCallDelta):
            continue
        if event.index == len(calls):  # a call's first event names it
            assert event.id is not None and event.name is not None
            calls.append({"id": event.id, "name": event.name, "arguments": event.arguments})
        else:
            assert event.index < len(calls) and event.id is None and event.name is None
            calls[event.index]["arguments"] += event.arguments
    tool_calls = getattr(result, "tool_calls", [])
    assert [c["id"] for c in calls] == [c.id for c in tool_calls]
    assert [c["name"] for c in calls] == [c.name for c in tool_calls]
    assert [c["arguments"] for c in calls] == [c.arguments_json() for c in tool_calls]


def assert_split_invariant(make_stream: Callable[[], Any], text: str, expected: Any,
                           splits: Sequence[Sequence[int]]) -> None:
    """Every split of `text` streams to `expected`, with consistent events."""
    for n, cuts in enumerate(splits):
        result, events = stream_pieces(make_stream, pieces_at(text, cuts), flush=n % 2 == 0)
        assert result == expected, f"cuts={list(cuts)}"
        check_events(result, events)
