"""Context compaction: shrink a conversation, stage by stage, until its prompt fits the context.

A conversation is a list of OpenAI-shaped chat messages (``role``, ``content``, an
assistant's ``tool_calls``, a tool message's ``tool_call_id``). The caller says what
"fits" means (prompt tokens + max_tokens within the context) by passing ``fits``.
Each stage applies to what the previous one left, and ``fits`` is asked after each:

  2. ``truncate_tool_results``: older tool results keep their head and tail only;
  3. ``tool_result_pointers``: older tool results become one-line pointers;
  4. ``drop_oldest_turns``: the oldest turns (a user message and what answered it)
     between the first system message and the latest user message go, as few as fit;
  5. ``keep_last_messages``: the system prompt is trimmed (as little as fits) and only
     the last 4 other messages stay.

(Stage 1 is "as sent": no compaction.) "Older" tool results are all but the trailing
run of tool messages: the results the model is about to read are never touched before
stage 5. The first system message and the latest user message survive stages 2-4.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from spark.http.errors import ApiError
from spark.http.turn import ChatFormat, PreparedTurn, prepare_turn

STAGES = ("truncate_tool_results", "tool_result_pointers", "drop_oldest_turns", "keep_last_messages")
KEEP_HEAD_CHARS = 240  # stage 2 keeps this much of a tool result's start...
KEEP_TAIL_CHARS = 80  # ...and of its end
KEEP_LAST = 4  # messages kept by the last stage, besides the system prompt
ANSWER_SHARE = 4  # a prompt keeps room for the answer's max_tokens, but never more than 1/4 of the context

Messages = list[dict]


class ContextOverflow(ValueError):
    """Even the last stage's conversation does not fit the context."""


def compact_messages(messages: Sequence[dict], fits: Callable[[Messages], bool], *,
                     fits_as_sent: bool | None = None) -> tuple[Messages, str | None]:
    """Compact ``messages`` stage by stage until ``fits`` accepts them.

    Args:
      messages: the conversation (not modified).
      fits: whether a conversation fits the context (renders and counts; called a few
        times, about twice log2 of what fits at most per stage).
      fits_as_sent: whether ``messages`` fit, when the caller knows already (None: ask ``fits``).

    Returns:
      ``(messages, stage)``: the conversation that fits and the name of the last stage
      applied (one of ``STAGES``), or the messages as given and None when they fit as is.

    Raises:
      ContextOverflow: nothing fits, not even the last stage's conversation.
    """
    current = list(messages)
    if fits(current) if fits_as_sent is None else fits_as_sent:
        return current, None
    for stage, transform in zip(STAGES[:2], (_truncate_tool_results, _tool_result_pointers)):
        shrunk = transform(current)
        if shrunk != current:
            current = shrunk
            if fits(current):
                return current, stage
    dropped = _drop_oldest_turns(current, fits)
    if dropped is not None:
        return dropped, STAGES[2]
    kept = _keep_last_messages(current, fits)
    if kept is not None:
        return kept, STAGES[3]
    raise ContextOverflow("the conversation does not fit the context even after compaction: its last "
                          f"{KEEP_LAST} messages are too long")


