"""Work that grows with a request's body runs off the event loop when the body is large (issue 27.11):
a 1.4 MB logit_bias held every other request (and /health) for a second. Deterministic, not timed: the
test records where the decoding and the request's preparation ran."""

from __future__ import annotations

import json

import pytest
import trio

from spark.http import anthropic, routes, spine


@pytest.fixture
def where(monkeypatch):
    seen: dict[str, list[bool]] = {}

    def spy(name, fn):
        def recorded(*args, **kw):
            seen.setdefault(name, []).append(trio.lowlevel.in_trio_run())  # False in a worker thread
            return fn(*args, **kw)
        return recorded

    monkeypatch.setattr(spine, "structure_body", spy("structure", spine.structure_body))
    monkeypatch.setattr(routes, "_chat_inputs", spy("chat_inputs", routes._chat_inputs))
    monkeypatch.setattr(anthropic, "turn_kwargs", spy("turn_kwargs", anthropic.turn_kwargs))
    return seen


def _chat(model: str, padding: int) -> bytes:
    bias = {str(i): 0.0 for i in range(padding)}
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                       "logit_bias": bias}).encode()


def test_a_large_body_is_decoded_and_prepared_in_a_worker_thread(server, where):
    body = _chat(server.model, 5000)  # ~60 kB: over the 48 kB bound below, within the test server's 64 kB
    assert len(body) > spine.OFF_LOOP_BYTES * 3 // 4
    with server.http() as http:
        old = spine.OFF_LOOP_BYTES
        spine.OFF_LOOP_BYTES = len(body) - 1
        try:
            r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        finally:
            spine.OFF_LOOP_BYTES = old
        assert r.status_code == 200, r.text
    assert where == {"structure": [False], "chat_inputs": [False]}


def test_a_small_body_is_handled_on_the_loop(server, where):
    with server.http() as http:
        r = http.post("/v1/chat/completions", content=_chat(server.model, 3),
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        m = http.post("/v1/messages/count_tokens", json={"model": server.model, "messages": [
            {"role": "user", "content": "hi"}]})
        assert m.status_code == 200, m.text
    assert where == {"structure": [True, True], "chat_inputs": [True], "turn_kwargs": [True]}
