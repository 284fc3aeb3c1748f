"""A request's generations: its choices' streams read as one sequence of ``(choice, piece)``, owned by the request.

Every fan-in an HTTP request starts belongs to the request's ``Generations``, which the app's
ASGI connection opens around the handler *and* the response body: when the request ends (its
body read to the end, the client gone, or a body that never started), every fan-in is closed,
and closing one leaves its streams, which cancels what still generates.

With several choices each stream is consumed by a pump task in the request's nursery, not in
the response generator: a trio nursery must not stay open across a ``yield``. One choice
(nearly every request) needs no pump: the reader takes the pieces straight from the stream,
which saves a task switch per piece and lets pieces that wait while the reader writes merge
into one (``RequestStream``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Sequence

import trio

from spark.actors.messages import RequestOutput
from spark.control.activity import Tally
from spark.control.served import GenerationStream

log = logging.getLogger("spark.http")


class StreamFailed(Exception):
    """A choice's stream raised; the message says why."""


class FanIn:
    """The pieces of several streams, in arrival order, tagged with their choice index."""

    def __init__(self, receive: trio.MemoryReceiveChannel, pumps: list[trio.CancelScope]):
        self._receive, self._pumps = receive, pumps

    @classmethod
    async def start(cls, nursery: trio.Nursery, streams: Sequence[GenerationStream], *,
                    tally: Tally | None = None) -> FanIn:
        """Start reading ``streams`` (``streams[i]`` is choice ``i``): one pump per stream in ``nursery``,
        or, for a single stream, none; ``tally`` counts the pieces' tokens.

        Streams whose pump could not start are entered and left at once, which cancels them.
        """
        if len(streams) == 1:
            return _OneStream(nursery, await streams[0].__aenter__(), tally)
        send, receive = trio.open_memory_channel(math.inf)  # pieces are small and bounded by max_tokens
        pumps: list[trio.CancelScope] = []
        async with send:
            try:
                for index, stream in enumerate(streams):
                    pumps.append(await nursery.start(_pump, index, stream, send.clone(), tally))
            except BaseException:
                for scope in pumps:
                    scope.cancel()
                with trio.CancelScope(shield=True):
                    for stream in streams[len(pumps) + 1:]:
                        async with stream:
                            pass
                raise
        return cls(receive, pumps)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        async for index, piece in self._receive:
            if isinstance(piece, BaseException):
                raise StreamFailed(f"{type(piece).__name__}: {piece}")
            yield index, piece

    def close(self) -> None:
        """Cancel every pump (and so every request still running); safe to call twice."""
        for scope in self._pumps:
            scope.cancel()
        self._receive.close()


class _OneStream(FanIn):
    """The fan-in of one stream, read in the reader's task; closing it leaves the stream (in ``nursery``)."""

    def __init__(self, nursery: trio.Nursery, stream: GenerationStream, tally: Tally | None):
        self._nursery, self._stream, self._tally = nursery, stream, tally
        self._closed = False

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return tagged(self._stream, self._tally)

    def close(self) -> None:
        """Leave the stream (cancelling its request if it still runs); safe to call twice."""
        if not self._closed:
            self._closed = True
            self._nursery.start_soon(self._stream.__aexit__, None, None, None)


async def tagged(stream: GenerationStream, tally: Tally | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The pieces of one stream as choice 0's (``tally`` counts them); its failure raised as ``StreamFailed``."""
    pieces = stream.__aiter__()
    while True:
        try:
            piece = await pieces.__anext__()
        except StopAsyncIteration:
            return
        except Exception as exc:
            log.exception("stream of choice 0 failed")
            raise StreamFailed(f"{type(exc).__name__}: {exc}") from None
        if tally is not None:
            tally.count(piece)
        yield 0, piece


async def _pump(index: int, stream: GenerationStream, send: trio.MemorySendChannel, tally: Tally | None, *,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    started = False
    with trio.CancelScope() as scope:
        async with send:
            try:
                async with stream:
                    task_status.started(scope)
                    started = True
                    async for piece in stream:
                        if tally is not None:
                            tally.count(piece)
                        await send.send((index, piece))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the reader is gone; leaving `async with stream` cancelled the request
            except Exception as exc:
                if not started:
                    raise  # to the handler, through nursery.start
                log.exception("stream of choice %d failed", index)
                try:  # after start, a pump must never take the request's nursery down
                    send.send_nowait((index, exc))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass


class Generations:
    """The fan-ins of one HTTP request, in a nursery that lasts as long as the request (its body included).

    ``close`` (the request ended) closes every fan-in still open, so that no generation outlives it.
    """

    def __init__(self, nursery: trio.Nursery):
        self.nursery = nursery
        self._fanins: list[FanIn] = []

    def own(self, fanin: FanIn) -> FanIn:
        self._fanins.append(fanin)
        return fanin

    def close(self) -> None:
        for fanin in self._fanins:
            fanin.close()
