"""Offline generation: prompts in, tokens out, no server (the CLI, tests and benchmarks).

The same ``spark.core.Core`` the server's host drives, with the FIFO policy and
every prompt submitted at once: the same plans, the same overlap of host and device.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Sequence as Seq

from spark.core.core import Core
from spark.core.events import Failed, TokenBatch
from spark.core.plan import TokenOutput
from spark.core.policies import Limits, make_policy
from spark.core.scheduler import Scheduler
from spark.core.speculation import SpecConfig
from spark.engine.engine import Engine
from spark.engine.sampling import SamplingParams
from spark.engine.teacher_forcing import prefill_logits  # noqa: F401 (its home before; scripts import it here)


def generate(
    engine: Engine,
    prompts: Seq[Seq[int]],
    params: SamplingParams | Seq[SamplingParams],
    *,
    max_prefill_tokens: int | None = None,
    max_batch_size: int = 256,
    on_token: Callable[[int, TokenOutput], None] | None = None,
    speculation: SpecConfig | None = None,
) -> list[list[TokenOutput]]:
    """Run prompts to completion.

    Args:
      on_token: called with ``(prompt index, output)`` for each token as it comes (``spark generate``
        prints them so).
      speculation: how the prompts speculate (``spark.core.speculation``); None: they do not.

    Each step decodes every running sequence and fills the rest with prefill chunks
    of waiting ones (at most ``max_prefill_tokens`` prompt tokens per step, so long
    prompts are chunked).

    Returns:
        Per prompt, the ``TokenOutput`` of every generated token.

    Raises:
        RuntimeError: a prompt failed (it cannot fit in the KV cache, or the engine refused it).
    """
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    limits = Limits(max_prefill_tokens=max_prefill_tokens or engine.max_model_len)
    scheduler = Scheduler(engine.new_page_allocator(), make_policy("fifo", limits), max_batch_size=max_batch_size)
    core = Core(engine, scheduler, speculation=speculation)
    # Private ids, never a caller's; they must survive pickling equal (a tensor-parallel leader sends them).
    base = ("generate", uuid.uuid4().hex)
    ids = [(base, i) for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params):
        core.submit(request_id, prompt, p, score_prompt=p.prompt_logprobs is not None)
    try:
        return drive(core, ids, on_token)
    finally:
        for request_id in ids:
            engine.remove_sequence(request_id)


def drive(core: Core, request_ids: Seq, on_token: Callable[[int, TokenOutput], None] | None = None
          ) -> list[list[TokenOutput]]:
    """Step ``core`` until it is idle; the requests ``request_ids`` were submitted to it.

    Returns:
        Per request, in ``request_ids``' order, the ``TokenOutput`` of every generated token.

    Raises:
        RuntimeError: a request failed (it cannot fit in the KV cache, or the engine refused it).
    """
    index = {request_id: i for i, request_id in enumerate(request_ids)}
    results: list[list[TokenOutput]] = [[] for _ in request_ids]
    try:
        while core.busy:
            for event in core.step():
                if isinstance(event, TokenBatch):
                    for out in event.outputs:
                        results[index[out.seq_id]].append(out)
                        if on_token is not None:
                            on_token(index[out.seq_id], out)
                elif isinstance(event, Failed):
                    raise RuntimeError(f"prompt {index[event.request_id]}: {event.error}")
    finally:
        core.drain()
    return results
