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
