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


@pytest.fixture(scope="module")
def paced_url():
    config = ServeConfig(model="dummy:tiny-llama", port=0, device="cpu", kv_cache_bytes=16 << 20,
                         api_keys=("k1",), refusals_per_s=20.0)
    with serve_in_thread(functools.partial(serve_async, config, quiet=True), name="spark-paced") as url:
        yield url


def test_refusals_are_paced_across_connections_and_the_real_key_skips_the_line(paced_url):
    """96 bad-key requests over 8 kept-alive connections: past the burst of 50, 20 a second at most;
    meanwhile the real key's request is answered at once (a flood cannot queue it behind refusals)."""
    import threading

    from spark.http.keys import RefusalPacer

    statuses: list[int] = []

    def flood(i: int) -> None:
        with httpx.Client(base_url=paced_url, headers={"Authorization": f"Bearer bad-{i}"}, timeout=60) as http:
            statuses.extend(http.get("/v1/models").status_code for _ in range(12))

    t0 = time.monotonic()
    threads = [threading.Thread(target=flood, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # past the burst: refusals are waiting their turn now
    with httpx.Client(base_url=paced_url, headers={"Authorization": "Bearer k1"}, timeout=60) as http:
        t1 = time.monotonic()
        assert http.get("/v1/models").status_code == 200
        real_s = time.monotonic() - t1
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    assert statuses == [401] * 96
    assert elapsed >= (96 - RefusalPacer().burst) / 20.0 * 0.95, elapsed
    assert real_s < 1.0, real_s


async def test_the_pacer_gives_each_refusal_the_next_slot(autojump_clock):
    import trio

    from spark.http.keys import RefusalPacer

    pacer = RefusalPacer(burst=2)
    answered: list[float] = []

    async def refuse() -> None:
        await pacer.pace(10.0)
        answered.append(trio.current_time())

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(refuse)
    offsets = sorted(round(t - start, 6) for t in answered)
    assert offsets == [0.0, 0.0, 0.1, 0.2, 0.3]  # the burst at once, then one each 1/10 s
    await trio.sleep(10)  # an idle schedule answers at once again
    t = trio.current_time()
    await pacer.pace(10.0)
    await pacer.pace(0)  # unpaced
    assert trio.current_time() == t
