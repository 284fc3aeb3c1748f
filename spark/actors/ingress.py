"""The ingress: the system's front door for the HTTP layer.

``submit`` checks a request against the limits (context, KV pool, rate),
opens the request's own output channel and queues it for the scheduler —
all synchronously, so a refusal (400/429/503) is answered at once and a full
queue never grows. Tokenizing stays with the HTTP handlers, which know each
API's prompt shape. The returned ``RequestStream`` is how a handler reads the
output; leaving it early cancels the request.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from spark.actors.messages import Cancel, GenerateRequest, RequestOutput, Submission, Unpin
from spark.actors.rate_limiter import RateLimiter

OVERLOADED = "overloaded"  # a SubmitError's code when the predicted TTFT passes the bound (Anthropic: 529)


class SubmitError(Exception):
    """A request refused before it started: ``status`` 400/429/503, ``retry_after`` seconds or None."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


class RequestStream:
    """The pieces of one request. ``async with`` it; leaving before the end cancels the request.

    A reader slower than the engine finds several pieces waiting; it gets them as one
    merged piece (``RequestOutput.merge``), so it formats and sends one chunk, not one
    per token. An error piece is never merged: the text before it comes first, as it
    would have one token at a time.
    """

    def __init__(self, request_id: str, pieces: trio.MemoryReceiveChannel, cancels: trio.MemorySendChannel,
                 on_close: Callable[[str], None] = lambda request_id: None):
        self.request_id = request_id
        self._on_close = on_close
        self._pieces = pieces
        self._cancels = cancels
        self._error: RequestOutput | None = None  # an error piece drained early: the next one returned
        self.finished = False

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._on_close(self.request_id)
        if not self.finished:
            self.finished = True
            # Shielded: this runs while the handler is being cancelled (client gone).
            with trio.CancelScope(shield=True):
                try:
                    await self._cancels.send(Cancel(self.request_id))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the system is shutting down
        self._cancels.close()  # this stream's clone of the channel
        await self._pieces.aclose()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._error is not None:
            await trio.lowlevel.checkpoint()
            piece, self._error, self.finished = self._error, None, True
            return piece
        try:
            piece: RequestOutput = await self._pieces.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            self.finished = True
            raise StopAsyncIteration from None
        pieces = [piece]
        while piece.finish_reason is None:  # take what else is waiting, up to the last piece
            try:
                piece = self._pieces.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if piece.finish_reason == "error":
                self._error = piece
                break
            pieces.append(piece)
        if pieces[-1].finish_reason is not None:
            self.finished = True
        return RequestOutput.merge(pieces)


class Ingress:
    def __init__(
        self,
        admissions: trio.MemorySendChannel,
        cancels: trio.MemorySendChannel,
        *,
        max_model_len: int,
        max_tokens_in_cache: int,
        vocab_size: int,
        rate_limiter: RateLimiter,
        metrics,
    ):
        self._admissions = admissions
        self._cancels = cancels
        self.max_model_len = max_model_len
        self.max_tokens_in_cache = max_tokens_in_cache
        self.vocab_size = vocab_size
        self.rate_limiter = rate_limiter
        self._metrics = metrics

    def unpin(self, key: str) -> None:
        """Tell the core a pin may end; dropped when the channel is full (the pin's TTL ends it then)."""
        try:
            self._cancels.send_nowait(Unpin(key))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def submit(self, request: GenerateRequest) -> RequestStream:
        """Queue ``request``; raises ``SubmitError`` when it is refused."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[GenerateRequest]) -> list[RequestStream]:
        """Queue the choices of one API request (``n`` of them) together, or refuse them together.

        They are one request to the rate limiter (with the tokens of all), and the queue must
        have room for all: a refusal charges the key nothing and leaves nothing queued.

        Raises:
            SubmitError: 400 (a bad prompt), 503 (the queue is full), 429 (the first token predicted past
              ``ttft_bound_s``: code ``overloaded``; or the key's rate).
        """
        for request in requests:
            self._check(request)
        queue = self._admissions.statistics()
        if len(requests) > queue.max_buffer_size:  # a 503 would ask for a retry that can never succeed
            raise SubmitError(400, "invalid_request_error",
                              f"{len(requests)} choices are more than the server queues at once ({queue.max_buffer_size})")
        room = queue.max_buffer_size - queue.current_buffer_used + queue.tasks_waiting_receive
        if len(requests) > room:  # before the rate limit
            wait = self._metrics.queue_waits.expected_wait(trio.current_time())
            raise SubmitError(503, "server_busy", f"the request queue is full; requests wait about {wait:.0f} s",
                              retry_after=wait)
        prompt_tokens = sum(len(r.prompt_ids) for r in requests)
        refusal = self._metrics.ttft.refusal(prompt_tokens)
        if refusal is not None:  # before the rate limit, which would charge the key
            predicted, retry = refusal
            self._metrics.refused_overloaded.inc()
            raise SubmitError(429, OVERLOADED, f"the server is overloaded: the first token would come in about "
                              f"{predicted:.1f} s, past its bound of {self._metrics.ttft.limits.ttft_bound_s:g} s",
                              retry_after=retry)
        key = requests[0].api_key
        if key is not None:
            tokens = sum(len(r.prompt_ids) + r.params.max_tokens for r in requests)
            wait = self.rate_limiter.check(key, tokens, trio.current_time())
            if wait is not None:
                retry = 3600.0 if math.isinf(wait) else wait
                raise SubmitError(429, "rate_limit_exceeded", "rate limit reached for this API key", retry_after=retry)
        streams = []
        for request in requests:
            pieces_send, pieces = trio.open_memory_channel(request.params.max_tokens + 8)
            # No await since the checks above: the queue still has room.
            self._admissions.send_nowait(Submission(request, pieces_send, trio.current_time()))
            self._metrics.prompt_tokens.inc(len(request.prompt_ids))
            predicted = self._metrics.ttft.admitted(request.request_id, len(request.prompt_ids))
            if predicted is not None:
                self._metrics.ttft_predicted.observe(predicted)
            streams.append(RequestStream(request.request_id, pieces, self._cancels.clone(), self._metrics.ttft.ended))
        return streams

    def _check(self, request: GenerateRequest) -> None:
        n = len(request.prompt_ids)
        if n == 0:
            raise SubmitError(400, "invalid_request_error", "the prompt is empty")
        limit = min(self.max_model_len, self.max_tokens_in_cache)
        if n >= limit:
            raise SubmitError(
                400, "context_length_exceeded",
                f"the prompt has {n} tokens; this model's context holds {limit} (prompt + at least 1 new token)",
            )
        # Checked here, not in the engine step, so that a bad request fails alone.
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= self.vocab_size:
            raise SubmitError(400, "invalid_request_error", f"prompt token ids must lie in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t, _ in request.params.logit_bias):
            raise SubmitError(400, "invalid_request_error", f"logit_bias token ids must lie in [0, {self.vocab_size})")
