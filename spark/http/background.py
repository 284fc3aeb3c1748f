"""Background responses (``background: true``): generations that outlive the request that made them.

The create answers at once; the generation runs in a task of the app's nursery, not the request's,
so a client that goes away neither cancels it nor loses it. Its ``response.*`` events are kept in
order (``BackgroundRun``): a streamed create follows them, and ``GET /v1/responses/{id}?stream=true
&starting_after=N`` follows them again from any sequence number, while the run lives and for
``RETAIN_S`` after it ends (in memory, within ``MAX_KEPT_EVENTS``: not across a restart; the stored
response stays as always).
``POST /v1/responses/{id}/cancel`` cancels a run and waits until its end is stored.

This module knows nothing of what a response is: ``spark.http.responses`` hands it an event
iterator that stores the response as it goes, and ends with an ``error`` event if the server fails.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import attrs
import trio

log = logging.getLogger("spark.http")

RETAIN_S = 600.0  # a finished run's events, for a stream to resume (OpenAI keeps them about 10 minutes)
MAX_KEPT_EVENTS = 200_000  # finished runs' events in all (~100 MB): past it the oldest go first


@attrs.define(eq=False)
class BackgroundRun:
    """One background response's events so far (each with its ``sequence_number``) and its end."""

    owner: str
    events: list[dict] = attrs.field(factory=list)
    cancel_requested: bool = False  # by the cancel endpoint (else a cancellation is the server stopping)
    done: bool = False
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)  # the generation's
    _changed: trio.Event = attrs.field(factory=trio.Event)

    def add(self, event: dict) -> None:
        self.events.append({**event, "sequence_number": len(self.events)})
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def follow(self, after: int = -1) -> AsyncIterator[dict]:
        """The events after sequence number ``after``: those kept, then each as it comes, until the run ends."""
        index = max(after + 1, 0)
        while True:
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.done:
                return
            await self._changed.wait()

    async def cancel(self) -> None:
        """Cancel the generation (at the client's request) and wait until its end is stored."""
        self.cancel_requested = True
        await self.stop()

    async def stop(self) -> None:
        """Cancel the generation and wait until its end is stored."""
        self.scope.cancel()
        while not self.done:
            await self._changed.wait()


@attrs.define(eq=False)
class BackgroundRuns:
    """The app's background runs by response id, in ``nursery`` (the app's: they outlive requests)."""

    nursery: trio.Nursery
    _runs: dict[str, BackgroundRun] = attrs.field(factory=dict)
    _finished: dict[str, BackgroundRun] = attrs.field(factory=dict)  # kept for resumption, oldest first
    _kept_events: int = 0  # theirs
    _closed: trio.Event = attrs.field(factory=trio.Event)  # ends the finished runs' retention

    def start(self, rid: str, run: BackgroundRun, events: AsyncIterator[dict],
              ended: Callable[[str], None]) -> None:
        """Run ``events`` (the response's, storing it as they go) in the background as ``rid``;
        ``ended(outcome)`` is called once when they end: ok, cancelled or failed."""
        self._runs[rid] = run
        self.nursery.start_soon(self._drive, rid, run, events, ended, name=f"spark-background-{rid}")

    def get(self, owner: str, rid: str) -> BackgroundRun | None:
        """The run of ``rid`` while it is kept, if ``owner``'s."""
        run = self._runs.get(rid)
        return run if run is not None and run.owner == owner else None

    async def cancel(self, owner: str, rid: str) -> bool:
        """Cancel ``rid``'s run if it is ``owner``'s and live (at the client's request), and wait until
        its end is stored; whether there was one."""
        run = self.get(owner, rid)
        if run is None or run.done:
            return False
        await run.cancel()
        return True

    async def close(self) -> None:
        """Cancel every live run (the server is stopping) and wait until each one's end is stored."""
        self._closed.set()
        live = [run for run in self._runs.values() if not run.done]
        for run in live:  # all at once, then each until its end is stored
            run.scope.cancel()
        for run in live:
            await run.stop()

    async def _drive(self, rid: str, run: BackgroundRun, events: AsyncIterator[dict],
                     ended: Callable[[str], None]) -> None:
        outcome = "failed"
        try:
            with run.scope:
                async with aclosing(events) as each:
                    async for event in each:
                        run.add(event)
                outcome = "ok"
            if run.scope.cancelled_caught:
                outcome = "cancelled"
        except Exception:  # not the response's failure (its events end with that), this module's own
            log.exception("background response %s failed", rid)
        finally:
            run.done = True
            run._wake()
            ended(outcome)
        self._keep(rid, run)
        with trio.move_on_after(RETAIN_S):
            await self._closed.wait()
        self._forget(rid, run)

    def _keep(self, rid: str, run: BackgroundRun) -> None:
        """Keep a finished run's events, forgetting the oldest kept ones past ``MAX_KEPT_EVENTS``."""
        self._finished[rid] = run
        self._kept_events += len(run.events)
        while self._kept_events > MAX_KEPT_EVENTS and len(self._finished) > 1:
            oldest = next(iter(self._finished))
            self._forget(oldest, self._finished[oldest])

    def _forget(self, rid: str, run: BackgroundRun) -> None:
        if self._finished.get(rid) is run:
            del self._finished[rid]
            self._kept_events -= len(run.events)
        if self._runs.get(rid) is run:
            del self._runs[rid]
