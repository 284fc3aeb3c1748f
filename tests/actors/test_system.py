"""The whole actor system: the real default model, and the engine double (its core in a thread, on the real clock)."""

from __future__ import annotations

import random
import time

import pytest
import trio

from spark.actors.messages import GenerateRequest
from spark.actors.system import SubmitError, open_system
from spark.engine.sampling import SamplingParams
from spark.serve_config import ServeConfig
from tests.actors.conftest import collect, open_spied
from tests.actors.engine_double import CharTokenizer, EngineDouble, hashed_token

PROMPTS = [
    "Hello, my name is", "The capital of France is", "def fibonacci(n):", "Once upon a time",
    "1, 2, 3, 4,", "The quick brown fox", "In 1492, Columbus", "Water boils at",
    "My favourite colour is", "import numpy as np\n", "The best way to learn", "Q: What is 2+2?\nA:",
    "Roses are red,", "Dear Sir or Madam,", "The mitochondria is the", "Translate to French: cat =>",
]


def greedy(max_tokens, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def request(request_id, prompt_ids, params, **kwargs):
    return GenerateRequest(request_id, tuple(prompt_ids), params, **kwargs)


async def wait_until(predicate, *, timeout) -> bool:
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.01)
        return True
    return False


def pages_gauge(system) -> float:
    return system.metrics.registry.get_sample_value("spark_kv_pages_used")


async def assert_idle_and_free(system, allocator, *, timeout=20.0):
    """Every page back in the pool, and the gauge saying so once the system is idle."""
    assert await wait_until(lambda: allocator.num_used == 0, timeout=timeout), f"{allocator.num_used} pages still held"
    assert await wait_until(lambda: pages_gauge(system) == 0, timeout=1.0), (
        f"the pool is free but spark_kv_pages_used says {pages_gauge(system)}"
    )


# -- the real model ----------------------------------------------------------------


async def test_preflight_makes_the_system_ready(real_engine):
    async with open_system(real_engine, ServeConfig()) as system:
        assert system.ready
        assert system.max_model_len == real_engine.max_model_len and system.served_name == "smollm2-135m-instruct"


async def test_simultaneous_greedy_requests_produce_what_they_produce_alone(real_engine):
    tok = real_engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    # a small prefill budget: together, prompts are chunked and share steps with decodes
    async with open_system(real_engine, ServeConfig(max_prefill_tokens=24)) as system:
        with trio.fail_after(240):
            alone = [await collect(system.submit(request(f"alone-{i}", p, greedy(6, ignore_eos=True)))) for i, p in enumerate(prompts)]
            together = [None] * len(prompts)

            async def one(i):
                together[i] = await collect(system.submit(request(f"together-{i}", prompts[i], greedy(6, ignore_eos=True))))

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
    for i, ((text, ids, last), (text2, ids2, last2)) in enumerate(zip(alone, together)):
        assert len(ids) == 6 and last.finish_reason == "length", PROMPTS[i]
        assert (ids2, text2) == (ids, text), PROMPTS[i]
        assert text == tok.decode(ids, skip_special_tokens=True)


