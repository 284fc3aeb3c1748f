"""Tool-call and reasoning parsers for model output, one-piece or streamed.

    parser = tool_parser("hermes", tools)          # or "qwen3_coder", "minimax"
    result = parser.parse(text)                    # .content, .tool_calls[i].{name, arguments, id, unknown}
    stream = parser.stream()
    for delta in deltas:
        send(stream.feed(delta))                   # ContentDelta / ToolCallDelta events
    send(stream.flush())                           # what was held back at the end
    result = stream.finish()                       # equal to parser.parse("".join(deltas))
                                                   # (without flush(): send result.final_events)

`reasoning_parser()` splits `<think>` blocks off the same way, and `ChatOutputParser`
composes both: reasoning first, then tool calls out of the remaining content only.
For every way of cutting an output into deltas the streamed events concatenate to the
one-piece result (see `spark.parsers.scan` for how).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spark.parsers.chat import (REASONING_PARSERS, TOOL_PARSERS, ChatOutputParser, ChatStream, ReasoningParser,
                                ToolParser)
from spark.parsers.events import (ChatOutput, ContentDelta, Event, ReasoningDelta, ReasoningResult, ToolCall,
                                  ToolCallDelta, ToolParseResult, canonical_arguments, to_openai_tool_call_deltas,
                                  to_openai_tool_calls)
from spark.parsers.reasoning import prompt_ends_in_thinking

__all__ = [
    "REASONING_PARSERS", "TOOL_PARSERS", "ChatOutput", "ChatOutputParser", "ChatStream", "ContentDelta", "Event",
    "ReasoningDelta", "ReasoningParser", "ReasoningResult", "ToolCall", "ToolCallDelta", "ToolParseResult",
    "ToolParser", "canonical_arguments", "detect_tool_parser", "prompt_ends_in_thinking", "reasoning_parser",
    "to_openai_tool_call_deltas", "to_openai_tool_calls", "tool_parser",
]


def tool_parser(name: str, tools: Sequence[dict[str, Any]] | None = None, *,
                id_prefix: str | None = None) -> ToolParser:
    """Make a tool-call parser.

    Args:
      name: "hermes", "qwen3_coder" or "minimax".
      tools: the request's tools, `[{"type": "function", "function": {"name", "parameters"}}]`;
        they type XML-format values and flag calls to unknown tools. None: no typing, no flag.
      id_prefix: prefix of the call ids (default `call_<16 random hex>`).

    Returns:
      A `ToolParser` with `.parse(text)` and `.stream()`.

    Raises:
      ValueError: unknown name; the message lists the known ones.
    """
    return ToolParser(name, tools, id_prefix=id_prefix)


def reasoning_parser(name: str = "think", prompt_ends_in_thinking: bool = False) -> ReasoningParser:
    """Make a reasoning parser.

    Args:
      name: "think" (`<think>...</think>`).
      prompt_ends_in_thinking: the prompt left a `<think>` open, so the output starts as reasoning.

    Returns:
      A `ReasoningParser` with `.parse(text)` and `.stream()`.

    Raises:
      ValueError: unknown name; the message lists the known ones.
    """
    return ReasoningParser(name, prompt_ends_in_thinking)


def detect_tool_parser(chat_template: str | None) -> str | None:
    """Guess the tool-call format from the tags a chat template writes.

    Args:
      chat_template: the template source, or None.

    Returns:
      "minimax", "qwen3_coder", "hermes", or None when the template shows no known format.
    """
    if not chat_template:
        return None
    if "<minimax:tool_call>" in chat_template:
        return "minimax"
    if "<tool_call>" in chat_template:
        return "qwen3_coder" if "<function=" in chat_template else "hermes"
    return None
