"""Submitting a request's choices and reading them as one stream, with doubles of the actor system."""

from __future__ import annotations

import pytest
import trio

from spark.actors.messages import GenerateRequest, RequestOutput
from spark.actors.system import SubmitError
from spark.engine.sampling import SamplingParams
from spark.http.errors import ApiError
from spark.http.fanin import Generations, StreamFailed
from spark.http.params import Job
from spark.http.spine import submit_job


class FakeStream:
    """A RequestStream double: yields ``pieces`` (one per ``delay``), records whether it was left early."""

    def __init__(self, request_id: str, pieces: int, *, delay: float = 1.0, fail_at: int | None = None):
        self.request_id, self.pieces, self.delay, self.fail_at = request_id, pieces, delay, fail_at
        self.entered = self.cancelled = False
        self.sent = 0

    async def __aenter__(self):
        self.entered = True
        return self

    async def __aexit__(self, *exc):
        self.cancelled = self.sent < self.pieces

    def __aiter__(self):
        return self._pieces()

    async def _pieces(self):
        for i in range(self.pieces):
            await trio.sleep(self.delay)
            if i == self.fail_at:
                raise RuntimeError("engine on fire")
            self.sent += 1
            yield RequestOutput(self.request_id, f"t{i}", (i,), finish_reason="length" if i == self.pieces - 1 else None)


class FakeSystem:
    def __init__(self, *, refuse_at: int | None = None, **stream_kw):
        self.refuse_at, self.stream_kw, self.streams = refuse_at, stream_kw, []

    def submit_all(self, requests) -> list[FakeStream]:
        if self.refuse_at is not None and len(self.streams) + len(requests) > self.refuse_at:
            raise SubmitError(503, "server_busy", "queue full", retry_after=0.3)
        streams = [FakeStream(r.request_id, **self.stream_kw) for r in requests]
        self.streams.extend(streams)
        return streams


def _job(n: int) -> Job:
    params = SamplingParams(max_tokens=3)
    return Job(tuple(GenerateRequest(f"r-{i}", (1, 2), params) for i in range(n)), 2, True, False)


async def test_choices_interleave_in_arrival_order(autojump_clock):
    system = FakeSystem(pieces=3)
    async with trio.open_nursery() as nursery:
        fanin = await submit_job(system, _job(2), nursery)
        got = [(i, p.text) async for i, p in fanin]
    assert sorted(got) == [(0, "t0"), (0, "t1"), (0, "t2"), (1, "t0"), (1, "t1"), (1, "t2")]
    assert [t for _, t in got] == ["t0", "t0", "t1", "t1", "t2", "t2"]
    assert not any(s.cancelled for s in system.streams)


async def test_closing_early_cancels_every_choice(autojump_clock):
    system = FakeSystem(pieces=100)
    async with trio.open_nursery() as nursery:
        fanin = await submit_job(system, _job(3), nursery)
        async for _ in fanin:
            break
        fanin.close()
    assert all(s.cancelled for s in system.streams)  # the nursery ended: no pump outlived the close


async def test_choices_are_refused_together(autojump_clock):
    system = FakeSystem(refuse_at=2, pieces=5)  # room for 2 of the 4: none is queued (issue 18.1)
    async with trio.open_nursery() as nursery:
        with pytest.raises(ApiError) as info:
            await submit_job(system, _job(4), nursery)
    assert info.value.status == 503 and info.value.code == "server_busy"
    assert info.value.response().headers["Retry-After"] == "1"
    assert system.streams == []


async def test_a_failing_stream_surfaces_without_killing_the_nursery(autojump_clock):
    system = FakeSystem(pieces=5, fail_at=2)
    async with trio.open_nursery() as nursery:
        fanin = await submit_job(system, _job(1), nursery)
        with pytest.raises(StreamFailed, match="engine on fire"):
            async for _ in fanin:
                pass
        fanin.close()


async def test_one_choice_is_read_without_a_pump_and_closing_it_early_cancels_it(autojump_clock):
    system = FakeSystem(pieces=100)
    async with trio.open_nursery() as nursery:
        fanin = await submit_job(system, _job(1), nursery)
        assert len(nursery.child_tasks) == 0  # read in the reader's own task
        got = []
        async for _, piece in fanin:
            got.append(piece.text)
            if len(got) == 2:
                break
        fanin.close()
        fanin.close()
    assert got == ["t0", "t1"] and system.streams[0].cancelled


async def test_a_one_choice_fan_in_dropped_unread_still_cancels_its_request(autojump_clock):
    system = FakeSystem(pieces=100)
    async with trio.open_nursery() as nursery:
        generations = Generations(nursery)  # what the app's connection gives each request
        generations.own(await submit_job(system, _job(1), nursery))  # a response whose body never started
        generations.close()  # the request ended
    assert system.streams[0].entered and system.streams[0].cancelled