async def test_a_stop_string_ends_the_output_before_it_and_frees_the_pages(real_engine):
    tok = real_engine.tokenizer
    prompt = tok.encode("Hello, my name is")
    async with open_spied(real_engine, ServeConfig()) as (system, allocator):
        with trio.fail_after(120):
            full, _, _ = await collect(system.submit(request("full", prompt, greedy(16))))
            stop = full[len(full) // 2: len(full) // 2 + 3]  # three characters from the middle
            text, ids, last = await collect(system.submit(request("stopped", prompt, greedy(16), stop=("zzqx", stop))))
            assert text == full[: full.index(stop)] and stop not in text
            assert (last.finish_reason, last.stop_string) == ("stop", stop)
            assert len(ids) < 16
            await assert_idle_and_free(system, allocator)


async def test_cancelled_streams_free_their_pages_and_the_system_keeps_serving(real_engine):
    rng = random.Random(7)
    tok = real_engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    config = ServeConfig(max_batch_size=8, max_prefill_tokens=64)  # some wait in the queue when cut
    async with open_spied(real_engine, config) as (system, allocator):
        read = []

        async def cut_short(i, keep):
            async with system.submit(request(f"cut-{i}", prompts[i % 16], SamplingParams(max_tokens=12, seed=i))) as stream:
                n = 0
                while n < keep:
                    try:
                        await stream.__anext__()
                    except StopAsyncIteration:
                        break
                    n += 1
                read.append(n)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(32):
                    nursery.start_soon(cut_short, i, rng.randint(0, 13))
                    if rng.random() < 0.3:
                        await trio.sleep(rng.uniform(0, 0.05))
            assert len(read) == 32
            await assert_idle_and_free(system, allocator)
            text, ids, last = await collect(system.submit(request("after", prompts[0], greedy(4))))
            assert len(ids) == 4 and last.finish_reason == "length"
            await assert_idle_and_free(system, allocator)


async def test_a_full_queue_answers_503_at_once(real_engine):
    config = ServeConfig(max_batch_size=1, max_waiting=2)
    async with open_system(real_engine, config) as system:
        with trio.fail_after(60):
            running = system.submit(request("running", [1, 2, 3], greedy(1000, ignore_eos=True)))
            async with running:
                await running.__anext__()  # it holds the only batch slot
                queued = [system.submit(request(f"queued-{i}", [1, 2], greedy(4))) for i in range(2)]
                start = trio.current_time()
                for i in range(3):
                    with pytest.raises(SubmitError) as refused:
                        system.submit(request(f"refused-{i}", [1, 2], greedy(4)))
                    assert refused.value.status == 503 and refused.value.code == "server_busy"
                    assert refused.value.retry_after is not None and 0 < refused.value.retry_after <= 60
                assert trio.current_time() - start < 0.5
            # the running one left: the queue drains
            for stream in queued:
                text, ids, last = await collect(stream)
                assert last.finish_reason == "length"


async def test_a_full_queues_retry_after_is_how_long_the_queue_makes_requests_wait():
    # Retry-After was always 1, even while admitted requests waited 240 s.
    double = EngineDouble()
    double.fail_if = lambda plan: time.sleep(0.005) or False  # a step takes a while: the queue stays full
    async with double_system(double, max_batch_size=1, max_waiting=2) as (system, allocator):
        with trio.fail_after(30):
            running = system.submit(request("running", [1, 2, 3], greedy(10_000, ignore_eos=True)))
            async with running:
                await running.__anext__()
                queued = [system.submit(request(f"queued-{i}", [1, 2], greedy(4))) for i in range(2)]
                now = trio.current_time()
                for waited in (230.0, 240.0, 240.0, 250.0, 260.0):
                    system.metrics.queue_waits.started(waited, now)  # as if the last ones had waited so
                with pytest.raises(SubmitError) as refused:
                    system.submit(request("refused", [1, 2], greedy(4)))
                assert refused.value.code == "server_busy" and refused.value.retry_after == 240.0
                assert "240 s" in refused.value.message
                for stream in queued:
                    await stream.aclose()


def test_queue_waits_expect_the_recent_median_or_the_stall_since_the_last_start():
    from spark.metrics import QueueWaits

    waits = QueueWaits(remembered=3)
    assert waits.expected_wait(now=100.0) == 1.0  # nothing known: at least a second
    for t, waited in ((10.0, 0.2), (11.0, 50.0), (12.0, 5.0), (13.0, 7.0)):  # the first falls out
        waits.started(waited, now=t)
    assert waits.expected_wait(now=13.5) == 7.0  # median of 50, 5, 7
    assert waits.expected_wait(now=113.0) == 100.0  # nothing started for 100 s: the wait is that long at least


async def test_rate_limits_answer_429_per_key(real_engine):
    config = ServeConfig(rate_limit_rps=1, rate_limit_tpm=600)
    async with open_system(real_engine, config) as system:
        first = system.submit(request("k-1", [1, 2], greedy(2), api_key="key-a"))
        with pytest.raises(SubmitError) as refused:
            system.submit(request("k-2", [1, 2], greedy(2), api_key="key-a"))
        assert (refused.value.status, refused.value.code) == (429, "rate_limit_exceeded")
        assert 0 < refused.value.retry_after <= 1.0
        with pytest.raises(SubmitError) as too_big:  # more than a minute's tokens: never fits
            system.submit(request("k-3", [1, 2], greedy(1000), api_key="key-b"))
        assert too_big.value.status == 429 and too_big.value.retry_after >= 60
        others = [system.submit(request("k-4", [1, 2], greedy(2), api_key="key-c")),
                  system.submit(request("k-5", [1, 2], greedy(2)))]  # no key: not limited
        with trio.fail_after(60):
            for stream in [first, *others]:
                assert (await collect(stream))[2].finish_reason in ("length", "stop")


async def test_prompts_the_context_cannot_hold_answer_400(real_engine):
    async with open_system(real_engine, ServeConfig()) as system:
        with pytest.raises(SubmitError) as too_long:
            system.submit(request("long", [1] * real_engine.max_model_len, greedy(1)))
        assert (too_long.value.status, too_long.value.code) == (400, "context_length_exceeded")
        with pytest.raises(SubmitError) as empty:
            system.submit(request("empty", [], greedy(1)))
        assert empty.value.status == 400


# -- the engine double -------------------------------------------------


def double_system(double, **config):
    return open_spied(double, ServeConfig(**config))


@pytest.mark.parametrize("max_model_len, num_pages, limit", [(64, 1 + 100, 64), (1000, 1 + 4, 16)])
async def test_the_context_limit_is_the_model_or_the_kv_pool(max_model_len, num_pages, limit):
    double = EngineDouble(max_model_len=max_model_len, num_pages=num_pages, page_size=4)
    async with double_system(double) as (system, allocator):
        with pytest.raises(SubmitError) as refused:
            system.submit(request("at-limit", [1] * limit, greedy(5)))
        assert refused.value.code == "context_length_exceeded" and str(limit) in refused.value.message
        with trio.fail_after(10):
            text, ids, last = await collect(system.submit(request("fits", [1] * (limit - 1), greedy(1))))
        assert (len(ids), last.finish_reason) == (1, "length")


async def test_a_request_that_outgrows_the_whole_kv_pool_ends_with_length():
    # The ingress promised this prompt "at least 1 new token" of a 16-token context;
    # running out of that context is "length", as it is at max_model_len.
    double = EngineDouble(max_model_len=1000, num_pages=1 + 4, page_size=4)
    async with double_system(double) as (system, allocator):
        with trio.fail_after(10):
            text, ids, last = await collect(system.submit(request("grows", [1] * 15, greedy(5))))
            await assert_idle_and_free(system, allocator)
    assert (last.finish_reason, last.error) == ("length", None)
    assert ids == [hashed_token("grows", 15 + k, 49152) for k in range(2)]  # 15 + 1 fill the pool; the 2nd is sampled from it


async def test_a_failing_step_ends_its_requests_with_error_and_the_system_keeps_serving():
    double = EngineDouble()
    async with double_system(double) as (system, allocator):
        double.fail_if = lambda plan: len(plan.chunks) == 3 and all(c.num_tokens == 1 for c in plan.chunks)
        streams = [system.submit(request(f"r{i}", [1, 2, 3 + i], greedy(10))) for i in range(3)]
        with trio.fail_after(10):
            results = [await collect(s) for s in streams]
            double.fail_if = None
            for text, ids, last in results:
                assert last.finish_reason == "error" and "injected step failure" in last.error
                assert len(ids) == 1  # the first token came from the prefill step, then the decode failed
            text, ids, last = await collect(system.submit(request("after", [5, 6], greedy(10))))
            assert last.finish_reason == "length" and len(ids) == 10
            await assert_idle_and_free(system, allocator)
        assert double.sequences == {}  # the engine forgot the failed ones


async def test_stop_strings_through_the_system():
    tok = CharTokenizer()
    double = EngineDouble(tokenizer=tok, scripts={"s": tok.encode("yes. STOP no"), "t": tok.encode("tail ST")})
    async with double_system(double) as (system, allocator):
        with trio.fail_after(10):
            text, ids, last = await collect(system.submit(request("s", [1, 2], greedy(50), stop=("STOP",))))
            assert (text, last.finish_reason, last.stop_string) == ("yes. ", "stop", "STOP")
            await assert_idle_and_free(system, allocator)  # the stop string freed "s" before the script ended
            text, ids, last = await collect(system.submit(request("t", [1, 2], greedy(50), stop=("STOP",))))
            assert (text, last.finish_reason, last.stop_string) == ("tail ST", "length", None)
            await assert_idle_and_free(system, allocator)


@pytest.mark.parametrize("depth", [None, 1, 3])  # the default, no planning ahead, planning further ahead
async def test_random_cancellations_leave_no_pages_and_no_engine_sequences(depth):
    rng = random.Random(3)
    double = EngineDouble(num_pages=1 + 256, page_size=4)
    async with double_system(double, max_batch_size=16, max_waiting=512, max_prefill_tokens=64,
                             scheduler_depth=depth) as (system, allocator):

        async def client(i):
            await trio.sleep(rng.uniform(0, 2))
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 120))]
            keep = rng.choice([0, 0, 1, 2, 5, 20, 1000])
            async with system.submit(request(f"c{i}", prompt, greedy(rng.randint(1, 40)))) as stream:
                for _ in range(keep):
                    try:
                        await stream.__anext__()
                    except StopAsyncIteration:
                        break
                    if rng.random() < 0.2:
                        await trio.sleep(rng.uniform(0, 0.02))

        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                for i in range(300):
                    nursery.start_soon(client, i)
            await assert_idle_and_free(system, allocator)
            text, ids, last = await collect(system.submit(request("after", [1, 2, 3], greedy(5))))
            assert last.finish_reason == "length"
        assert double.sequences == {}, f"the engine still holds {sorted(double.sequences)}"


