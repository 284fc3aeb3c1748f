"""N-gram speculation on the default model (issue 22): what a request gets is what it gets without
speculation (greedy, seeded sampling, logprobs, penalties, stops inside an accepted run), drafts are
accepted on prompts that make the model repeat, and rejected drafts give their pages back.

Dense float32 weights on the CPU are batch-invariant: a verify chunk's rows compute what one-token
decodes compute, so the outputs are compared exactly."""

from __future__ import annotations

import pytest

from spark.core.core import Core
from spark.core.events import Failed, TokenBatch
from spark.core.page_allocator import PageAllocator
from spark.core.policies import Limits, make_policy
from spark.core.scheduler import Scheduler
from spark.core.speculation import SpecConfig
from spark.engine.sampling import SamplingParams

REPEATED = ("Spark serves tokens fast. The scheduler plans each step, the engine computes it, and the "
            "streamer sends the text back to the client as soon as it is ready.")
PROMPTS = [
    f"Repeat this text exactly: {REPEATED}",
    "Repeat this text exactly, twice: red green blue yellow, red green blue yellow.",
    "Count from 1 to 30, separated by commas.",
    "Write the alphabet in capital letters, separated by spaces.",
    "Copy this list back: apples, pears, plums, cherries, apples, pears, plums, cherries.",
    "def add(a, b):\n    return a + b\n\nWrite this Python function again, exactly as it is.",
    "What is the capital of France?",
    "Tell me a short story about a robot.",
    "Repeat after me: to be or not to be, that is the question; to be or not to be.",
    "List the days of the week, then list them again.",
]
MAX_TOKENS = 48
LOGPROB_TOLERANCE = 2e-3


def _core(engine, spec: SpecConfig | None, *, num_pages: int | None = None) -> Core:
    allocator = engine.new_page_allocator() if num_pages is None else PageAllocator(num_pages, engine.page_size)
    scheduler = Scheduler(allocator, make_policy("fifo", Limits(max_prefill_tokens=512)), max_batch_size=16)
    return Core(engine, scheduler, speculation=spec)


def _run(core: Core, prompts: list[list[int]], params, check=None, *, speculate: bool = True) -> tuple[list, tuple]:
    """Every prompt to its end; per prompt its (token, logprob, finish) outputs, and the speculation
    counts (drafted, accepted, steps, tokens) summed over the run."""
    for i, ids in enumerate(prompts):
        core.submit(i, ids, params[i] if isinstance(params, list) else params, speculate=speculate)
    out: list[list] = [[] for _ in prompts]
    spec = [0, 0, 0, 0]
    while core.busy:
        for event in core.step():
            if isinstance(event, TokenBatch):
                for o in event.outputs:
                    out[o.seq_id].append((o.token_id, o.logprob, o.finish_reason))
            elif isinstance(event, Failed):
                raise AssertionError(f"{event.request_id}: {event.error}")
        if check is not None:
            check(core)
        spec = [a + b for a, b in zip(spec, core.metrics().speculation or (0, 0, 0, 0))]
    return out, tuple(spec)


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    return [engine.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in PROMPTS]


def _same(plain: list, spec: list, *, logprobs: bool = False) -> None:
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert [(t, f) for t, _, f in b] == [(t, f) for t, _, f in a], i
        if logprobs:
            worst = max(abs(x - y) for (_, x, _), (_, y, _) in zip(a, b))
            assert worst < LOGPROB_TOLERANCE, (i, worst)


def test_greedy_output_is_the_same_with_speculation(engine, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain, none = _run(_core(engine, None), prompts, params)
    spec, (drafted, accepted, steps, tokens) = _run(_core(engine, SpecConfig(max_batch=16)), prompts, params)
    _same(plain, spec)
    assert none == (0, 0, 0, 0)
    assert accepted > 50 and drafted > accepted  # drafts are taken, and some are rolled back
    assert tokens > steps  # more than one token per step


def test_seeded_sampling_gives_the_same_tokens_with_speculation(engine, prompts):
    """A row's noise is keyed by (seed, sample index): verifying a draft draws what decoding draws."""
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i, max_tokens=32, ignore_eos=True)
              for i in range(4)]
    plain, _ = _run(_core(engine, None), prompts[:4], params)
    spec, (_, accepted, _, _) = _run(_core(engine, SpecConfig(max_batch=16)), prompts[:4], params)
    _same(plain, spec)
    assert accepted > 0


def test_logprobs_and_penalties_are_those_of_decoding(engine, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, repetition_penalty=1.05,
                            frequency_penalty=0.1)
    plain, _ = _run(_core(engine, None), prompts[:3], params)
    spec, (_, accepted, _, _) = _run(_core(engine, SpecConfig(max_batch=16)), prompts[:3], params)
    _same(plain, spec, logprobs=True)
    assert accepted > 0


def test_an_end_inside_an_accepted_run_ends_the_output_there(engine, prompts):
    """max_tokens and a stop token met inside a verified run: nothing past them is emitted."""
    plain, _ = _run(_core(engine, None), prompts[:2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    stop = plain[0][20][0]  # a token the repeat reaches mid-answer
    cases = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (7, 13, 21, 29)]
    cases.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=(stop,)))
    for params in cases:
        a, _ = _run(_core(engine, None), prompts[:2], params)
        b, _ = _run(_core(engine, SpecConfig(num_tokens=6, max_batch=16)), prompts[:2], params)
        _same(a, b)
        assert all(len(out) <= params.max_tokens for out in b)


def test_rejected_tokens_give_their_pages_back(engine, prompts):
    """Between steps, a speculating sequence holds the pages its computed tokens need, no more; when all
    is done, every page is back (a small pool, so that drafts also meet its end)."""
    seen = []

    def check(core: Core) -> None:
        if core.num_inflight:
            return
        alloc = core.scheduler.allocator
        for seq in core.scheduler.running:
            held = len(alloc.block_table(seq.request_id))
            assert held == alloc.pages_for(seq.num_computed), (seq.request_id, held, seq.num_computed)
            seen.append(held)

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    core = _core(engine, SpecConfig(num_tokens=8, max_batch=16), num_pages=64)
    spec, (drafted, accepted, _, _) = _run(core, prompts[:6], params, check)
    assert seen and drafted > accepted > 0
    assert core.scheduler.allocator.num_used == 0
    plain, _ = _run(_core(engine, None, num_pages=64), prompts[:6], params)
    _same(plain, spec)


def test_opted_out_requests_and_large_batches_do_not_speculate(engine, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    _, counts = _run(_core(engine, SpecConfig(max_batch=16)), prompts[:1], params, speculate=False)
    assert counts[2] == 0  # no step of a speculating sequence
    core = _core(engine, SpecConfig(max_batch=2))
    _, counts = _run(core, prompts[:4], params)  # 4 running > 2: off until 2 are left (they end together)
    assert counts[2] == 0
