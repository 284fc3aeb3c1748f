"""Key isolation beyond ``test_responses.test_keys_are_isolated``: another key's calls are 404s that say no
more than an id that exists nowhere (appending items included), leave the owner's bodies byte for byte,
and no key reaches the logs, the SQLite file, the activity log or the usage file."""

from __future__ import annotations

import io
import logging
import threading

import httpx
import pytest

from tests.http.replay import ReplayEngine, qwen_like_tokenizer, replay_server

KEY_A, KEY_B, KEY_W = "sk-iso-a-5f0c2e9b17d84a6e", "sk-iso-b-93ad41c7e0b25f68", "sk-iso-w-c48e7a1d6b3f902e"
MISSING_RESPONSE, MISSING_CONVERSATION = "resp_" + "0" * 32, "conv_" + "0" * 32


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A replaying server with keys A and B and every file it writes in one directory, its logs captured at
    DEBUG; yields ``(url, directory, log)``: the files and the log are complete once the module's tests ran."""
    directory = tmp_path_factory.mktemp("isolation")
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    handler.addFilter(lambda record: record.thread != threading.main_thread().ident)  # the server's, not the test's
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        with replay_server(ReplayEngine(qwen_like_tokenizer(), {}), api_keys=(KEY_A, KEY_B),
                           state_path=str(directory / "state.sqlite3"),
                           activity_log_path=str(directory / "activity.jsonl"),
                           usage_path=str(directory / "usage.json")) as server:
            yield server.url, directory, log
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def _store_as_a(a: httpx.Client) -> tuple[str, str]:
    rid = a.post("/v1/responses", json={"model": "replay", "input": "A's note"}).raise_for_status().json()["id"]
    cid = a.post("/v1/conversations", json={"items": [{"role": "user", "content": "A's"}]}).raise_for_status().json()["id"]
    a.post(f"/v1/conversations/{cid}/items", json={"items": [{"role": "assistant", "content": "ok"}]}).raise_for_status()
    return rid, cid


def _bodies(a: httpx.Client, rid: str, cid: str) -> list[bytes]:
    return [a.get(path).content for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items",
                                             f"/v1/conversations/{cid}", f"/v1/conversations/{cid}/items")]


def test_another_key_gets_the_404_of_an_id_that_exists_nowhere(served):
    url, _, _ = served
    with _client(url, KEY_A) as a, _client(url, KEY_B) as b:
        rid, cid = _store_as_a(a)
        before = _bodies(a, rid, cid)
        calls = [("GET", "/v1/responses/{r}", None), ("GET", "/v1/responses/{r}/input_items", None),
                 ("POST", "/v1/responses", {"model": "replay", "input": "x", "previous_response_id": "{r}"}),
                 ("POST", "/v1/responses", {"model": "replay", "input": "x", "previous_response_id": "{r}",
                                            "stream": True}),
                 ("POST", "/v1/responses", {"model": "replay", "input": "x", "conversation": "{c}"}),
                 ("GET", "/v1/conversations/{c}", None), ("GET", "/v1/conversations/{c}/items", None),
                 ("POST", "/v1/conversations/{c}/items", {"items": [{"role": "user", "content": "B's"}]}),
                 ("DELETE", "/v1/responses/{r}", None), ("DELETE", "/v1/conversations/{c}", None)]
        for method, path, body in calls:
            answers = []
            for r, c in ((rid, cid), (MISSING_RESPONSE, MISSING_CONVERSATION)):
                fill = {"{r}": r, "{c}": c}
                sent = None if body is None else {k: fill.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
                got = b.request(method, path.format(r=r, c=c), json=sent)
                answers.append((got.status_code, got.text.replace(r, "ID").replace(c, "ID")))
            assert answers[0] == answers[1] and answers[0][0] == 404, (method, path, answers)
        assert _bodies(a, rid, cid) == before


def test_no_key_is_written_anywhere(served):
    url, directory, log = served
    with _client(url, KEY_A) as a, _client(url, KEY_B) as b, _client(url, KEY_W) as w:
        _store_as_a(a)
        for client in (a, b, w):
            client.post("/v1/chat/completions", json={"model": "replay", "messages": [{"role": "user", "content": "hi"}]})
            client.post("/v1/messages", headers={"x-api-key": client.headers["Authorization"][7:]},
                        json={"model": "replay", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert w.get("/v1/models").status_code == 401
    files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    assert {"state.sqlite3", "activity.jsonl"} <= set(files) and log.getvalue()
    for key in (KEY_A, KEY_B, KEY_W):
        for name, data in [*files.items(), ("the log", log.getvalue().encode())]:
            assert key.encode() not in data and key[-16:].encode() not in data, (key, name)