async def test_a_tiny_kv_pool_preempts_and_still_finishes_every_request_correctly():
    rng = random.Random(5)
    specs = [(f"p{i}", rng.randint(1, 40), rng.randint(1, 40)) for i in range(24)]  # id, prompt, max tokens
    expected = {}
    for request_id, prompt_len, max_tokens in specs:  # alone: the double's tokens depend on (id, position)
        expected[request_id] = [hashed_token(request_id, prompt_len + k, 49152) for k in range(max_tokens)]
    double = EngineDouble(num_pages=1 + 24, page_size=4)  # 96 token slots; a request needs up to 80
    async with double_system(double, max_batch_size=8, max_prefill_tokens=32) as (system, allocator):
        results = {}

        async def client(request_id, prompt_len, max_tokens):
            await trio.sleep(rng.uniform(0, 0.01))  # together: 8 at a time outgrow the pool
            results[request_id] = await collect(system.submit(request(request_id, [9] * prompt_len, greedy(max_tokens))))

        with trio.fail_after(120):  # a deadlock ends here
            async with trio.open_nursery() as nursery:
                for spec in specs:
                    nursery.start_soon(client, *spec)
            await assert_idle_and_free(system, allocator)
    errors = {r: last.error for r, (_, _, last) in results.items() if last.finish_reason == "error"}
    assert errors == {}
    assert {r: ids for r, (_, ids, _) in results.items()} == expected
    assert allocator.peak_used == 24  # the pool did run out


