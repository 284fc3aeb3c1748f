"""Read the streams of a request's n choices as one sequence of ``(choice, piece)``.

With several choices each stream is consumed by a pump task in the app's long-lived
nursery, not in the response generator: a trio nursery must not stay open across a
``yield``. Closing the fan-in (the client went away, or the response is done) cancels
the pumps, and a pump leaving ``async with stream`` cancels its request in the actor
system. One choice (nearly every request) needs no pump: the reader takes the pieces
straight from the stream, which saves a task switch per piece and lets pieces that
wait while the reader writes merge into one (``RequestStream``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Sequence

import trio

from spark.actors.messages import RequestOutput

log = logging.getLogger("spark.http")


class StreamFailed(Exception):
    """A choice's stream raised; the message says why."""


class FanIn:
    """The pieces of several streams, in arrival order, tagged with their choice index."""

    def __init__(self, receive: trio.MemoryReceiveChannel, pumps: list[trio.CancelScope]):
        self._receive, self._pumps = receive, pumps

    @classmethod
    async def start(cls, nursery: trio.Nursery, streams: Sequence) -> "FanIn":
        """Start reading ``streams`` (``streams[i]`` is choice ``i``): one pump per stream in ``nursery``,
        or, for a single stream, none.

        Streams whose pump could not start are entered and left at once, which cancels them.
        """
        if len(streams) == 1:
            return _OneStream(nursery, await streams[0].__aenter__())
        send, receive = trio.open_memory_channel(math.inf)  # pieces are small and bounded by max_tokens
        pumps: list[trio.CancelScope] = []
        async with send:
            try:
                for index, stream in enumerate(streams):
                    pumps.append(await nursery.start(_pump, index, stream, send.clone()))
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
    """The fan-in of one stream, read in the reader's task; closing it leaves the stream (in ``nursery``).

    A response whose body never started (the client left first) drops its fan-in unclosed;
    the stream is then left when the fan-in is collected, so its request is cancelled.
    """

    def __init__(self, nursery: trio.Nursery, stream):
        self._nursery, self._stream = nursery, stream
        self._token = trio.lowlevel.current_trio_token()
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        pieces = self._stream.__aiter__()
        while not self._closed:
            try:
                piece = await pieces.__anext__()
            except StopAsyncIteration:
                return
            except Exception as exc:
                log.exception("stream of choice 0 failed")
                raise StreamFailed(f"{type(exc).__name__}: {exc}") from None
            yield 0, piece

    def close(self) -> None:
        """Leave the stream (cancelling its request if it still runs); safe to call twice."""
        if not self._closed:
            self._closed = True
            _leave_soon(self._nursery, self._stream)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._closed = True
            try:  # thread-safe and allowed in a finalizer, unlike start_soon itself
                self._token.run_sync_soon(_leave_soon, self._nursery, self._stream)
            except trio.RunFinishedError:
                pass


def _leave_soon(nursery: trio.Nursery, stream) -> None:
    try:
        nursery.start_soon(stream.__aexit__, None, None, None)
    except RuntimeError:
        pass  # the app is shutting down: the actor system goes with it


async def _pump(index: int, stream, send: trio.MemorySendChannel, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    started = False
    with trio.CancelScope() as scope:
        async with send:
            try:
                async with stream:
                    task_status.started(scope)
                    started = True
                    async for piece in stream:
                        await send.send((index, piece))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the reader is gone; leaving `async with stream` cancelled the request
            except Exception as exc:
                if not started:
                    raise  # to the handler, through nursery.start
                log.exception("stream of choice %d failed", index)
                try:  # after start, a pump must never take the app's nursery down
                    send.send_nowait((index, exc))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
