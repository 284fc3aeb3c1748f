"""The streamer actor: tokens -> text pieces for each request's stream.

Per request it keeps an incremental detokenizer and a stop-string matcher:
text that could still be the start of a stop string is held back, so a client
never sees part of one; when one matches, the output ends just before it and
the scheduler is told to free the request's pages. It also records the
latency metrics, since it sees every token as it leaves.
"""

from __future__ import annotations

import logging

import attrs
import trio

from spark.actors.channels import take_waiting
from spark.actors.messages import Cancel, RequestOutput, StreamOpen, Submission, TokenLogprob
from spark.core.events import Failed, PrefixHit, TokenBatch
from spark.core.plan import TokenOutput
from spark.engine.detokenizer import IncrementalDetokenizer
from spark.metrics import Metrics

log = logging.getLogger("spark.streamer")


class StopMatcher:
    """Finds stop strings across piece boundaries, holding back what might begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string that matched or None)."""
        if not self.stops:
            return text, None
        buf = self.held + text
        # The stop that *completes* first wins (then the earliest start): that is
        # the one a token-by-token reader meets first, whatever the piece sizes.
        hits = [(buf.find(s) + len(s), buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            _, index, stop = min(hits)
            self.held = ""
            return buf[:index], stop
        keep = 0
        for s in self.stops:  # longest suffix of buf that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


@attrs.define(eq=False)
class _Stream:
    submission: Submission
    detok: IncrementalDetokenizer | None
    stop: StopMatcher
    num_output: int = 0
    last_time: float | None = None
    num_cached: int = 0  # prompt tokens its prefill found cached
    # Logprobs go out with their token's text: (the character of the text where the token's own
    # begins, its logprob) for each token whose text is not out yet (held back as the possible
    # start of a stop string, or bytes of a character not complete). A stop string drops those
    # whose text begins at or after it, and the token the engine stopped on has none: the tokens
    # then join into the text, as OpenAI's logprobs (chat, completions, Responses) do.
    logprobs_held: list[tuple[int, TokenLogprob]] = attrs.Factory(list)
    text_made: int = 0  # characters the detokenizer has made
    text_sent: int = 0  # ... and those sent, held ones not counted


async def run(
    tokenizer,
    inbox: trio.MemoryReceiveChannel,
    cancels: trio.MemorySendChannel,
    metrics: Metrics,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    streams: dict[str, _Stream] = {}
    async with inbox, cancels:
        task_status.started()
        while True:
            try:
                first = await inbox.receive()
            except trio.EndOfChannel:
                return
            # Whatever else is waiting goes in the same turn: when the engine is ahead of the
            # event loop a stream then gets its tokens back to back, and its reader takes
            # them as one piece (``RequestStream``) instead of one per step.
            messages = take_waiting(inbox, [first])
            for msg in messages:
                if isinstance(msg, TokenBatch):
                    await _on_batch(streams, msg, tokenizer, cancels, metrics)
                elif isinstance(msg, StreamOpen):
                    req = msg.submission.request
                    detok = IncrementalDetokenizer(tokenizer, req.prompt_ids,
                                                   skip_special_tokens=req.skip_special_tokens) if tokenizer else None
                    streams[req.request_id] = _Stream(msg.submission, detok, StopMatcher(req.stop))
                elif isinstance(msg, PrefixHit):
                    if msg.request_id in streams:
                        streams[msg.request_id].num_cached = msg.cached_tokens
                elif isinstance(msg, Failed):
                    _on_failed(streams, msg)


async def _on_batch(streams: dict[str, _Stream], batch: TokenBatch, tokenizer, cancels, metrics: Metrics) -> None:
    seen = 0
    for out in batch.outputs:
        stream = streams.get(out.seq_id)
        if stream is None:
            continue  # ended here already (stop string): the scheduler is dropping it
        seen += 1
        if _on_token(stream, out, batch.time, tokenizer, metrics):
            del streams[out.seq_id]
            if out.finish_reason is None:  # a stop string ended it, not the engine
                await cancels.send(Cancel(out.seq_id))
    metrics.generation_tokens.inc(seen)  # once per step, not per token


def _on_failed(streams: dict[str, _Stream], msg: Failed) -> None:
    stream = streams.pop(msg.request_id, None)
    if stream is not None:
        text, logprobs = "", ()
        if msg.reason == "length" and stream.detok:  # a normal end: release held text, and its tokens
            text = stream.stop.feed(stream.detok.flush())[0] + stream.stop.flush()
            logprobs = _logprobs_out(stream, everything=True)
        _send(stream, RequestOutput(
            msg.request_id, text, (), logprobs, finish_reason=msg.reason,
            error=msg.error if msg.reason == "error" else None,
            num_prompt_tokens=len(stream.submission.request.prompt_ids), num_output_tokens=stream.num_output,
            num_cached_tokens=stream.num_cached,
        ), close=True)


def _on_token(stream: _Stream, out: TokenOutput, now: float, tokenizer, metrics: Metrics) -> bool:
    """Turn one token into a piece on the request's channel. Returns True when the stream ended."""
    sub = stream.submission
    req = sub.request
    stream.num_output += 1
    if stream.last_time is None:
        metrics.time_to_first_token.observe(now - sub.arrival)
        error = metrics.ttft.first_token(req.request_id, now - sub.arrival)
        if error is not None:
            metrics.ttft_prediction_error.observe(error)
    else:
        metrics.inter_token_latency.observe(now - stream.last_time)
    stream.last_time = now
    start = stream.text_made
    text = stream.detok.push(out.token_id) if stream.detok else ""
    if out.finish_reason is not None and stream.detok:
        text += stream.detok.flush()
    stream.text_made += len(text)
    text, stop = stream.stop.feed(text)
    finish = "stop" if stop is not None else out.finish_reason
    if finish is not None and stop is None:
        text += stream.stop.flush()
    stream.text_sent += len(text)
    # The token the engine stopped on (EOS, a stop token) is a control token that writes no text: no entry.
    if req.params.logprobs is not None and out.logprob is not None and out.finish_reason != "stop":
        stream.logprobs_held.append((start, _token_logprob(tokenizer, out.token_id, out.logprob, out.top_logprobs)))
    logprobs = _logprobs_out(stream, everything=(finish is not None and stop is None) or not stream.detok)
    prompt = None
    if out.prompt_logprobs is not None:
        prompt = tuple(_token_logprob(tokenizer, p.token_id, p.logprob, p.top_logprobs) for p in out.prompt_logprobs)
    piece = RequestOutput(
        req.request_id, text, (out.token_id,), logprobs, finish_reason=finish, stop_string=stop,
        num_prompt_tokens=len(req.prompt_ids), num_output_tokens=stream.num_output, num_cached_tokens=stream.num_cached,
        prompt_logprobs=prompt,
    )
    if finish is not None:
        metrics.e2e_request_latency.observe(now - sub.arrival)
    _send(stream, piece, close=finish is not None)
    return finish is not None


def _logprobs_out(stream: _Stream, *, everything: bool = False) -> tuple[TokenLogprob, ...]:
    """The held logprobs whose token's text has begun to go out (``everything``: all of them, at a
    normal end), in order; after a stop string the rest are dropped by the stream's end."""
    held = stream.logprobs_held
    cut = len(held) if everything else next((k for k, (at, _) in enumerate(held) if at >= stream.text_sent), len(held))
    out = tuple(lp for _, lp in held[:cut])
    del held[:cut]
    return out


def _send(stream: _Stream, piece: RequestOutput, *, close: bool) -> None:
    # The request's channel holds max_tokens pieces, so this never blocks the
    # streamer on one slow client; a client that left has closed its end.
    out: trio.MemorySendChannel = stream.submission.out
    try:
        out.send_nowait(piece)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    except trio.WouldBlock:
        log.warning("stream %s is full; dropping a piece", piece.request_id)
    if close:
        out.close()


def _token_logprob(tokenizer, token_id: int, logprob: float, top: tuple[tuple[int, float], ...]) -> TokenLogprob:
    return TokenLogprob(token_id, _token_text(tokenizer, token_id), logprob,
                        tuple((t, _token_text(tokenizer, t), lp) for t, lp in top))


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.token_text(token_id) if tokenizer else ""
