"""Many model names, one slot, one URL: a real server with recipes on the default model and tiny dummies.

The module's server starts on ``smol-a`` (the embedded model) beside ``smol-b`` (the same weights under
another name), two tiny dummy recipes, a draft, a recipe whose weights are missing, and every malformed
file of ``tests/recipes/malformed.py``.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest
import torch

from spark.cli import main
from spark.serve_config import ServeConfig
from tests.control.serving import running_server
from tests.recipes.malformed import MALFORMED, write_malformed

KEY = "sk-switch-client-0123456789"
ADMIN = "sk-switch-admin-9876543210"
_TINY = "engine: spark\nmodel: dummy\ndummy:\n  preset: tiny-llama\n  config: {max_position_embeddings: 4096}\n"
RECIPES = {
    "smol-a": "served_name: smol-a\naliases: [smol-alpha]\nengine: spark\nmodel: default\nsampling: {max_tokens: 8}\n",
    "smol-b": "served_name: smol-b\nengine: spark\nmodel: default\n",
    "tiny": "served_name: tiny\n" + _TINY,
    "tiny-2": "served_name: tiny-2\n" + _TINY,
    "gone": "served_name: gone\nengine: spark\nmodel: /nowhere/weights.gguf\n",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("switching")
    recipes = root / "recipes"
    write_malformed(recipes)
    for name, body in RECIPES.items():
        (recipes / f"{name}.yaml").write_text(f"id: {name}\n{body}")
    (recipes / "drafts").mkdir()
    (recipes / "drafts" / "tiny-draft.yaml").write_text("id: tiny-draft\nserved_name: tiny-draft\nlifecycle: draft\n"
                                                        + _TINY)
    config = ServeConfig(recipes_dir=str(recipes), recipe="smol-a", device="cpu", max_model_len=512,
                         kv_cache_bytes=64 << 20, max_batch_size=16, api_keys=(KEY,), admin_key=ADMIN,
                         switch_grace_s=30.0, activity_log_path=str(root / "activity.jsonl"),
                         usage_path=str(root / "usage.json"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine shares 2 cores with the clients of the tests
    try:
        with running_server(config) as running:
            running.root = root
            yield running
    finally:
        torch.set_num_threads(threads)


def _up(server, recipe_id: str, **body) -> dict:
    with server.http(ADMIN) as http:
        r = http.post("/api/inference/up", json={"id": recipe_id, "wait": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(client: openai.OpenAI, model: str):
    return client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, temperature=0)


def test_the_sdk_naming_the_inactive_model_gets_503_then_succeeds(server):
    client = server.client()
    raw = _chat(client, "sparky")
    assert raw.headers["X-Spark-Active-Profile"] == "smol-a" and raw.headers["X-Spark-Served-Model"] == "smol-a"
    assert raw.parse().model == "smol-a" and raw.parse().usage.completion_tokens <= 4
    assert _chat(client, "smol-alpha").parse().model == "smol-a"  # an alias of the active model
    capped = client.completions.create(model="sparky", prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 8  # the recipe's sampling.max_tokens, for a request naming none
    with pytest.raises(openai.APIStatusError) as info:
        _chat(client, "smol-b")
    refused = info.value.response
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    assert info.value.code == "model_loading" and refused.headers["X-Spark-Served-Model"] in ("smol-a", "none")
    deadline = time.monotonic() + 120
    while True:  # what a client does with Retry-After (polled faster here)
        try:
            raw = _chat(client, "smol-b")
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and exc.response.headers["Retry-After"]
            assert time.monotonic() < deadline, "the switch did not finish"
            time.sleep(0.2)
    assert raw.parse().model == "smol-b" and raw.parse().choices[0].message.content
    assert raw.headers["X-Spark-Active-Profile"] == "smol-b" and raw.headers["X-Spark-Served-Model"] == "smol-b"
    sparky = _chat(client, "sparky")
    assert sparky.parse().model == "smol-b" and sparky.headers["X-Spark-Active-Profile"] == "smol-b"
    with pytest.raises(openai.NotFoundError) as info:
        _chat(client, "no-such-model")
    assert info.value.response.headers["X-Spark-Active-Profile"] == "smol-b"


def test_models_lists_every_enabled_name_with_its_state(server):
    cards = {m.id: m.model_extra for m in server.client().models.list().data}
    states = {name: card["state"] for name, card in cards.items()}
    active = server.slot.active.served_name
    assert states[active] == "active"
    assert {"smol-a", "smol-alpha", "smol-b", "tiny", "tiny-2", "gone", "m-valid-one", "v2"} <= set(states)
    assert states["gone"] == "unavailable" and "/nowhere" in cards["gone"]["unavailable_reason"]
    assert cards["smol-alpha"]["alias_of"] == "smol-a"
    assert "tiny-draft" not in states
    assert states["sparky"] == "active" and cards["sparky"]["alias_of"] == active  # listed (issue 18.8)
    assert server.client().models.retrieve("sparky").model_extra == cards["sparky"]  # as listed
    with server.http(KEY) as http:
        r = http.post("/v1/chat/completions", json={"model": "gone", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable"
        assert "Retry-After" not in r.headers
        assert http.post("/v1/completions", json={"model": "tiny-draft", "prompt": "x"}).status_code == 404


def test_the_server_started_beside_every_malformed_recipe(server):
    with server.http(ADMIN) as http:
        status = http.get("/api/inference/status").json()
    problems = status["problems"]
    assert {p.split(":")[0].rsplit("/", 1)[-1] for p in problems} == set(MALFORMED)
    for name, (_, expected) in MALFORMED.items():
        for fragment in expected:
            assert any(name in p and fragment in p for p in problems), (name, fragment)
    assert {"smol-a", "smol-b", "tiny", "tiny-2", "valid-one", "valid-two"} <= {r["id"] for r in status["recipes"]}


def _stream(server, model: str, max_tokens: int, events: list, started: threading.Event) -> None:
    """One streamed completion; appends ("done", finish_reason) or ("error", message) or ("broken", why)."""
    body = {"model": model, "prompt": "t1 t2 t3", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        with server.http(KEY) as http, http.stream("POST", "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            reason = None
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                started.set()
                if line == "data: [DONE]":
                    events.append(("done", reason))
                    return
                event = json.loads(line[6:])
                if "error" in event:
                    events.append(("error", event["error"]["message"]))
                    return
                reason = event["choices"][0]["finish_reason"] or reason
        events.append(("broken", "the stream ended without [DONE]"))
    except Exception as exc:  # noqa: BLE001 -- reported by the test
        events.append(("broken", repr(exc)))


def _under_load(server, model: str, target: str, *, max_tokens: int, grace_s: float) -> list:
    events: list = []
    started = [threading.Event() for _ in range(8)]
    threads = [threading.Thread(target=_stream, args=(server, model, max_tokens, events, s)) for s in started]
    for t in threads:
        t.start()
    for s in started:
        assert s.wait(60), "a stream did not start"
    _up(server, target, grace_s=grace_s)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    return events


def _kv_pages_used(server) -> float:
    with server.http(KEY) as http:
        return float(re.search(r"^spark_kv_pages_used (\S+)$", http.get("/metrics").text, re.M)[1])


def test_switch_under_load_cuts_off_streams_past_the_grace_period(server):
    _up(server, "tiny")
    events = _under_load(server, "tiny", "tiny-2", max_tokens=3000, grace_s=0.3)
    assert len(events) == 8
    assert all(kind == "error" and "tiny was unloaded (switching to tiny-2)" in text for kind, text in events), events
    with server.http(ADMIN) as http:
        status = http.get("/api/inference/status").json()
    assert status["active"]["id"] == "tiny-2" and status["last_unload"]["recipe"] == "tiny"
    assert status["last_unload"]["cut_off"] == 8 and status["last_unload"]["kv_pages_in_use"] == 0
    assert status["active"]["open_streams"] == 0 and _kv_pages_used(server) == 0


def test_switch_under_load_lets_streams_finish_within_the_grace_period(server):
    events = _under_load(server, "tiny-2", "tiny", max_tokens=40, grace_s=30)
    assert events == [("done", "length")] * 8
    with server.http(ADMIN) as http:
        last = http.get("/api/inference/status").json()["last_unload"]
    assert (last["recipe"], last["cut_off"], last["kv_pages_in_use"]) == ("tiny-2", 0, 0)
    assert _kv_pages_used(server) == 0


def test_admin_api_needs_the_admin_key(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/api/inference/status").status_code == 401
        refused = http.post("/api/inference/up", json={"id": "tiny"})
        # Refused before its body was read, which came with the headers: the connection serves on
        # (test_keep_alive: one whose body had not arrived is closed).
        assert refused.status_code == 401
        as_client = {"Authorization": f"Bearer {KEY}"}
        assert http.get("/api/inference/status", headers=as_client).status_code == 200  # reads: any key
        assert http.post("/api/inference/down", headers=as_client).status_code == 403
        as_admin = {"Authorization": f"Bearer {ADMIN}"}
        r = http.post("/api/inference/up", json={"id": "nope"}, headers=as_admin)
        assert r.status_code == 404 and "tiny-2" in r.json()["error"]["message"]
        assert http.post("/api/inference/up", json={"id": "gone"}, headers=as_admin).status_code == 503


def test_cli_status_down_up_logs_usage_bench(server, capsys):
    flags = ["--url", server.url, "--admin-key", ADMIN]
    assert main(["inference", "status", *flags]) == 0
    assert "active:  tiny" in capsys.readouterr().out
    assert main(["inference", "list", *flags]) == 0
    listing = capsys.readouterr().out
    assert re.search(r"^tiny-draft \(draft\) +tiny-draft .* available$", listing, re.M)
    assert re.search(r"^tiny +tiny .* active$", listing, re.M)
    assert main(["inference", "down", *flags]) == 0
    assert "state: idle" in capsys.readouterr().out
    with server.http(KEY) as http:
        r = http.post("/v1/completions", json={"model": "sparky", "prompt": "t1"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_active_model"
    assert r.headers["X-Spark-Active-Profile"] == "none"
    assert main(["inference", "up", "tiny-draft", *flags]) == 0  # a draft comes up by id
    assert "tiny-draft is active as tiny-draft" in capsys.readouterr().out
    assert main(["inference", "bench", "tiny", *flags, "--api-key", KEY, "--max-tokens", "8", "--streams", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "bench tiny:" in out and re.search(r"^ +2 +\d+ms +\d+ms +[\d.]+ +[\d.]+ +16 +0$", out, re.M), out
    assert main(["inference", "usage", *flags]) == 0
    usage = capsys.readouterr().out
    assert re.search(r"^smol-b +\d+ / \d+ / \d+", usage, re.M) and "tiny" in usage
    assert main(["inference", "logs", *flags, "-n", "5"]) == 0
    logs = capsys.readouterr().out
    assert "unloaded" in logs and "/v1/completions" in logs
    assert main(["inference", "up", "gone", *flags]) == 1
    assert "unavailable" in capsys.readouterr().err
    assert main(["inference", "status", "--url", "http://127.0.0.1:9"]) == 2


def test_activity_log_counts_tokens_and_holds_no_secret(server):
    server.slot.usage.flush()
    text = (server.root / "activity.jsonl").read_text()
    for secret in (KEY, ADMIN, "Bearer", "Authorization", KEY[-10:]):
        assert secret not in text
    records = [json.loads(line) for line in text.splitlines()]
    served = [r for r in records if r["status"] == 200 and r["recipe"] == "smol-b"]
    assert served and all(r["prompt_tokens"] > 0 and 0 < r["completion_tokens"] <= 4 for r in served)
    assert {r["key_id"] for r in records} == {records[0]["key_id"]} and records[0]["key_id"].startswith("key-")
    cut = [r for r in records if r["recipe"] == "tiny" and r["outcome"] == "error"]
    assert len(cut) == 8 and all("was unloaded" in r["error"] and r["completion_tokens"] > 0 for r in cut)
    assert any(r["status"] == 503 and r["model"] == "smol-b" for r in records)
    usage = json.loads((server.root / "usage.json").read_text())["recipes"]
    assert usage["smol-b"]["total"][2] == sum(r["completion_tokens"] for r in served)
