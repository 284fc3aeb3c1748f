"""Faults on purpose through the whole server (``SPARK_FAULTS``): a request told to fail ends with an
error in its API's shape, streamed or not; the others finish, the pages come back, the server serves on."""

from __future__ import annotations

import functools
import time

import httpx
import openai
import pytest

from spark.http.serve import serve_async
from spark.serve_config import ServeConfig
from tests.server_thread import serve_in_thread


@pytest.fixture(scope="module")
def url():
    # The preflight is the 1st request the core admits: the 2nd, 4th, ... fail.
    config = ServeConfig(model="dummy:tiny-llama", port=0, device="cpu", kv_cache_bytes=16 << 20,
                         faults="request=2")
    with serve_in_thread(functools.partial(serve_async, config, quiet=True), name="spark-faults") as url:
        yield url


def pages_used(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("spark_kv_pages_used "):
            return float(line.split()[1])
    raise AssertionError("no spark_kv_pages_used in /metrics")


def test_a_failed_request_is_an_error_in_the_apis_shape_and_the_next_ones_finish(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    with client:
        model = client.models.list().data[0].id
        ask = dict(model=model, prompt="hello", max_tokens=4)
        with pytest.raises(openai.InternalServerError) as failed:  # the 2nd admitted
            client.completions.create(**ask)
        assert failed.value.status_code == 500 and "told to fail" in str(failed.value)
        assert failed.value.body["code"] == "generation_failed"
        assert client.completions.create(**ask).choices[0].finish_reason == "length"  # the 3rd
        with pytest.raises(openai.APIError, match="told to fail"):  # the 4th, streamed
            for _ in client.completions.create(**ask, stream=True):
                pass
        chunks = list(client.completions.create(**ask, stream=True))  # the 5th
        assert chunks[-1].choices[0].finish_reason == "length"
    deadline = time.monotonic() + 5  # the gauge follows the core's last turn
    while pages_used(url) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pages_used(url) == 0
