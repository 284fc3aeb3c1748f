"""OpenAI response objects, built from ``RequestOutput`` pieces (pure functions, no I/O)."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Sequence

from spark.actors.messages import TokenLogprob
from spark.parsers import ReasoningDelta, ToolCallDelta, to_openai_tool_call_deltas
from spark.parsers.citations import Citation
from spark.parsers.refusal import RefusalDelta

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of a stream

_BYTE_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # one encoder: json.dumps(**kw) builds one a call
SLOT = "\x00slot\x00"  # where ``sse_template`` fills its string in


def sse(obj: dict) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + _JSON.encode(obj).encode() + b"\n\n"


def sse_template(obj: dict) -> Callable[[str], bytes]:
    """``sse`` of ``obj`` with ``SLOT`` (once, as a string value) replaced by a text given later.

    A streamed chunk differs from the last only in its text; filling in the encoded text
    costs a small part of building and encoding the whole dict again.

    Returns:
        ``fill(text) -> bytes``, equal to ``sse(obj)`` with ``text`` in place of ``SLOT``.
    """
    before, after = sse(obj).split(_JSON.encode(SLOT).encode())
    encode = _JSON.encode

    def fill(text: str) -> bytes:
        return before + encode(text).encode() + after

    return fill


def token_bytes(token: str) -> list[int]:
    """The UTF-8 bytes of a token's text, with its ``\\xNN`` escapes (bytes that are not UTF-8) undone."""
    out, pos = bytearray(), 0
    for m in _BYTE_ESCAPE.finditer(token):
        out += token[pos:m.start()].encode()
        out.append(int(m[1], 16))
        pos = m.end()
    out += token[pos:].encode()
    return list(out)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the prefix cache held (not computed)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": min(cached_tokens, prompt_tokens)}}


# -- chat -----------------------------------------------------------------------


def token_logprobs(logprobs: Sequence[TokenLogprob]) -> list[dict]:
    """One entry per token, with its alternatives: chat's ``logprobs.content``, and the Responses API's
    ``output_text`` logprobs, which have the same shape."""
    return [{"token": lp.token, "logprob": lp.logprob, "bytes": token_bytes(lp.token),
             "top_logprobs": [{"token": t, "logprob": p, "bytes": token_bytes(t)} for _, t, p in lp.top]}
            for lp in logprobs]


def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> dict:
    """``choices[].logprobs`` of a chat completion."""
    return {"content": token_logprobs(logprobs)}


def chat_chunk(head: dict, index: int, delta: dict, *, finish_reason: str | None = None,
               logprobs: Sequence[TokenLogprob] | None = None) -> dict:
    """A ``chat.completion.chunk`` with one choice; ``head`` holds id, created and model."""
    choice = {"index": index, "delta": delta, "logprobs": None if logprobs is None else chat_logprobs(logprobs),
              "finish_reason": finish_reason}
    return {**head, "object": "chat.completion.chunk", "choices": [choice]}


def chat_delta(event) -> dict:
    """The ``delta`` of a chunk carrying one ``spark.http.turn`` event (content, reasoning, refusal or a call)."""
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, RefusalDelta):
        return {"refusal": event.text}
    if isinstance(event, ToolCallDelta):
        return {"tool_calls": to_openai_tool_call_deltas([event])}
    return {"content": event.text}


def url_citations(citations: Sequence[Citation]) -> list[dict]:
    """Chat completions' ``annotations``: one ``url_citation`` per citation."""
    return [{"type": "url_citation", "url_citation": {"start_index": c.start, "end_index": c.end, "url": c.url,
                                                      "title": c.title}} for c in citations]


def chat_message(result, *, reasoning: bool) -> dict:
    """The assistant ``message`` of a ``TurnResult``: content (None when only calls, or a refusal), refusal
    (None unless the answer refused), calls, reasoning, and the content's links as ``annotations``."""
    message = {"role": "assistant", "content": result.content or (None if result.tool_calls or result.refusal else ""),
               "refusal": result.refusal or None}
    if result.citations:
        message["annotations"] = url_citations(result.citations)
    if reasoning:
        message["reasoning_content"] = result.reasoning or None
    if result.tool_calls:
        message["tool_calls"] = result.openai_tool_calls()
    return message


def chat_choice(index: int, message: dict, finish_reason: str | None,
                logprobs: Sequence[TokenLogprob] | None) -> dict:
    return {"index": index, "message": message,
            "logprobs": None if logprobs is None else chat_logprobs(logprobs), "finish_reason": finish_reason}


# -- legacy completions ---------------------------------------------------------------


class TextOffsets:
    """The legacy ``text_offset`` of tokens, one after another: the character of the returned text where
    each token's text begins.

    A token's text is bytes (``token_bytes``), and a byte-level token may hold part of a character
    (half an emoji): its offset is that of the character it starts or continues. (The lengths of the
    escaped token strings, ``\\xf0\\x9f``, overcounted every character of more than one byte.)
    """

    def __init__(self, start: int = 0):
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")  # as the text itself is decoded
        self._at = start  # the characters completed so far

    def take(self, tokens: Sequence[str], end: int | None = None) -> list[int]:
        """The offsets of ``tokens``, which follow those taken before; none past ``end`` (the text's length:
        a stop string cut the text short, or special tokens were left out of it), when given."""
        offsets = []
        for token in tokens:
            offsets.append(self._at if end is None else min(self._at, end))
            self._at += len(self._decoder.decode(bytes(token_bytes(token))))
        return offsets


def completion_logprobs(logprobs: Sequence[TokenLogprob], offsets: TextOffsets, end: int | None = None) -> dict:
    """The legacy ``logprobs`` object of generated tokens, their ``text_offset`` taken from ``offsets``
    (``TextOffsets.take``); each position's ``top_logprobs`` holds the token sampled there, as OpenAI's."""
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [_with_sampled(lp) for lp in logprobs],
        "text_offset": offsets.take([lp.token for lp in logprobs], end),
    }


def _with_sampled(lp: TokenLogprob) -> dict[str, float]:
    """A position's alternatives and the token sampled there (the logprobs + 1 entries OpenAI gives at most):
    sampling at a temperature often picks a token outside the top ones."""
    return {**{t: p for _, t, p in lp.top}, lp.token: lp.logprob}


def echoed_logprobs(prompt_tokens: Sequence[str], prompt_text: str, scored: Sequence[TokenLogprob] | None = None,
                    logprobs: dict | None = None) -> dict:
    """The legacy ``logprobs`` object of an echoed prompt's tokens, followed by ``logprobs`` (the generated
    tokens', from ``completion_logprobs`` with offsets past ``prompt_text``) when given.

    The first prompt token's logprob is null (nothing comes before it, as OpenAI's); the others' are
    ``scored`` (the engine's prompt logprobs: the prompt's tokens after the first), null when not given.
    """
    offsets = TextOffsets().take(prompt_tokens, len(prompt_text))
    k = len(prompt_tokens)
    if scored is None:
        token_logprobs, top = [None] * k, [None] * k
    else:
        token_logprobs = [None] + [lp.logprob for lp in scored]
        top = [None] + [{t: p for _, t, p in lp.top} for lp in scored]
    echoed = {"tokens": list(prompt_tokens), "token_logprobs": token_logprobs, "top_logprobs": top,
              "text_offset": offsets}
    return echoed if logprobs is None else {key: echoed[key] + logprobs[key] for key in echoed}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
