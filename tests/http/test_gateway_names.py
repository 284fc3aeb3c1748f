"""The gateway as the control-plane seed defines it (issue 25), through a real server on 127.0.0.1:
``sparky-think`` and ``sparky-fast`` (the active model, thinking on / off, never a switch),
``X-Spark-Upstream-Port`` on proxied answers, ``/v1/embeddings`` reaching an upstream recipe, the
enabled list, the ROI column of ``spark inference usage``, ``spark gateway --list-aliases``,
``spark inference help`` and the activity rollups.

Front: recipes ``tiny`` (a dummy, active), ``tiny-b`` (a dummy), ``hidden`` (a dummy left out of the
host's enabled list) and ``remote`` (upstream: a small OpenAI-shaped server of this file that answers
with what it was sent).
"""

from __future__ import annotations

import functools
import json

import httpx
import hypercorn.trio
import pytest
import trio
from quart import request
from quart_trio import QuartTrio

from spark.cli import main
from spark.http.gateway import with_thinking
from spark.serve_config import ServeConfig
from tests.control.serving import running_server
from tests.server_thread import serve_in_thread

ADMIN = "sk-gateway-admin-1111111111"
KEY = "sk-gateway-client-2222222222"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
DUMMY = "id: {id}\nserved_name: {id}\nengine: spark\nmodel: dummy:tiny-llama\n"


def _fake_upstream() -> QuartTrio:
    """An OpenAI-shaped server whose chat answer is the body it got, and which serves embeddings."""
    app = QuartTrio("fake-upstream")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat():
        body = await request.get_json()
        return {"id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": json.dumps(body)}}],
                "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}

    @app.post("/v1/embeddings")
    async def embeddings():
        body = await request.get_json()
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        return {"object": "list", "model": body["model"], "usage": {"prompt_tokens": 4 * len(texts), "total_tokens": 4},
                "data": [{"object": "embedding", "index": i, "embedding": [0.5, float(len(t))]}
                         for i, t in enumerate(texts)]}

    return app


async def _serve_fake(*, shutdown_trigger, task_status=trio.TASK_STATUS_IGNORED) -> None:
    config = hypercorn.Config()
    config.bind, config.loglevel = ["127.0.0.1:0"], "WARNING"
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(functools.partial(hypercorn.trio.serve, _fake_upstream(), config,
                                                      shutdown_trigger=shutdown_trigger))
        task_status.started(binds[0])


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    with serve_in_thread(_serve_fake, name="fake-upstream") as upstream:
        recipes, config = root / "recipes", root / "config"
        recipes.mkdir()
        config.mkdir()
        for rid in ("tiny", "tiny-b", "hidden"):
            (recipes / f"{rid}.yaml").write_text(DUMMY.format(id=rid))
        (recipes / "remote.yaml").write_text(f"id: remote\nserved_name: remote\naliases: [far]\nengine: upstream\n"
                                             f"model: fake-model\ncatalog_id: acme/fake-7b\nroi_profile: cloud-7b\n"
                                             f"upstream:\n  base_url: {upstream}/v1\n")
        (recipes / "roi-profiles.yaml").write_text("profiles:\n  cloud-7b: {provider: acme, model: acme-7b}\n")
        (config / "inference-profiles.yaml").write_text("enabled: [tiny, tiny-b, remote]\n")
        (config / "inference-pricing.json").write_text(json.dumps({"cloud-7b": {"in": 1000.0, "out": 2000.0}}))
        front_config = ServeConfig(recipes_dir=str(recipes), recipe="tiny", device="cpu", kv_cache_bytes=8 << 20,
                                   api_keys=(KEY,), admin_key=ADMIN, config_dir=str(config),
                                   activity_log_path=str(root / "activity.jsonl"))
        with running_server(front_config) as front:
            yield front, int(upstream.rsplit(":", 1)[1])


def _up(front, recipe_id: str) -> None:
    with front.http(ADMIN) as http:
        assert http.post("/api/inference/up", json={"id": recipe_id, "wait": True}).status_code == 200


def test_models_lists_sparky_and_its_thinking_aliases(servers):
    front, _ = servers
    cards = {m.id: m.model_extra for m in front.client(KEY).models.list().data}
    for name in ("sparky", "sparky-think", "sparky-fast"):
        assert cards[name]["alias_of"] == "tiny" and cards[name]["state"] == "active", name
    fast = front.client(KEY).models.retrieve("sparky-fast")
    assert fast.id == "sparky-fast" and fast.model_extra == cards["sparky-fast"]
    assert "hidden" not in cards and cards["remote"]["catalog_id"] == "acme/fake-7b"  # the enabled list


def test_thinking_aliases_answer_with_the_active_model_and_never_switch(servers):
    front, _ = servers
    for name in ("sparky-think", "sparky-fast"):
        raw = front.client(KEY).chat.completions.with_raw_response.create(model=name, messages=MESSAGES, max_tokens=2)
        assert raw.parse().model == "tiny" and raw.headers["X-Spark-Active-Profile"] == "tiny"
        assert "X-Spark-Upstream-Port" not in raw.headers  # answered here, not proxied
    assert front.slot.state == "active" and front.slot.active.id == "tiny"


def test_a_proxied_answer_names_its_profile_and_upstream_port(servers):
    front, port = servers
    raw = front.client(KEY).chat.completions.with_raw_response.create(model="far", messages=MESSAGES, max_tokens=2)
    assert raw.parse().model == "remote" and json.loads(raw.parse().choices[0].message.content)["model"] == "fake-model"
    assert raw.headers["X-Spark-Active-Profile"] == "remote" and raw.headers["X-Spark-Upstream-Port"] == str(port)


