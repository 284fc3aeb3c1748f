"""Speculative decoding through the HTTP server (issue 22): a server started with ``speculative="ngram"``
streams the same greedy chat text as the session's server without it (stop strings, max_tokens and
a request that opts out included), and /metrics counts the drafts."""

from __future__ import annotations

import functools
import re
import time

import attrs
import httpx
import openai
import pytest
import torch

from spark.http.serve import serve_async
from spark.serve_config import ServeConfig
from tests.http.conftest import API_KEY, MAX_BODY_BYTES, MAX_MODEL_LEN
from tests.server_thread import serve_in_thread

REPEAT = ("Repeat this text exactly: The scheduler plans each step, the engine computes it, and the streamer "
          "sends the text back. The scheduler plans each step, the engine computes it.")


@pytest.fixture(scope="module")
def spec_url(server):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = ServeConfig(model="default", port=0, device="cpu", max_model_len=MAX_MODEL_LEN, api_keys=(API_KEY,),
                         max_body_bytes=MAX_BODY_BYTES, kv_cache_bytes=256 << 20, weight_format="dense",
                         speculative="ngram", spec_tokens=5)
    try:
        with serve_in_thread(functools.partial(serve_async, config, quiet=True), name="spark-spec-server") as url:
            yield url
    finally:
        torch.set_num_threads(threads)


def _stream(url: str, model: str, content: str, **kw) -> tuple[str, str | None, int]:
    """The streamed text, its finish reason and the number of content chunks."""
    with openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                                temperature=0, stream=True, **kw)
        text, reason, chunks = "", None, 0
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    text += choice.delta.content
                    chunks += 1
                reason = choice.finish_reason or reason
        return text, reason, chunks


def _counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    match = re.search(rf"^{name}_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("kw", [{"max_tokens": 60}, {"max_tokens": 37}, {"max_tokens": 60, "stop": ["engine computes"]}],
                         ids=["plain", "max_tokens", "stop"])
def test_streamed_text_is_the_same_with_speculation(server, spec_url, kw):
    before = _counter(spec_url, "spark_spec_accepted_tokens")
    plain = _stream(server.url, server.model, REPEAT, **kw)
    spec = _stream(spec_url, server.model, REPEAT, **kw)
    assert spec[:2] == plain[:2]
    assert _counter(spec_url, "spark_spec_accepted_tokens") > before  # drafts were taken
    assert _counter(spec_url, "spark_spec_drafted_tokens") >= _counter(spec_url, "spark_spec_accepted_tokens")


def _settled_counter(url: str, name: str) -> float:
    """The counter once the last request's final step counts have come in (metrics ride on core snapshots,
    which can arrive after its stream ended)."""
    value = _counter(url, name)
    for _ in range(50):
        time.sleep(0.1)
        again = _counter(url, name)
        if again == value:
            return value
        value = again
    return value


def test_a_request_may_opt_out(server, spec_url):
    steps = _settled_counter(spec_url, "spark_spec_steps")
    plain = _stream(server.url, server.model, REPEAT, max_tokens=24)
    spec = _stream(spec_url, server.model, REPEAT, max_tokens=24, extra_body={"speculative": False})
    assert spec[:2] == plain[:2]
    assert _settled_counter(spec_url, "spark_spec_steps") == steps
