"""One Responses API response being generated: the turn's events in, ``response.*`` events out, and
the store kept current as it goes (``spark.http.responses`` makes it; ``spark.http.background``
runs it when it outlives its request).

What a client is told exists is committed first: a streamed (or background) response is stored
in_progress before ``response.created`` and its end before its last event; a non-streamed one
before its body is sent. A response cut short is stored cancelled (the client went away, or asked),
or failed (the server failed, or stopped under a background response).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextlib import aclosing

import attrs
import trio

from spark.http.background import BackgroundRun
from spark.http.errors import ApiError
from spark.http.fanin import FanIn
from spark.http.response_items import OutputBuilder, reasoning_text, usage
from spark.http.turn import TurnDone, TurnParser, turn_steps
from spark.state import AsyncStore

log = logging.getLogger("spark.http")


@attrs.define(eq=False)
class ResponseRun:
    """One response being generated: events in, ``response.*`` events out, the store kept current."""

    head: dict
    items: list[dict]  # this turn's input
    prompt_tokens: int
    owner: str
    store: AsyncStore | None  # None: store=false
    conversation_id: str | None
    conversations: AsyncStore | None  # appended to even with store=false
    count_tokens: Callable[[str], int] | None = None  # the tokenizer's count of a text, for reasoning_tokens
    final: dict | None = None
    background: BackgroundRun | None = None  # a background response's run

    def _reasoning_tokens(self, output: list[dict], output_tokens: int) -> int:
        """The output's reasoning in tokens: its text re-encoded (the parser sees text, not ids)."""
        text = reasoning_text(output)
        if not text or self.count_tokens is None:
            return 0
        return min(output_tokens, self.count_tokens(text))

    async def events(self, fanin: FanIn, parser: TurnParser, *, stream: bool):
        """The ``response.*`` events (without sequence numbers); the last one carries the final response."""
        builder = OutputBuilder(citations=parser.citations)
        yield {"type": "response.created", "response": self.head}
        yield {"type": "response.in_progress", "response": self.head}
        try:
            async with aclosing(turn_events(fanin, parser, builder)) as events:
                async for event in events:
                    if not isinstance(event, TurnDone):
                        for out in builder.feed(event):
                            yield out
                        continue
                    if event.error is not None:
                        self.final = {**self.head, "status": "failed", "error": {
                            "code": "server_error" if event.error.status >= 500 else "invalid_prompt",
                            "message": event.error.message}, "spark_error": event.error}
                        if stream and self.store is not None:
                            await self.store.put_response(self.owner, public(self.final))
                        yield {"type": "response.failed", "response": public(self.final)}
                        return
                    incomplete = event.finish_reason == "length"
                    for out in builder.close("incomplete" if incomplete else "completed"):
                        yield out
                    self.final = {**self.head, "status": "incomplete" if incomplete else "completed",
                                  "output": builder.output, "usage": usage(
                                      self.prompt_tokens, event.usage.completion_tokens,
                                      self._reasoning_tokens(builder.output, event.usage.completion_tokens),
                                      event.usage.cached_tokens),
                                  "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                                  "completed_at": round(time.time(), 3)}
                    await self._save()
                    yield {"type": f"response.{self.final['status']}", "response": self.final}
        except BaseException as exc:  # cancelled (the client went away, or asked), or the server failed
            if self.final is None and stream and self.store is not None:
                ended = self._ended(exc)
                with trio.CancelScope(shield=True):
                    try:
                        await self.store.put_response(self.owner, ended)
                    except Exception:
                        log.exception("could not store the end of response %s", self.head["id"])
            raise
        finally:
            fanin.close()

    def _ended(self, exc: BaseException) -> dict:
        """The response as an exception left it: failed if the server failed or stopped under a
        background response, else cancelled (a hang-up, or the cancel endpoint)."""
        if isinstance(exc, Exception):
            return {**self.head, "status": "failed", "error": {"code": "server_error", "message": describe(exc)}}
        if self.background is not None and not self.background.cancel_requested:
            return {**self.head, "status": "failed", "error": {
                "code": "server_error", "message": "the server stopped before this response was finished"}}
        return {**self.head, "status": "cancelled"}

    async def _save(self) -> None:
        if self.store is not None:
            await self.store.put_response(self.owner, self.final, self.items)
        if self.conversation_id is not None:
            await self.conversations.append_conversation_items(self.owner, self.conversation_id,
                                                               self.items + self.final["output"])

    async def collect(self, fanin: FanIn, parser: TurnParser) -> dict:
        async with aclosing(self.events(fanin, parser, stream=False)) as events:
            async for _ in events:
                pass
        if self.final["status"] == "failed":
            raise self.final["spark_error"]
        return self.final

    async def begin(self, fanin: FanIn) -> None:
        """Store the response in_progress (if it is stored) before the client hears of its id; if that
        fails, the generation is cancelled."""
        if self.store is None:
            return
        try:
            await self.store.put_response(self.owner, self.head, self.items)
        except BaseException:
            fanin.close()  # cancels the generation
            raise

    async def stream_events(self, fanin: FanIn, parser: TurnParser):
        """The events of a streamed (or background) response, unnumbered; a failure of the server itself
        ends them with an ``error`` event."""
        try:
            async with aclosing(self.events(fanin, parser, stream=True)) as events:
                async for event in events:
                    yield event
        except Exception as exc:
            log.exception("response %s failed", self.head["id"])
            yield {"type": "error", "code": "server_error", "message": describe(exc), "param": None}

    async def sse(self, fanin: FanIn, parser: TurnParser):
        """``stream_events`` as SSE, numbered."""
        seq = 0
        async with aclosing(self.stream_events(fanin, parser)) as events:
            async for event in events:
                yield sse_event({**event, "sequence_number": seq})
                seq += 1


async def turn_events(fanin: FanIn, parser: TurnParser, builder: OutputBuilder):
    """The turn's events, one by one (``turn_steps`` with one parser); each piece's tokens go to ``builder``
    before its events, so that the message text they write takes their logprobs."""
    async with aclosing(turn_steps(fanin, [parser])) as steps:
        async for _, piece, events in steps:
            if piece is not None:
                builder.add_tokens(piece.logprobs)  # none unless the request included the logprobs
            for event in events:
                yield event


def sse_event(event: dict) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def describe(exc: BaseException) -> str:
    return exc.message if isinstance(exc, ApiError) else f"internal error: {type(exc).__name__}: {exc}"


def public(response: dict) -> dict:
    return {k: v for k, v in response.items() if k != "spark_error"}
