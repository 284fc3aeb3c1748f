"""The engine in its own process gives what the engine in a thread gives."""

import pytest
import trio

from spark.actors.engine_process import EngineProcess
from spark.actors.messages import GenerateRequest
from spark.actors.system import open_system
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
