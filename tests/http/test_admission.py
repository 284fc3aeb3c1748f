"""Deadline-aware admission through a real server: refused past the TTFT bound in each API's shape,
with a Retry-After; a request's own time-between-tokens target; the predictions in /metrics."""

from __future__ import annotations

import functools

import anthropic
import httpx
import openai
import pytest

from spark.http.serve import serve_async
from spark.serve_config import ServeConfig
from tests.server_thread import serve_in_thread


@pytest.fixture(scope="module")
def url():
    # A bound no prediction meets: once the server has seen enough steps to predict, it refuses.
    config = ServeConfig(model="dummy:tiny-llama", port=0, device="cpu", kv_cache_bytes=16 << 20, ttft_bound_s=1e-6)
    with serve_in_thread(functools.partial(serve_async, config, quiet=True), name="spark-admission") as url:
        yield url


def complete(url: str, words: int, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "sparky", "prompt": "hello " * words, "max_tokens": 4,
                                                     **extra}, timeout=60)


def test_past_the_bound_requests_are_refused_in_each_apis_shape(url):
    statuses = [complete(url, words).status_code for words in (3, 40, 9, 120, 20, 70, 5, 200)]
    assert statuses[0] == 200 and 429 in statuses  # admitted until the step model could predict
    refused = complete(url, 10)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "overloaded" and "bound" in refused.json()["error"]["message"]
    assert int(refused.headers["Retry-After"]) >= 1

    chat = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.RateLimitError) as err:
        chat.chat.completions.create(model="sparky", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert err.value.response.headers.get("Retry-After")

    messages = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as err:
        messages.messages.create(model="sparky", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 529
    assert err.value.body["error"]["type"] == "overloaded_error" and err.value.response.headers.get("Retry-After")

    metrics = httpx.get(url + "/metrics").text
    assert "spark_requests_refused_overloaded_total" in metrics
    assert 'spark_ttft_predicted_seconds_count' in metrics and "spark_ttft_prediction_error_ratio_count" in metrics


def test_a_requests_tbt_target_must_be_a_positive_number_of_ms(url):
    bad = complete(url, 3, tbt_ms=0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tbt_ms"
    assert complete(url, 3, tbt_ms="fast").status_code == 400


def test_anthropic_and_responses_take_sparks_own_tbt_ms_and_check_it(url):
    messages = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        messages.messages.create(model="sparky", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                 extra_body={"tbt_ms": -5})
    assert err.value.body["type"] == "error" and "tbt_ms" in err.value.body["error"]["message"]
    responses = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        responses.responses.create(model="sparky", input="hi", max_output_tokens=4, extra_body={"tbt_ms": 0})
    assert err.value.body["param"] == "tbt_ms"


def test_a_single_generation_carries_its_tbt_target_and_speculation_opt_out():
    from spark.engine.sampling import SamplingParams
    from spark.http.params import Limits, single_job

    limits = Limits("m", max_model_len=64, vocab_size=100, default_max_tokens=4)
    job = single_job("r", [1, 2, 3], SamplingParams(max_tokens=4), limits, stream=False, api_key=None,
                     speculative=False, tbt_ms=50)
    assert job.requests[0].tbt_s == pytest.approx(0.05) and job.requests[0].speculative is False
    default = single_job("r", [1, 2, 3], SamplingParams(max_tokens=4), limits, stream=False, api_key=None)
    assert default.requests[0].tbt_s is None and default.requests[0].speculative is True
