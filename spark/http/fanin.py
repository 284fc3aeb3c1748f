"""Read the streams of a request's n choices as one sequence of ``(choice, piece)``.

Each stream is consumed by a pump task in the app's long-lived nursery, not in the
response generator: a trio nursery must not stay open across a ``yield``. Closing
the fan-in (the client went away, or the response is done) cancels the pumps, and a
pump leaving ``async with stream`` cancels its request in the actor system.
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
        """Start one pump per stream in ``nursery``; ``streams[i]`` is choice ``i``.

        Streams whose pump could not start are entered and left at once, which cancels them.
        """
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
