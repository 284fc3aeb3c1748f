"""Deadline-aware admission: the TTFT a request is predicted, and the refusal past the bound."""

import math

import pytest

from spark.actors.admission import AdmissionLimits, TtftPredictor
from spark.core.events import StepShape

BASE, PER_ROW, PER_TOKEN = 0.01, 0.0005, 0.0001  # step seconds = BASE + PER_ROW * rows + PER_TOKEN * tokens
SHAPES = ((1, 0), (8, 512), (4, 100), (16, 2048))  # (decode rows, prefill tokens) of the steps seen
# Before its own steps, a request waits for those launched already: 1.5 steps (depth 2) as long as the latest.
IN_FLIGHT = 1.5 * sum(BASE + PER_ROW * r + PER_TOKEN * t for r, t in SHAPES) / len(SHAPES)


def trained(**limits) -> TtftPredictor:
    p = TtftPredictor(AdmissionLimits(**limits))
    shapes = [StepShape(BASE + PER_ROW * r + PER_TOKEN * t, r, t) for r, t in SHAPES]
    p.observe_core(8, shapes)
    return p


def test_no_prediction_before_the_steps_tell_and_nothing_refused():
    p = TtftPredictor(AdmissionLimits(ttft_bound_s=0.001))
    assert p.predict(1000) is None and p.refusal(1000) is None


def test_fifo_prefills_the_queue_ahead_a_full_budget_a_step():
    p = trained(policy="fifo", max_prefill_tokens=512)
    assert p.predict(100) == pytest.approx(IN_FLIGHT + BASE + 8 * PER_ROW + 100 * PER_TOKEN, rel=1e-4)
    p.admitted("a", 900)  # 900 tokens ahead: with 100 more, 2 steps of 512
    assert p.predict(100) == pytest.approx(IN_FLIGHT + 2 * (BASE + 8 * PER_ROW + 512 * PER_TOKEN), rel=1e-4)
    p.first_token("a", 0.2)  # prefilled: no longer ahead
    assert p.predict(100) == pytest.approx(IN_FLIGHT + BASE + 8 * PER_ROW + 100 * PER_TOKEN, rel=1e-4)


def test_slai_budget_is_what_keeps_the_running_streams_deadline():
    p = trained(policy="slai", max_prefill_tokens=8192, tbt_deadline=0.1)
    budget = math.floor((0.9 * 0.1 - BASE - 8 * PER_ROW) / PER_TOKEN)  # 760 tokens beside 8 decodes
    assert p.predict(5000) == pytest.approx(IN_FLIGHT + math.ceil(5000 / budget) * (BASE + 8 * PER_ROW + budget * PER_TOKEN),
                                            rel=3e-3)


def test_slai_budget_keeps_back_what_the_model_overran_as_slai_does():
    p = trained(policy="slai", max_prefill_tokens=8192, tbt_deadline=0.1)
    exact = p.predict(5000)
    # Steps with prompt tokens that took 20 ms longer than the fit: SLAI's budget shrinks, so does this one's.
    p.observe_core(8, [StepShape(BASE + PER_ROW * 8 + PER_TOKEN * 256 + 0.02, 8, 256)] * 8)
    overrun = p.step_time.overrun()
    assert overrun > 0.01
    fit = p.step_time.fit()
    budget = math.floor((0.9 * 0.1 - overrun - fit.base - 8 * fit.per_row) / fit.per_token)
    assert p.predict(5000) > exact
    assert p.predict(5000) == pytest.approx(p.in_flight() + math.ceil(5000 / budget) * fit.seconds(8, budget),
                                            rel=3e-3)


def test_past_the_bound_a_request_is_refused_with_a_retry_after_from_the_prediction():
    p = trained(policy="fifo", max_prefill_tokens=512, ttft_bound_s=0.5)
    assert p.refusal(100) is None
    for i in range(20):
        p.admitted(f"r{i}", 512)  # 20 steps queued ahead
    predicted, retry = p.refusal(100)
    assert predicted == pytest.approx(IN_FLIGHT + 21 * (BASE + 8 * PER_ROW + 512 * PER_TOKEN), rel=1e-4)
    assert retry == math.ceil(predicted - 0.5) >= 1


def test_the_prediction_error_is_measured_and_ended_requests_leave_the_queue():
    p = trained(policy="fifo", max_prefill_tokens=512)
    predicted = p.admitted("a", 100)
    assert p.first_token("a", predicted * 2) == pytest.approx(0.5)
    assert p.first_token("a", 1.0) is None  # once
    p.admitted("b", 4000)
    p.ended("b")  # cancelled while queued
    assert p.predict(100) == pytest.approx(predicted, rel=1e-4)


def test_an_idle_server_has_no_step_in_flight():
    p = trained(policy="fifo", max_prefill_tokens=512)
    p.observe_core(0, [])  # no stream runs, nothing queued
    assert p.predict(100) == pytest.approx(BASE + 100 * PER_TOKEN, rel=1e-4)
