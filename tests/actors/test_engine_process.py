"""The engine in its own process gives what the engine in a thread gives."""

import queue
import threading

import pytest
import trio

from spark.actors.engine_process import EngineProcess
from spark.actors.host import CoreLoop, new_core
from spark.actors.messages import Admit, GenerateRequest
from spark.actors.system import open_system
from spark.core.events import TokenBatch
from spark.engine.engine import Engine
from spark.engine.errors import ModelLoadError
from spark.engine.sampling import SamplingParams
from spark.serve_config import ServeConfig

MODEL = "dummy:tiny-qwen3"
PROMPTS = [(1, 2, 3, 4, 5), tuple(range(7, 40)), (9,)]


async def _texts(engine) -> list[tuple[int, ...]]:
    """Each prompt alone, then all at once (several steps in flight, prefill chunks beside decodes)."""
    out = []
    async with open_system(engine, ServeConfig(max_prefill_tokens=8)) as system:

        async def one(i: int, prompt, results: dict, tag: str) -> None:
            request = GenerateRequest(f"r{i}-{tag}", prompt,
                                      SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True))
            async with system.submit(request) as stream:
                results[i] = tuple(t for piece in [p async for p in stream] for t in piece.token_ids)

        for i, prompt in enumerate(PROMPTS):
            alone: dict = {}
            await one(i, prompt, alone, "alone")
            out.append(alone[i])
        together: dict = {}
        async with trio.open_nursery() as nursery:
            for i, prompt in enumerate(PROMPTS):
                nursery.start_soon(one, i, prompt, together, "together")
        out.extend(together[i] for i in range(len(PROMPTS)))
    return out


async def test_same_tokens_as_in_process():
    in_process = Engine.load(MODEL, device="cpu", progress=False, kv_cache_bytes=8 << 20)
    child = await trio.to_thread.run_sync(
        lambda: EngineProcess.start(MODEL, device="cpu", progress=False, kv_cache_bytes=8 << 20))
    try:
        assert child.vocab_size == in_process.vocab_size and child.num_pages == in_process.num_pages
        assert await _texts(child) == await _texts(in_process)
    finally:
        child.close()
    assert not child._process.is_alive()


def test_a_missing_model_is_one_clear_error():
    with pytest.raises(ModelLoadError, match="no such file"):
        EngineProcess.start("/no/such/model.gguf")


async def _wait_for(condition, seconds: float = 20.0) -> None:
    with trio.fail_after(seconds):
        while not condition():
            await trio.sleep(0.05)


def _value(metric) -> float:
    return metric._value.get()


async def test_the_scheduler_in_the_process_reports_metrics_and_frees_a_leaving_clients_pages():
    child = await trio.to_thread.run_sync(
        lambda: EngineProcess.start(MODEL, device="cpu", progress=False, kv_cache_bytes=8 << 20))
    try:
        for session in range(2):  # a second system on the same process starts clean
            async with open_system(child, ServeConfig(max_prefill_tokens=8)) as system:
                metrics = system.metrics
                assert _value(metrics.kv_pages_total) == child.num_pages - 1  # page 0 is the scratch page
                request = GenerateRequest(f"long-{session}", tuple(range(1, 30)),
                                          SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
                async with system.submit(request) as stream:
                    async for piece in stream:
                        if piece.num_output_tokens >= 3:
                            break  # the client leaves: its pages go back in the child
                    await _wait_for(lambda: _value(metrics.kv_pages_used) > 0)
                await _wait_for(lambda: _value(metrics.kv_pages_used) == 0)
                steps = metrics.step_seconds.collect()[0].samples
                assert next(s.value for s in steps if s.name.endswith("_count")) >= 4  # the prompt's chunks, decodes
                queued = metrics.queue_time.collect()[0].samples
                assert next(s.value for s in queued if s.name.endswith("_count")) == 2  # the preflight's and ours
    finally:
        child.close()


def test_the_core_loop_reports_its_gauges_before_it_sleeps():
    """After the last token, the loop says once more how the pool stands (the pages the
    ended request freed), so the server's gauges do not wait for the next request."""
    from tests.actors.engine_double import EngineDouble

    core = new_core(EngineDouble(), ServeConfig(max_prefill_tokens=8))
    inbox, outs = queue.SimpleQueue(), queue.SimpleQueue()
    loop = threading.Thread(target=CoreLoop(core, inbox, outs.put).run)
    loop.start()
    inbox.put([Admit(GenerateRequest("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=3)), 0.0)])
    seen = []
    while not (seen and seen[-1].events == () and any(isinstance(e, TokenBatch) for o in seen for e in o.events)):
        seen.append(outs.get(timeout=10))
    inbox.put(None)
    loop.join(10)
    assert not loop.is_alive()
    busy = [o.metrics.kv_pages_used for o in seen if any(isinstance(e, TokenBatch) for e in o.events)]
    assert busy and busy[0] > 0  # while it ran, its pages were counted
    last = seen[-1].metrics
    assert (last.kv_pages_used, last.requests_running, last.requests_waiting) == (0, 0, 0)
    assert sum(len(o.metrics.steps) for o in seen) >= 3  # the prefill and the decodes
    assert sum(len(o.metrics.queue_times) for o in seen) == 1


def test_the_core_loop_closes_its_step_trace_when_the_session_ends(tmp_path):
    """A session's step trace is its file: written as steps are collected, closed with the session
    (a profile switch opens the next session's)."""
    from spark.actors.host import StepTrace
    from tests.actors.engine_double import EngineDouble

    path = tmp_path / "steps.jsonl"
    core = new_core(EngineDouble(), ServeConfig(max_prefill_tokens=8, step_trace=str(path)))
    assert isinstance(core.step_log, StepTrace) and not core.step_log.closed
    inbox, outs = queue.SimpleQueue(), queue.SimpleQueue()
    loop = threading.Thread(target=CoreLoop(core, inbox, outs.put).run)
    loop.start()
    inbox.put([Admit(GenerateRequest("r", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=3)), 0.0)])
    while not any(isinstance(e, TokenBatch) and any(t.finish_reason for t in e.outputs)
                  for e in outs.get(timeout=10).events):
        pass
    assert not core.step_log.closed  # steps still come while the session lasts
    inbox.put(None)
    loop.join(10)
    assert core.step_log.closed
    assert len(path.read_text().splitlines()) >= 3  # the prefill and the decodes