def test_thinking_aliases_set_the_forwarded_thinking_switch(servers):
    front, port = servers
    _up(front, "remote")
    try:
        client = front.client(KEY)

        def sent(model: str, **extra) -> dict:
            raw = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, **extra)
            assert raw.headers["X-Spark-Active-Profile"] == "remote" and raw.headers["X-Spark-Upstream-Port"] == str(port)
            return json.loads(raw.parse().choices[0].message.content)

        assert sent("sparky-think")["chat_template_kwargs"] == {"enable_thinking": True}
        assert sent("sparky-fast")["chat_template_kwargs"] == {"enable_thinking": False}
        assert "chat_template_kwargs" not in sent("sparky")
        own = sent("sparky-fast", extra_body={"chat_template_kwargs": {"enable_thinking": True, "x": 1}})
        assert own["chat_template_kwargs"] == {"enable_thinking": True, "x": 1}  # the request's own switch wins
        assert "chat_template_kwargs" not in sent("sparky-fast", reasoning_effort="low")
    finally:
        _up(front, "tiny")


def test_with_thinking_uses_each_apis_own_field():
    assert with_thinking("/v1/messages", {}, False) == {"thinking": {"type": "disabled"}}
    assert with_thinking("/v1/messages", {"thinking": {"type": "enabled"}}, False) == {"thinking": {"type": "enabled"}}
    assert with_thinking("/v1/responses", {}, False) == {"reasoning": {"effort": "none"}}
    assert with_thinking("/v1/responses", {}, True) == {}  # on is its default
    assert with_thinking("/v1/completions", {"prompt": "x"}, False) == {"prompt": "x"}  # a raw prompt has none


def test_embeddings_reach_an_upstream_recipe_and_only_it(servers):
    front, port = servers
    client = front.client(KEY)
    raw = client.embeddings.with_raw_response.create(model="remote", input=["ab", "abc"])
    answer = raw.parse()
    assert answer.model == "remote" and [d.embedding for d in answer.data] == [[0.5, 2.0], [0.5, 3.0]]
    assert raw.headers["X-Spark-Active-Profile"] == "remote" and raw.headers["X-Spark-Upstream-Port"] == str(port)
    with httpx.Client(base_url=front.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        for model in ("tiny", "tiny-b", "sparky"):  # Spark's engine has no embeddings, and nothing switches
            r = http.post("/v1/embeddings", json={"model": model, "input": "x"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
        assert front.slot.state == "active" and front.slot.active.id == "tiny"
        assert http.post("/v1/embeddings", json={"model": "hidden", "input": "x"}).status_code == 404  # not enabled
        assert http.post("/v1/embeddings", json={"model": "remote", "input": 5}).status_code == 400
    with front.http(ADMIN) as http:
        usage = http.get("/api/inference/usage").json()
    assert usage["recipes"]["remote"]["hour"]["prompt_tokens"] >= 8
    assert any(r["endpoint"] == "/v1/embeddings" and r["recipe"] == "remote"
               for r in front.slot.activity.tail(20))


def test_usage_has_the_roi_column_and_the_cli_lists_names(servers, capsys):
    front, _ = servers
    front.client(KEY).chat.completions.create(model="remote", messages=MESSAGES, max_tokens=2)  # 7 + 3 tokens
    with front.http(ADMIN) as http:
        usage = http.get("/api/inference/usage").json()
    remote, tokens = usage["roi"]["recipes"]["remote"], usage["recipes"]["remote"]["total"]
    assert remote["profile"] == "cloud-7b" and remote["provider"] == "acme" and remote["source"] == "recipe"
    assert remote["total"] == pytest.approx((tokens["prompt_tokens"] * 1000 + tokens["completion_tokens"] * 2000) / 1e6)
    cli = ["--url", front.url, "--admin-key", ADMIN]
    assert main(["inference", "usage", *cli]) == 0
    out = capsys.readouterr().out
    assert "CLOUD COST" in out and f"${remote['total']:.4f} (cloud-7b)" in out
    assert main(["gateway", "--list-aliases", *cli]) == 0
    out = capsys.readouterr().out
    for line in ("sparky-think", "sparky-fast", "far ", "alias of remote"):
        assert line in out
    assert "hidden" not in out
    assert main(["inference", "list", *cli]) == 0
    assert "hidden (not enabled)" in capsys.readouterr().out  # listed, served only when brought up by id
    assert main(["inference", "help", *cli]) == 0
    out = capsys.readouterr().out
    assert "sparky-fast" in out and "X-Spark-Upstream-Port" in out and "tiny active as tiny" in out


def test_activity_rollups_of_the_last_hour_and_day(servers):
    front, _ = servers
    front.client(KEY).chat.completions.create(model="sparky", messages=MESSAGES, max_tokens=2)
    with front.http(ADMIN) as http:
        rollup = http.get("/api/inference/activity").json()
    hour, day = rollup["hour"], rollup["day"]
    assert hour["requests"] >= 1 and day["requests"] >= hour["requests"]
    client = next(iter(hour["clients"]))
    assert client.startswith("key-") and KEY not in json.dumps(rollup)  # a key's id, never the key
    assert hour["recipes"]["tiny"]["requests"] >= 1 and hour["endpoints"]["/v1/chat/completions"]["requests"] >= 1
    assert set(hour["recipes"]["tiny"]) == {"requests", "errors", "prompt_tokens", "completion_tokens"}
