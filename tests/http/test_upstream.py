"""An upstream recipe: a second Spark server on another port, served through the first.

Front: recipes ``tiny`` (a dummy, active), ``remote`` (upstream: the back server) and ``dead`` (an
upstream nobody listens on). Back: the embedded default model, with an API key of its own that the
front reads from the environment variable ``remote`` names.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from spark.serve_config import ServeConfig
from tests.control.serving import running_server

FRONT_KEY = "sk-front-client-1111111111"
ADMIN = "sk-front-admin-2222222222"
BACK_KEY = "sk-back-upstream-3333333333"
KEY_ENV = "SPARK_TEST_UPSTREAM_KEY"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("upstream")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    back_config = ServeConfig(model="default", device="cpu", max_model_len=512, kv_cache_bytes=64 << 20,
                              api_keys=(BACK_KEY,))
    with pytest.MonkeyPatch.context() as env, running_server(back_config) as back:
        env.setenv(KEY_ENV, BACK_KEY)
        recipes = root / "recipes"
        recipes.mkdir()
        (recipes / "tiny.yaml").write_text("id: tiny\nserved_name: tiny\nengine: spark\nmodel: dummy:tiny-llama\n")
        (recipes / "remote.yaml").write_text(
            f"id: remote\nserved_name: remote\naliases: [far]\nengine: upstream\nmodel: sparky\n"
            f"upstream:\n  base_url: {back.url}/v1\n  api_key_env: {KEY_ENV}\nsampling:\n  temperature: 0\n")
        (recipes / "dead.yaml").write_text("id: dead\nserved_name: dead\nengine: upstream\nmodel: x\n"
                                           "upstream:\n  base_url: http://127.0.0.1:9/v1\n")
        front_config = ServeConfig(recipes_dir=str(recipes), recipe="tiny", device="cpu", kv_cache_bytes=8 << 20,
                                   api_keys=(FRONT_KEY,), admin_key=ADMIN,
                                   activity_log_path=str(root / "activity.jsonl"), usage_path=str(root / "usage.json"))
        try:
            with running_server(front_config) as front:
                front.root = root
                yield front, back
        finally:
            torch.set_num_threads(threads)


MESSAGES = [{"role": "user", "content": "Name a colour."}]


def test_a_named_upstream_is_proxied_without_a_switch(servers):
    front, back = servers
    raw = front.client().chat.completions.with_raw_response.create(model="remote", messages=MESSAGES, max_tokens=6)
    answer = raw.parse()
    assert answer.model == "remote" and answer.choices[0].message.content and answer.usage.completion_tokens > 0
    # the profile that answered, not the local one (issue 18.8)
    assert raw.headers["X-Spark-Served-Model"] == "remote" and raw.headers["X-Spark-Active-Profile"] == "remote"
    direct = back.client().chat.completions.create(model="sparky", messages=MESSAGES, max_tokens=6, temperature=0)
    assert answer.choices[0].message.content == direct.choices[0].message.content  # the recipe's temperature 0
    assert front.slot.state == "active" and front.slot.active.id == "tiny"  # the local model stayed up
    local = front.client().chat.completions.with_raw_response.create(model="sparky", messages=MESSAGES, max_tokens=2)
    assert local.headers["X-Spark-Active-Profile"] == "tiny"
    cards = {m.id: m for m in front.client().models.list().data}
    assert "sparky" in cards and cards["sparky"].alias_of == "tiny" and cards["sparky"].state == "active"


def test_streams_are_relayed_and_counted(servers):
    front, _ = servers
    client = front.client()
    chunks = list(client.chat.completions.create(model="far", messages=MESSAGES, max_tokens=6, stream=True))
    assert all(c.model == "remote" for c in chunks) and all(c.choices for c in chunks)  # no usage chunk: not asked
    assert chunks[-1].choices[0].finish_reason is not None
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    with_usage = list(client.chat.completions.create(model="remote", messages=MESSAGES, max_tokens=5, stream=True,
                                                     stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 5
    completions = list(client.completions.create(model="remote", prompt="1, 2, 3,", max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in completions if c.choices)
    with front.http(ADMIN) as http:
        usage = http.get("/api/inference/usage").json()["recipes"]["remote"]["hour"]
        logs = http.get("/api/inference/logs", params={"n": 3}).json()["activity"]
    assert usage["requests"] >= 4 and usage["completion_tokens"] >= 6 + 6 + 5 + 4
    streamed = [r for r in logs if r["recipe"] == "remote" and r["stream"]]
    assert len(streamed) == 3 and all(r["completion_tokens"] > 0 and r["prompt_tokens"] > 0 for r in streamed)
    assert streamed[1]["completion_tokens"] == 5


def test_upstream_errors_come_through(servers):
    front, _ = servers
    with front.http(FRONT_KEY) as http:
        bad = http.post("/v1/chat/completions", json={"model": "remote", "messages": MESSAGES, "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"  # the back's own answer
        dead = http.post("/v1/chat/completions", json={"model": "dead", "messages": MESSAGES})
        assert dead.status_code == 502 and dead.json()["error"]["code"] == "upstream_unreachable"
        assert "127.0.0.1:9" in dead.json()["error"]["message"] and dead.headers["X-Spark-Served-Model"] == "dead"
    with front.http(ADMIN) as http:  # bringing it up runs its preflight, which fails
        r = http.post("/api/inference/up", json={"id": "dead", "wait": True})
        assert r.status_code == 500 and "unreachable" in r.json()["error"]["message"]
        assert http.post("/api/inference/up", json={"id": "tiny", "wait": True}).status_code == 200


def test_an_upstream_brought_up_takes_sparky_and_frees_the_local_model(servers):
    front, _ = servers
    with front.http(ADMIN) as http:
        assert http.post("/api/inference/up", json={"id": "remote", "wait": True}).status_code == 200
    assert front.slot.model is None and front.state.system is None  # the local engine is unloaded
    raw = front.client().chat.completions.with_raw_response.create(model="sparky", messages=MESSAGES, max_tokens=3)
    assert raw.parse().model == "remote" and raw.headers["X-Spark-Active-Profile"] == "remote"
    cards = {m.id: m.model_extra["state"] for m in front.client().models.list().data}
    assert cards == {"tiny": "available", "remote": "active", "far": "active", "dead": "available", "sparky": "active",
                     "sparky-think": "active", "sparky-fast": "active"}
    with front.http(ADMIN) as http:
        assert http.post("/api/inference/up", json={"id": "tiny", "wait": True}).status_code == 200
    assert front.client().completions.create(model="sparky", prompt="t1", max_tokens=2).model == "tiny"


def test_no_secret_reaches_the_activity_log(servers):
    front, _ = servers
    text = (front.root / "activity.jsonl").read_text()
    for secret in (FRONT_KEY, ADMIN, BACK_KEY, "Bearer", "Authorization"):
        assert secret not in text
    records = [json.loads(line) for line in text.splitlines()]
    assert any(r["recipe"] == "remote" for r in records) and all(r["key_id"] != FRONT_KEY for r in records)
    with httpx.Client(base_url=front.url) as http:  # the front key does not open the back
        assert http.post("/v1/chat/completions", json={"model": "remote", "messages": MESSAGES}).status_code == 401
