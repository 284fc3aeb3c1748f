"""Background responses (``background: true``) through the official ``openai`` SDK, on a replaying
server whose steps are paced: answered at once, polled, streamed and resumed after a hang-up,
cancelled, and stopped with the server."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import trio

from spark.http import background
from spark.state import Store, owner_of
from tests.http.replay import ReplayEngine, qwen_like_tokenizer, replay_server

KEY_A, KEY_B = "sk-a", "sk-b"
STEP_S = 0.01
REPLIES = {
    "[count]": " ".join(f"n{i}" for i in range(120)),  # ~1.5 s of paced steps
    "[long]": "la " * 3000,  # 30 s: only ever cancelled
    "[hello]": "Hello! The sea is calm today.",
}


@pytest.fixture(scope="module")
def engine():
    return ReplayEngine(qwen_like_tokenizer(), REPLIES, step_seconds=STEP_S)


@pytest.fixture(scope="module")
def state_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("state") / "state.sqlite3")


@pytest.fixture(scope="module")
def server(engine, state_path):
    with replay_server(engine, api_keys=(KEY_A, KEY_B), state_path=state_path) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with server.client(api_key=KEY_A) as c:
        yield c


def _until_done(client, rid: str, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while (r := client.responses.retrieve(rid)).status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
    return r


def _refused(call, error=openai.BadRequestError):
    with pytest.raises(error) as info:
        call()
    return info.value


def test_a_background_response_answers_at_once_and_generates_on(client, engine):
    r = client.responses.create(model="replay", input="Count [count]", background=True)
    assert r.status == "in_progress" and r.background is True and r.output == []  # answered before any output
    done = _until_done(client, r.id)
    assert done.status == "completed" and done.output_text == REPLIES["[count]"] and done.background is True
    assert done.usage.output_tokens > 100
    # it continues like any other response
    after = client.responses.create(model="replay", input="Hi [hello]", previous_response_id=r.id)
    assert after.output_text == REPLIES["[hello]"] and REPLIES["[count]"] in engine.prompts[-1]


def test_a_background_response_needs_store(client):
    refused = _refused(lambda: client.responses.create(model="replay", input="x", background=True, store=False))
    assert refused.body["param"] == "background"


def test_cancel(server, client):
    r = client.responses.create(model="replay", input="Go [long]", background=True)
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.id == r.id
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == "cancelled"  # again: answered as it is
    with server.client(api_key=KEY_B) as other:
        _refused(lambda: other.responses.cancel(r.id), openai.NotFoundError)
    _refused(lambda: client.responses.cancel("resp_missing"), openai.NotFoundError)
    foreground = client.responses.create(model="replay", input="Hi [hello]")
    assert "background" in _refused(lambda: client.responses.cancel(foreground.id)).message
    finished = client.responses.create(model="replay", input="Hi [hello]", background=True)
    assert _until_done(client, finished.id).status == "completed"
    assert client.responses.cancel(finished.id).status == "completed"  # too late to cancel: as it is
    # deleting a live one cancels it first, so that its end does not bring it back
    live = client.responses.create(model="replay", input="Go [long]", background=True)
    client.responses.delete(live.id)
    time.sleep(0.3)
    _refused(lambda: client.responses.retrieve(live.id), openai.NotFoundError)


def _events(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_a_background_stream_survives_a_hang_up_and_resumes(server, client):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as http, \
            http.stream("POST", "/v1/responses", json={"model": "replay", "input": "Count [count]",
                                                      "stream": True, "background": True}) as r:
        lines = r.iter_lines()
        first = []
        for line in lines:
            if line.startswith("data: "):
                first.append(json.loads(line[6:]))
            if sum(e["type"] == "response.output_text.delta" for e in first) == 3:
                break  # and hang up
    rid = first[0]["response"]["id"]
    assert first[0]["type"] == "response.created" and first[0]["response"]["background"] is True
    assert [e["sequence_number"] for e in first] == list(range(len(first)))
    done = _until_done(client, rid)
    assert done.status == "completed" and done.output_text == REPLIES["[count]"]  # generated on without us

    resumed = list(client.responses.retrieve(rid, stream=True, starting_after=first[-1]["sequence_number"]))
    assert [e.sequence_number for e in resumed] == list(range(len(first), len(first) + len(resumed)))
    assert resumed[-1].type == "response.completed" and resumed[-1].response.output_text == REPLIES["[count]"]
    text = "".join(e["delta"] for e in first if e["type"] == "response.output_text.delta") + \
        "".join(e.delta for e in resumed if e.type == "response.output_text.delta")
    assert text == REPLIES["[count]"]
    whole = list(client.responses.retrieve(rid, stream=True))  # from the start
    assert whole[0].type == "response.created" and len(whole) == len(first) + len(resumed)

    foreground = client.responses.create(model="replay", input="Hi [hello]")
    refused = _refused(lambda: list(client.responses.retrieve(foreground.id, stream=True)))
    assert refused.body["param"] == "stream" and "background" in refused.message
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_A}"}) as http:
        bad = http.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"


def test_a_stopping_server_ends_its_background_responses(tmp_path):
    path = str(tmp_path / "state.sqlite3")
    engine = ReplayEngine(qwen_like_tokenizer(), REPLIES, step_seconds=STEP_S)
    activity = tmp_path / "activity.jsonl"
    with replay_server(engine, api_keys=(KEY_A,), state_path=path, activity_log_path=str(activity)) as server:
        with server.client(api_key=KEY_A) as client:
            finished = client.responses.create(model="replay", input="Hi [hello]", background=True)
            done = _until_done(client, finished.id)
            assert done.status == "completed"  # and kept a while for resumption
            # its activity line is written when it ends, with its tokens (not when the create answered)
            (line,) = [json.loads(line) for line in activity.read_text().splitlines()]
            assert line["endpoint"] == "/v1/responses" and line["outcome"] == "ok"
            assert line["completion_tokens"] == done.usage.output_tokens > 0
            live = client.responses.create(model="replay", input="Go [long]", background=True)
            time.sleep(0.2)
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 8  # neither the live run nor a kept one holds the server up
    store = Store(path)
    try:
        ended = store.get_response(owner_of(KEY_A), live.id)
        assert ended["status"] == "failed" and "shutting down" in ended["error"]["message"]
        assert store.get_response(owner_of(KEY_A), finished.id)["status"] == "completed"
    finally:
        store.close()


# -- the registry alone (spark.http.background), on trio -----------------------------------------


async def _counting(n: int, step_s: float = 0.0):
    for i in range(n):
        await trio.sleep(step_s)
        yield {"type": "tick", "i": i}


async def test_runs_follow_cancel_and_forget_the_oldest_past_the_budget(monkeypatch):
    monkeypatch.setattr(background, "MAX_KEPT_EVENTS", 5)
    ended: list[tuple[str, str]] = []
    async with trio.open_nursery() as nursery:
        runs = background.BackgroundRuns(nursery)
        for rid in ("r1", "r2", "r3"):
            run = background.BackgroundRun("me")
            runs.start(rid, run, _counting(3), lambda outcome, rid=rid: ended.append((rid, outcome)))
            assert [e["sequence_number"] for e in [e async for e in run.follow(after=0)]] == [1, 2]
        assert runs.get("me", "r3") is run and runs.get("someone", "r3") is None
        assert runs.get("me", "r1") is None and runs.get("me", "r2") is None  # 3 + 3 events > 5: the oldest go

        slow = background.BackgroundRun("me")
        runs.start("r4", slow, _counting(1000, 0.01), lambda outcome: ended.append(("r4", outcome)))
        await trio.sleep(0.05)
        await slow.cancel()
        assert slow.done and 0 < len(slow.events) < 1000
        await runs.close()  # ends the kept runs' retention: the nursery closes at once
    assert ended == [("r1", "ok"), ("r2", "ok"), ("r3", "ok"), ("r4", "cancelled")]
