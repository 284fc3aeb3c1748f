"""Completions' ``echo`` with ``logprobs`` scores the prompt (lm-evaluation-harness's loglikelihood): each
prompt token's logprob and top alternatives, the first null, equal to a teacher-forced prefill; whole or
chunked over several steps; ``max_tokens: 0`` returns the scored prompt alone. Through a real server."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from spark.engine.engine import Engine
from spark.engine.offline import prefill_logits
from spark.http.serve import serve_async
from spark.serve_config import ServeConfig
from tests.http.conftest import API_KEY, MAX_MODEL_LEN, Server
from tests.server_thread import serve_in_thread

PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern and a "
          "notebook in which he wrote down the colour of the sea.")
CHUNK = 8  # the chunked server's prefill tokens per step: PROMPT takes several


@pytest.fixture(scope="module")
def reference() -> Engine:
    """The served model as the server loads it (dense, float32 on the CPU), for teacher forcing."""
    return Engine.load("default", device="cpu", dtype=torch.float32, weight_format="dense",
                       kv_cache_tokens=1024, progress=False)


@pytest.fixture(scope="module")
def chunked():
    """A server whose prefills take at most ``CHUNK`` tokens a step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = ServeConfig(model="default", port=0, device="cpu", max_model_len=MAX_MODEL_LEN, api_keys=(API_KEY,),
                         kv_cache_bytes=64 << 20, weight_format="dense", max_prefill_tokens=CHUNK)
    try:
        with serve_in_thread(functools.partial(serve_async, config, quiet=True), name="spark-chunked") as url:
            running = Server(url, "default")
            with running.http() as http:
                running.model = http.get("/v1/models").json()["data"][0]["id"]
            try:
                yield running
            finally:
                running.close()
    finally:
        torch.set_num_threads(threads)


def expected(engine: Engine, ids: list[int], k: int) -> tuple[list[float], list[dict[str, float]]]:
    """Each prompt token's logprob after the first, and its top ``k`` by text, teacher forced."""
    logprobs = torch.log_softmax(prefill_logits(engine, [ids], last=len(ids))[0].double(), -1)[:-1]  # [T-1, V]
    chosen = logprobs.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
    top = logprobs.topk(k, -1)
    tops = [{engine.tokenizer.token_text(t): lp for t, lp in zip(row_ids, row_lps)}
            for row_ids, row_lps in zip(top.indices.tolist(), top.values.tolist())]
    return chosen, tops


def check_prompt(lp, reference: Engine, ids: list[int], k: int) -> None:
    n = len(ids)
    assert lp.tokens[:n] == [reference.tokenizer.token_text(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing comes before the first
    chosen, tops = expected(reference, ids, k)
    assert lp.token_logprobs[1:n] == pytest.approx(chosen, abs=2e-3)
    for got, want in zip(lp.top_logprobs[1:n], tops):
        assert len(got) == k and got == pytest.approx(want, abs=2e-3)
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert lp.text_offset[:n] == offsets


@pytest.mark.parametrize("which", ["server", "chunked"])
def test_echo_scores_the_prompt(request, reference, which):
    server = request.getfixturevalue(which)
    ids = reference.tokenizer.encode(PROMPT, add_special_tokens=True)
    assert len(ids) > 3 * CHUNK
    client = server.client()
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                  logprobs=2, extra_body={"ignore_eos": True})
    (choice,) = r.choices
    lp = choice.logprobs
    check_prompt(lp, reference, ids, 2)
    assert len(lp.tokens) == len(ids) + 3 and all(p is not None for p in lp.token_logprobs[len(ids):])
    assert choice.text.startswith(PROMPT) and lp.text_offset[len(ids)] == len(PROMPT)
    assert r.usage.completion_tokens == 3 and r.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0,
                                            echo=True, logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    for key in ("tokens", "text_offset"):
        assert [x for part in streamed for x in getattr(part, key)] == getattr(lp, key), key
    # (computed again, maybe in another batching: equal up to float rounding)
    assert [x for part in streamed for x in part.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert [x for part in streamed for x in part.top_logprobs] == [
        None if top is None else pytest.approx(top, abs=1e-4) for top in lp.top_logprobs]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


def test_max_tokens_0_with_echo_returns_the_scored_prompt(chunked, reference):
    """lm-evaluation-harness's loglikelihood request, as it sends it."""
    ids = reference.tokenizer.encode(PROMPT, add_special_tokens=True)
    client = chunked.client()
    r = client.completions.create(model=chunked.model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                  temperature=0)
    (choice,) = r.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)
    check_prompt(choice.logprobs, reference, ids, 1)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert math.fsum(choice.logprobs.token_logprobs[1:]) < 0
    chunks = list(client.completions.create(model=chunked.model, prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}))
    texts = "".join(c.choices[0].text for c in chunks if c.choices)
    assert texts == reference.tokenizer.decode(ids)
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0


def test_max_tokens_0_without_echo_stays_a_400(server):
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_cached_prompt_is_scored_whole(chunked, reference):
    """A prompt whose pages the prefix cache holds is computed again to be scored."""
    ids = reference.tokenizer.encode(PROMPT + " Twice.", add_special_tokens=True)
    client = chunked.client()
    client.completions.create(model=chunked.model, prompt=ids, max_tokens=1)  # caches its pages
    r = client.completions.create(model=chunked.model, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    check_prompt(r.choices[0].logprobs, reference, ids, 0)


def test_without_echo_nothing_changes(chunked, server):
    """The default path: a chunked prompt's greedy output and logprobs, as the unchunked server's."""
    kw = dict(prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    a = chunked.client().completions.create(model=chunked.model, **kw)
    b = server.client().completions.create(model=server.model, **kw)
    assert a.choices[0].text == b.choices[0].text and len(a.choices[0].logprobs.tokens) == 5
    assert a.choices[0].logprobs.token_logprobs == pytest.approx(b.choices[0].logprobs.token_logprobs, abs=1e-3)