async def test_a_prompt_with_a_token_outside_the_vocabulary_fails_only_itself():
    double = EngineDouble(vocab_size=1000)
    async with double_system(double) as (system, allocator):
        with trio.fail_after(10):
            good = system.submit(request("good", [1, 2, 3], greedy(5)))
            try:
                bad = system.submit(request("bad", [1, 5000], greedy(5)))
            except SubmitError as refused:  # refusing it at the door is as good
                assert refused.status == 400
                bad = None
            later = system.submit(request("later", [4, 5], greedy(5)))
            assert (await collect(good))[2].finish_reason == "length"
            assert (await collect(later))[2].finish_reason == "length"
            if bad is not None:
                assert (await collect(bad))[2].finish_reason == "error"
            await assert_idle_and_free(system, allocator)


async def test_preemption_while_a_partial_prefill_holds_the_pages():
    # "a" decodes while the 56-token prompt "b" is prefilled 16 tokens a step into
    # the rest of the 64-slot pool; "a" then needs a page that "b" holds.
    double = EngineDouble(num_pages=1 + 16, page_size=4)
    config = dict(scheduler="fifo", max_prefill_tokens=16, max_batch_size=4)
    async with double_system(double, **config) as (system, allocator):
        a = system.submit(request("a", [1] * 4, greedy(40)))
        b = system.submit(request("b", [1] * 56, greedy(2)))
        with trio.fail_after(60):
            (_, a_ids, a_last), (_, b_ids, b_last) = await collect(a), await collect(b)
            await assert_idle_and_free(system, allocator)
    assert (a_last.finish_reason, a_last.error) == ("length", None)
    assert (b_last.finish_reason, b_last.error) == ("length", None)
    assert a_ids == [hashed_token("a", 4 + k, 49152) for k in range(40)]
    assert b_ids == [hashed_token("b", 56 + k, 49152) for k in range(2)]


async def test_clients_that_leave_right_after_submitting_do_not_break_the_system():
    double = EngineDouble()
    async with double_system(double) as (system, allocator):
        with trio.fail_after(60):
            for i in range(40):  # on an idle system, leaving after 0..3 checkpoints
                stream = system.submit(request(f"gone-{i}", [1, 2, 3], greedy(20)))
                for _ in range(i % 4):
                    await trio.sleep(0)
                await stream.aclose()
                await trio.sleep(0.1)
            text, ids, last = await collect(system.submit(request("after", [1, 2], greedy(3))))
            assert last.finish_reason == "length"
            await assert_idle_and_free(system, allocator)
        assert double.sequences == {}, f"the engine still holds {sorted(double.sequences)}"


def test_the_throughput_line_says_tokens_per_second_and_the_queue():
    from spark.metrics import Metrics, ThroughputLog

    metrics = Metrics()
    log = ThroughputLog(metrics, now=0.0)
    assert log.line(now=10.0) is None  # idle: nothing to say
    metrics.prompt_tokens.inc(500)
    metrics.generation_tokens.inc(250)
    metrics.requests_running.set(3)
    metrics.kv_pages_used.set(25)
    metrics.kv_pages_total.set(100)
    assert log.line(now=20.0) == ("prompt 50.0 tok/s, generation 25.0 tok/s, running 3, waiting 0, "
                                  "KV pages 25/100 (25%)")
