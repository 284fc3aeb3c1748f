"""Offline generation: an engine driven to completion by a simple FIFO loop, no server.

The serving path plans steps in ``spark.actors`` (admission, SLAI, preemption); the
CLI, the tests and the benchmarks only need prompts in, tokens out, and the same
overlap of host and device.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence as Seq

from spark.engine.engine import Engine, ScheduledChunk, StepPlan, TokenOutput
from spark.engine.sampling import SamplingParams

# Steps launched ahead of the one being collected: the host plans step N+1 while the
# device runs step N.
_IN_FLIGHT = 2


def generate(
    engine: Engine,
    prompts: Seq[Seq[int]],
    params: SamplingParams | Seq[SamplingParams],
    *,
    max_prefill_tokens: int | None = None,
    max_batch_size: int = 256,
) -> list[list[TokenOutput]]:
    """Run prompts to completion with a simple FIFO loop.

    Each step decodes every running sequence and fills the rest of the token
    budget with prefill chunks of waiting ones (at most ``max_prefill_tokens``
    prompt tokens per step, so long prompts are chunked).

    Returns:
        Per prompt, the ``TokenOutput`` of every generated token.
    """
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    allocator = engine.new_page_allocator()
    base = object()  # private ids: never collide with a caller's sequences
    waiting = deque((base, i) for i in range(len(prompts)))
    for (b, i) in waiting:
        engine.add_sequence((b, i), prompts[i], params[i])
    running: list = []
    results: list[list[TokenOutput]] = [[] for _ in prompts]
    budget = max_prefill_tokens or engine.max_model_len
    launched = 0
    try:
        while waiting or running or launched:
            # Plan the next step while the previous one runs: a sequence that ended
            # there is still planned once, and the engine drops it.
            chunks = []
            if launched < _IN_FLIGHT:
                for sid in running:
                    chunks.append(ScheduledChunk(sid, 1, allocator.append(sid, engine.num_computed(sid) + 1)))
                left = budget
                while waiting and left > 0 and len(running) < max_batch_size:
                    sid = waiting[0]
                    n = min(engine.num_uncomputed(sid), left)
                    done = engine.num_computed(sid) + n
                    if not allocator.can_allocate(sid, done):
                        break
                    table = allocator.append(sid, done) if allocator.has(sid) else allocator.allocate(sid, done)
                    chunks.append(ScheduledChunk(sid, n, table))
                    left -= n
                    if done == engine.num_tokens(sid):
                        running.append(waiting.popleft())
                    else:
                        break  # a partial prompt fills the budget
            if chunks:
                engine.launch(StepPlan(tuple(chunks)))
                launched += 1
                if launched < _IN_FLIGHT:
                    continue
            elif not launched:
                raise RuntimeError("KV cache too small for the next prompt")
            for out in engine.collect():
                results[out.seq_id[1]].append(out)
                if out.finish_reason is not None:
                    running.remove(out.seq_id)
                    allocator.free(out.seq_id)
            launched -= 1
    finally:
        while engine.num_inflight:
            engine.collect()
        for i in range(len(prompts)):
            engine.remove_sequence((base, i))
    return results
