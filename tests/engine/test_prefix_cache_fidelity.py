"""A cache hit computes what a miss computes (issue 20): greedy tokens equal, logprobs within float
tolerance, on the default model, for a shared system prompt, a multi-turn chat, a prompt diverging
inside a page, and sequences preempted and resumed under a tiny KV pool."""

from __future__ import annotations

import pytest

from spark.core.core import Core
from spark.core.events import Failed, TokenBatch
from spark.core.page_allocator import PageAllocator
from spark.core.policies import Limits, make_policy
from spark.core.scheduler import Scheduler
from spark.engine.sampling import SamplingParams

SYSTEM = ("You are a careful assistant for a shipping company. Answer in one short sentence, name the port "
          "when you know it, and never invent tracking numbers. Customers write in English.")
QUESTIONS = ["Where is Rotterdam?", "What is a container?", "How long is a sea voyage to Lisbon?",
             "Can I ship a bicycle?", "What does FOB mean?", "Is Hamburg a port?", "How heavy can a parcel be?",
             "Do you ship on Sundays?"]
LOGPROB_TOLERANCE = 2e-3


def _core(engine, caching: bool, *, num_pages: int | None = None, max_batch_size: int = 16) -> Core:
    allocator = (engine.new_page_allocator() if num_pages is None
                 else PageAllocator(num_pages, engine.page_size))  # the first pages of the engine's pool
    policy = make_policy("fifo", Limits(max_prefill_tokens=512))
    return Core(engine, Scheduler(allocator, policy, max_batch_size=max_batch_size, prefix_caching=caching))


def _run(core: Core, prompts: dict, max_tokens: int = 8) -> dict:
    for rid, ids in prompts.items():
        core.submit(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0))
    out: dict = {rid: [] for rid in prompts}
    while core.busy:
        for event in core.step():
            if isinstance(event, TokenBatch):
                for o in event.outputs:
                    out[o.seq_id].append((o.token_id, o.logprob))
            elif isinstance(event, Failed):
                raise AssertionError(f"{event.request_id}: {event.error}")
    return out


def _same(plain: dict, cached: dict) -> None:
    for rid in plain:
        assert [t for t, _ in cached[rid]] == [t for t, _ in plain[rid]], rid
        worst = max(abs(a - b) for (_, a), (_, b) in zip(plain[rid], cached[rid]))
        assert worst < LOGPROB_TOLERANCE, (rid, worst)


def _chat(tok, messages) -> list[int]:
    return tok.encode_chat(messages, add_generation_prompt=True)


def test_a_system_prompt_shared_by_8_concurrent_requests(engine):
    tok = engine.tokenizer
    warm = {"warm": _chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}])}
    prompts = {f"q{i}": _chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for i, q in enumerate(QUESTIONS)}
    results = {}
    for caching in (False, True):
        core = _core(engine, caching)
        _run(core, warm)
        results[caching] = _run(core, prompts)
        if caching:
            assert core.scheduler.prefix_hit >= 8 * engine.page_size * 2  # each mapped the system pages
    _same(results[False], results[True])


def test_a_six_turn_chat(engine):
    tok = engine.tokenizer
    results = {}
    for caching in (False, True):
        core = _core(engine, caching)
        messages = [{"role": "system", "content": SYSTEM}]
        turns = {}
        for turn, question in enumerate(QUESTIONS[:6]):
            messages.append({"role": "user", "content": question})
            out = _run(core, {f"t{turn}": _chat(tok, messages)}, max_tokens=6)
            turns.update(out)
            messages.append({"role": "assistant", "content": tok.decode([t for t, _ in out[f"t{turn}"]],
                                                                        skip_special_tokens=True)})
        results[caching] = turns
        if caching:
            assert core.scheduler.prefix_hit > 0
    _same(results[False], results[True])


def test_a_prompt_that_diverges_inside_a_page(engine):
    tok = engine.tokenizer
    base = tok.encode(SYSTEM)
    size = engine.page_size
    cut = size + size // 2  # inside the second page
    assert len(base) > cut + 6
    a, b = base[:cut + 6], base[:cut] + tok.encode(" Ports of the Baltic sea are")
    results = {}
    for caching in (False, True):
        core = _core(engine, caching)
        first = _run(core, {"a": a})
        results[caching] = {**first, **_run(core, {"b": b})}
        if caching:
            assert core.scheduler.prefix_hit == size  # the first page only
    _same(results[False], results[True])


def test_sequences_preempted_and_resumed_under_a_tiny_pool(engine):
    tok = engine.tokenizer
    prompts = {f"p{i}": _chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for i, q in enumerate(QUESTIONS[:3])}
    pages = max(len(p) for p in prompts.values()) // engine.page_size + 2
    reference = _run(_core(engine, False), prompts, max_tokens=32)
    tiny = _core(engine, True, num_pages=1 + 2 * pages, max_batch_size=3)  # two of them at most
    preempted, hits = [], []
    schedule = tiny.scheduler.schedule

    def watched(now):
        plan = schedule(now)
        preempted.extend(tiny.scheduler.preempted)
        hits.extend(tiny.scheduler.prefix_hits)
        return plan

    tiny.scheduler.schedule = watched
    cached = _run(tiny, prompts, max_tokens=32)
    assert preempted and {rid for rid, _ in hits} & set(preempted)  # some resumed through the cache
    _same(reference, cached)
    assert tiny.scheduler.allocator.num_used == 0


@pytest.fixture(autouse=True)
def _no_sequence_left(engine):
    yield
    assert not engine._seqs, "a test left sequences in the shared engine"