def answer_reserve(max_model_len: int, max_tokens: int | None, default_max_tokens: int) -> int:
    """The tokens a prompt must leave free: the request's max_tokens (or the server's default),
    capped at 1/``ANSWER_SHARE`` of the context, so that a client asking for a huge max_tokens
    is still served (with max_tokens capped to the room left) rather than compacted to nothing."""
    return max(1, min(max_tokens or default_max_tokens, max_model_len // ANSWER_SHARE))


def prepare_fitting_turn(tokenizer, fmt: ChatFormat, messages: Sequence[dict], *, max_model_len: int, reserve: int,
                         **turn_kwargs) -> tuple[PreparedTurn, str | None]:
    """``spark.http.turn.prepare_turn``, compacting ``messages`` when prompt + ``reserve`` exceeds the context.

    When no stage leaves ``reserve`` tokens free, a prompt that leaves at least one is still
    served (uncompacted if it fits as is, else compacted for one token of room): the answer's
    max_tokens is then capped to the room left, as it would be without compaction.

    Renders the chat template (a few times when compacting): call it off the event loop.

    Returns:
      ``(PreparedTurn, stage)``: stage is None, or the ``STAGES`` name applied.

    Raises:
      ApiError: 400 ``context_length_exceeded`` when even the last stage leaves no room;
        any error of ``prepare_turn``.
    """
    prepare = functools.partial(prepare_turn, tokenizer, fmt, **turn_kwargs)
    # Every message is a token at least: more messages than the context holds need not be rendered
    # (100,000 of them took 1.6 s) to know that they do not fit.
    turn = prepare(list(messages)) if len(messages) <= max_model_len else None
    for need in dict.fromkeys((reserve, 1)):
        fits = functools.partial(_prompt_fits, max_model_len - need)
        if turn is not None and fits(turn):
            return turn, None
        try:
            compacted, stage = compact_messages(messages, lambda m: fits(prepare(m)), fits_as_sent=False)  # noqa: B023
        except ContextOverflow:
            continue
        return prepare(compacted), stage
    turn = turn or prepare(list(messages))
    raise ApiError(400, f"the prompt has {len(turn.prompt.prompt_ids)} tokens, the context holds {max_model_len}: "
                        "no room left to generate, even after compaction (its last messages alone are too long)",
                   param="messages", code="context_length_exceeded")


def _prompt_fits(limit: int, turn: PreparedTurn) -> bool:
    return len(turn.prompt.prompt_ids) <= limit


# -- stages ----------------------------------------------------------------------


def _older_tool_results(messages: Messages) -> list[int]:
    """Indices of the tool messages before the trailing run of tool messages."""
    end = len(messages)
    while end > 0 and messages[end - 1].get("role") == "tool":
        end -= 1
    return [i for i in range(end) if messages[i].get("role") == "tool"]


def _text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts
        return "\n".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content or ""


def _truncate_tool_results(messages: Messages) -> Messages:
    out = list(messages)
    for i in _older_tool_results(messages):
        text = _text(messages[i])
        cut = len(text) - KEEP_HEAD_CHARS - KEEP_TAIL_CHARS
        if cut > 64:  # a marker for less would not save anything
            text = f"{text[:KEEP_HEAD_CHARS]}\n[... {cut} characters truncated ...]\n{text[-KEEP_TAIL_CHARS:]}"
            out[i] = {**messages[i], "content": text}
    return out


def _tool_result_pointers(messages: Messages) -> Messages:
    names = {call.get("id"): (call.get("function") or {}).get("name")
             for m in messages for call in (m.get("tool_calls") or ())}
    out = list(messages)
    for i in _older_tool_results(messages):
        call_id = messages[i].get("tool_call_id")
        name = names.get(call_id) or "a tool"
        pointer = f"[result of {name} (call {call_id}) omitted to fit the context]"
        if len(pointer) < len(_text(messages[i])):
            out[i] = {**messages[i], "content": pointer}
    return out


def _drop_oldest_turns(messages: Messages, fits: Callable[[Messages], bool]) -> Messages | None:
    """Drop the fewest oldest turns between the head and the latest user message that make it fit."""
    start = 1 if messages and messages[0].get("role") == "system" else 0
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    end = users[-1] if users else start  # the latest user message stays
    # A turn starts at a user message (or at the middle's first message) and runs to the next one;
    # dropping whole turns never leaves a tool result without its call.
    starts = [i for i in range(start, end) if i == start or messages[i].get("role") == "user"]
    if not starts:
        return None

    n = len(starts)

    def keeping(j: int) -> Messages:  # the newest j turns kept, the others dropped
        cut = starts[n - j] if j > 0 else end
        return messages[:start] + messages[cut:]

    if not fits(keeping(0)):
        return None
    # The most turns kept that fit, searched from the newest end, doubling and then halving: each
    # try renders about what fits, never the whole conversation (100,000 messages rendered ~17 times
    # took seconds per request).
    fit, over = 0, n  # keeping(fit) fits; keeping(over) does not (keeping(n) is what did not fit)
    j = 1
    while j < over and fits(keeping(j)):
        fit, j = j, 2 * j
    over = min(over, j)
    while over - fit > 1:
        mid = (fit + over) // 2
        if fits(keeping(mid)):
            fit = mid
        else:
            over = mid
    return keeping(fit)


def _keep_last_messages(messages: Messages, fits: Callable[[Messages], bool]) -> Messages | None:
    """The system prompt, trimmed as little as fits, and the last ``KEEP_LAST`` other messages."""
    system = messages[0] if messages and messages[0].get("role") == "system" else None
    tail = messages[1 if system else 0:][-KEEP_LAST:]
    while tail and tail[0].get("role") == "tool":  # its call was cut off
        tail = tail[1:]
    if system is None:
        return tail if fits(tail) else None
    text = _text(system)

    def trimmed(n: int) -> Messages:
        return ([{**system, "content": text[:n]}] if n > 0 else []) + tail

    if fits(trimmed(len(text))):
        return trimmed(len(text))
    if not fits(trimmed(0)):
        return None
    lo, hi = 0, len(text)  # the longest prefix that fits: trimmed(lo) fits, trimmed(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(trimmed(mid)):
            lo = mid
        else:
            hi = mid
    return trimmed(lo)
