"""Health, models, metrics, client disconnects, and the asyncio-worker start-up failure."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from spark.http.application import NEEDS_TRIO


def _metric(http, name: str) -> float:
    text = http.get("/metrics").text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match[1])


def _labelled(http, sample: str) -> float:
    """A labelled sample's value; 0 before the label's first observation (it is absent until then)."""
    text = http.get("/metrics").text
    match = re.search(rf"^{re.escape(sample)} ([0-9.e+-]+)$", text, re.M)
    return float(match[1]) if match else 0.0


def test_health_models_metrics(server):
    with server.http() as http:
        assert http.get("/health").json() == {"status": "ok"}
        r = http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert "spark_kv_pages_used" in r.text
    models = server.client().models.list().data
    # the active model, and its reserved names (issue 25: sparky-think, sparky-fast)
    assert [m.id for m in models] == [server.model, "sparky", "sparky-think", "sparky-fast"]
    assert models[0].owned_by == "spark" and models[0].model_extra["max_model_len"] > 0
    sparky = server.client().models.retrieve("sparky")  # as listed: its own id, and the model it means
    assert sparky.id == "sparky" and sparky.model_extra["alias_of"] == server.model and sparky == models[1]
    # Served without a recipe, the embedded model samples as its bundled recipe says (issue 19.1).
    assert models[0].model_extra["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9}


def test_a_request_with_no_sampling_fields_samples_with_the_models_defaults(server):
    # At the API's own temperature 1.0, "What is the capital of France?" got "Emilji, #PretzLouis':(fin ..."
    client = server.client()
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]

    def answer(**sampling) -> str:
        return client.chat.completions.create(model=server.model, max_tokens=12, messages=question, seed=11,
                                              **sampling).choices[0].message.content

    assert answer() == answer(temperature=0.2, top_p=0.9)  # the defaults the card shows, applied


def test_step_metrics_describe_the_batches(server):
    """One prompt and its decode: the step histograms count its prompt tokens and its decode rows."""
    with server.http() as http:
        steps = _metric(http, "spark_step_seconds_count")
        prefill = _metric(http, "spark_step_prefill_tokens_sum")
        rows = _metric(http, "spark_step_decode_rows_sum")
        decode_steps, prompt_steps = (_labelled(http, 'spark_step_seconds_by_prefill_count{prefill="%s"}' % c)
                                      for c in ("0", "1-128"))
        body = {"model": server.model, "prompt": "Count: 1, 2, 3,", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        out = http.post("/v1/completions", json=body).json()
        prompt_tokens = out["usage"]["prompt_tokens"]
        # The prompt in one chunk samples the first token; five decode steps give the rest.
        assert _metric(http, "spark_step_prefill_tokens_sum") - prefill == prompt_tokens
        assert _metric(http, "spark_step_decode_rows_sum") - rows == 5
        assert _metric(http, "spark_step_seconds_count") - steps == 6
        # Step times by the prompt tokens a step computed: the decode steps apart from the prompt's.
        assert _metric(http, 'spark_step_seconds_by_prefill_count{prefill="0"}') - decode_steps == 5
        assert _metric(http, 'spark_step_seconds_by_prefill_count{prefill="1-128"}') - prompt_steps == 1


def _open_and_drop_a_stream(http, model: str) -> None:
    """Start a long streamed completion, read a few events, and hang up."""
    body = {"model": model, "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped iterator closes the connection (the hang-up, too early)
        events = [line for line, _ in zip(lines, range(8)) if line.startswith("data:")]
        assert len(events) >= 3
        deadline = time.monotonic() + 2  # the gauges follow the core's turns (another thread)
        while _metric(http, "spark_kv_pages_used") == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _metric(http, "spark_kv_pages_used") > 0  # it is running


def test_disconnect_mid_stream_cancels_the_request(server):
    with server.http() as http:
        before = _metric(http, "spark_generation_tokens_total")
        _open_and_drop_a_stream(http, server.model)
        # 400 tokens take far longer than this: only a cancel frees the pages in time.
        deadline = time.monotonic() + 5
        while _metric(http, "spark_kv_pages_used") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(http, "spark_kv_pages_used") == 0
        assert _metric(http, "spark_requests_running") == 0
        generated = _metric(http, "spark_generation_tokens_total") - before
        time.sleep(0.3)
        assert _metric(http, "spark_generation_tokens_total") - before == generated < 50  # and it stays stopped
        assert http.get("/health").status_code == 200


def test_client_timeout_on_a_non_streamed_request_cancels_it(server):
    body = {"model": server.model, "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    with server.http() as http:
        before = _metric(http, "spark_generation_tokens_total")
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0))
        deadline = time.monotonic() + 5
        while _metric(http, "spark_kv_pages_used") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(http, "spark_kv_pages_used") == 0
        assert _metric(http, "spark_generation_tokens_total") - before < 150


def test_asyncio_worker_fails_at_start_up_with_one_line(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "SPARK_MODEL": "dummy:never-loaded",
           "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "hypercorn", "spark.http:app", "--bind", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    # The process ends by itself (hypercorn's master reports exit status 0 whatever its worker's).
    assert proc.stderr.strip() == NEEDS_TRIO, proc.stderr
    assert "-k trio" in NEEDS_TRIO


def test_the_prefix_cache_shows_in_metrics(server):
    prompt = "The harbour town woke slowly: fishermen mended nets, gulls argued over scraps, and the bakers " * 2
    body = {"model": server.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    with server.http() as http:
        assert http.post("/v1/completions", json=body).status_code == 200  # computes, and caches, its pages
        hits = _metric(http, "spark_prefix_cache_hit_tokens_total")
        queried = _metric(http, "spark_prefix_cache_queried_tokens_total")
        assert http.post("/v1/completions", json=body).status_code == 200
        deadline = time.monotonic() + 2  # the gauges follow the core's turns (another thread)
        while _metric(http, "spark_prefix_cache_hit_tokens_total") == hits and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _metric(http, "spark_prefix_cache_hit_tokens_total") - hits >= 16  # a page at least
        assert _metric(http, "spark_prefix_cache_queried_tokens_total") > queried
        assert _metric(http, "spark_prefix_cache_pages") > 0
