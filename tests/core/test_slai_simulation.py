"""SLAI keeps running streams within their time-between-tokens deadline while long prompts arrive; FIFO does not.

The scenario (and the benchmark that prints it) is ``benchmarks/slai_simulation.py``:
the real core over the engine double, step time 5 ms + 0.25 ms/token on a fake clock.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.slai_simulation import ROUGH, Scenario, percentile, run


@pytest.fixture(scope="module")
def results():
    return {policy: run(policy) for policy in ("fifo", "slai")}


def test_slai_keeps_the_tbt_deadline_and_fifo_does_not(results):
    slai, fifo = results["slai"], results["fifo"]
    assert slai.gap(0.99) <= Scenario().tbt_deadline, slai.summary()
    assert fifo.gap(0.99) > Scenario().tbt_deadline, fifo.summary()


def test_both_policies_served_the_same_work(results):
    for result in results.values():
        assert len(result.ttfts) == Scenario().num_long_prompts
        assert len(result.gaps) >= 8 * 10  # every stream kept decoding through the window
        assert min(result.gaps) >= Scenario().step_base  # a token per step at most
    # the price of small chunks: more steps for the same prompts, but the prompts still get served
    assert results["slai"].steps > results["fifo"].steps
    assert results["slai"].ttft(0.5) < 3 * results["fifo"].ttft(0.5)


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile(values, 1.0)) == (50, 99, 100)
    assert percentile([3.0], 0.99) == 3.0


def test_slai_keeps_most_gaps_within_the_deadline_when_step_times_are_rough():
    """Step times padded to powers of two and noisy: the line SLAI fits misses some steps (the first
    padded ones, before it learns), but far fewer gaps pass the deadline than under FIFO."""
    scenario = Scenario(**ROUGH)
    late = {policy: sum(g > scenario.tbt_deadline for g in r.gaps) / len(r.gaps)
            for policy, r in ((p, run(p, scenario)) for p in ("fifo", "slai"))}
    assert late["slai"] <= 0.02 and late["fifo"] >= 5 * late["slai"], late


def test_the_step_trace_logs_every_step_with_what_slai_planned(tmp_path):
    path = tmp_path / "steps.jsonl"
    result = run("slai", step_trace=str(path))
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert result.steps - 2 <= len(steps) <= result.steps  # (the last steps launched may be uncollected)
    scenario = Scenario()
    prompts = scenario.num_streams * scenario.stream_prompt_tokens
    assert sum(s["prefill"] for s in steps) >= prompts + scenario.num_long_prompts * scenario.long_prompt_tokens[0]
    planned = [s for s in steps if "budget" in s]  # once the fit exists
    assert len(planned) > len(steps) // 2
    for s in planned:
        assert s["prefill"] <= max(s["budget"], 0) or s["prefill"] == 0
        base, per_row, per_token = s["fit"]
        predicted = base + per_row * s["rows"] + per_token * s["prefill"]
        # the simulated step is 5 ms + 0.25 ms a token, which the fit recovers
        assert abs(s["seconds"] - predicted) < 0.002, s
    decoding = [s for s in steps if s["rows"]]
    assert all(s["ctx"] >= s["rows"] * scenario.stream_prompt_tokens for s in decoding)


def test_a_decode_factor_holds_the_gaps_to_that_many_decode_steps():
    """With ``tbt_decode_factor`` 2 the 100 ms target shrinks to twice the streams' decode-only step
    (5 ms + 8 tokens * 0.25 ms = 7 ms): gaps stay within 14 ms while the long prompts still get served."""
    scenario = Scenario(tbt_decode_factor=2.0)
    decode_step = scenario.step_base + scenario.num_streams * scenario.step_per_token
    result = run("slai", scenario)
    assert result.gap(0.99) <= 2 * decode_step * 1.01, result.summary()
    assert result.gap(0.99) < run("slai").gap(0.99) / 2  # the plain 100 ms target lets them stretch
    assert len(result.ttfts) == scenario.num_long_prompts


def test_server_target_is_the_deadline_or_that_many_decode_steps():
    from spark.core.policies.slai import server_target
    from spark.core.step_model import StepTime

    fit = StepTime(0.005, 0.0001, 0.0002)  # 100 rows: a 15 ms decode-only step
    assert server_target(fit, 100, 0.2, None) == 0.2
    assert server_target(fit, 100, 0.2, 2.0) == pytest.approx(0.030)
    assert server_target(fit, 100, 0.02, 2.0) == 0.02  # the tighter wins
    assert server_target(None, 100, 0.2, 2.0) == 0.2  # nothing learnt yet
    assert server_target(fit, 0, 0.2, 2.0) == 0.2
