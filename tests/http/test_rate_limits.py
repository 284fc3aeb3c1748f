"""The rate limiter through the server: one API request is one request, whatever its ``n`` (issue 18.1)."""

from __future__ import annotations

import functools
import time

import httpx
import pytest

from spark.http.serve import serve_async
from spark.serve_config import ServeConfig
from tests.server_thread import serve_in_thread


@pytest.fixture(scope="module")
def url():
    config = ServeConfig(model="dummy:tiny-llama", port=0, device="cpu", kv_cache_bytes=16 << 20,
                         api_keys=("k1",), rate_limit_rps=1.0)
    with serve_in_thread(functools.partial(serve_async, config, quiet=True), name="spark-rate") as url:
        yield url


def test_n_choices_are_one_request_and_a_refusal_charges_nothing(url):
    with httpx.Client(base_url=url, headers={"Authorization": "Bearer k1"}, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        ask = {"model": model, "prompt": "hi", "max_tokens": 1}
        time.sleep(1.1)  # a full bucket
        two = http.post("/v1/completions", json={**ask, "n": 2})
        assert two.status_code == 200, two.text
        assert len(two.json()["choices"]) == 2
        refused = http.post("/v1/completions", json={**ask, "n": 2})  # within the same second
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert float(refused.headers["Retry-After"]) <= 1
        time.sleep(1.1)  # the refusal took nothing from the bucket: a second later one fits
        assert http.post("/v1/completions", json=ask).status_code == 200
