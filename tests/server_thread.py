"""A test server in a background thread: the one way the suite starts and stops one."""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import Iterator

import trio


@contextlib.contextmanager
def serve_in_thread(serve, *, name: str, timeout: float = 300) -> Iterator[str]:
    """Run ``serve(shutdown_trigger=..., task_status=...)`` under trio in a thread; yield its URL.

    ``serve`` reports the URL it listens on through ``task_status.started``; a
    start-up error it raises is raised here. Leaving the block stops it and
    checks that the thread is gone.
    """
    started: queue.Queue = queue.Queue()

    async def main() -> None:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(serve, shutdown_trigger=stop.wait))
            started.put((url, trio.lowlevel.current_trio_token(), stop))

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # start-up failed: raise it in the test
            started.put(exc)

    thread = threading.Thread(target=run, daemon=True, name=name)
    thread.start()
    got = started.get(timeout=timeout)
    while isinstance(got, BaseExceptionGroup) and len(got.exceptions) == 1:
        got = got.exceptions[0]  # the nurseries' wrapping: raise what start-up raised
    if isinstance(got, BaseException):
        raise got
    url, token, stop = got
    try:
        yield url
    finally:
        trio.from_thread.run_sync(stop.set, trio_token=token)
        thread.join(timeout=30)
        assert not thread.is_alive(), f"{name} did not shut down"
