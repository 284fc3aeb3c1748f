"""Property-based fuzz of every route, from /openapi.json (issue 18, "correct under bad input").

Valid, mutated and hostile bodies (``tests/http/fuzzing.py``) through the real server: never a
5xx, every 4xx in its API's error shape, no traceback in any body, and the server serves on.
Sized for CI: tiny generations, a few hundred requests; ``scripts/fuzz.py`` is the larger run.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.http import fuzzing
from tests.http.conftest import API_KEY

ROUNDS = 20  # of one request per route each


@pytest.fixture(scope="module")
def doc(server):
    with server.http(auth=False) as http:
        return http.get("/openapi.json").json()


@pytest.fixture(scope="module")
def http(server):
    with server.http(auth=False) as client:
        yield client


@pytest.fixture(scope="module")
def fuzzer(server, doc, http):
    """A fuzzer that also draws the ids of a real conversation, its item and a real stored response."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    cid = http.post("/v1/conversations", json={"items": [{"role": "user", "content": "hi"}]}, headers=auth).json()["id"]
    item = http.get(f"/v1/conversations/{cid}/items", headers=auth).json()["data"][0]["id"]
    rid = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1}, headers=auth)
    ids = {"cid": [cid], "item_id": [item], "rid": [rid.json()["id"]], "name": [server.model, "sparky"]}
    return fuzzing.Fuzzer(doc, ids=ids, api_key=API_KEY)


def send(http: httpx.Client, call: fuzzing.Call) -> list[str]:
    """Send ``call``; what is wrong with its answer (empty: nothing)."""
    r = http.request(call.method, call.path, content=call.body, headers=dict(call.headers))
    return [f"{call.method} {call.path} {call.body[:200] if call.body else b''!r}: {p}"
            for p in fuzzing.problems(call, r.status_code, r.content)]


def _post(http, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"Authorization": f"Bearer {API_KEY}",
                                                  "Content-Type": "application/json"})


def test_generated_requests_to_every_route(http, fuzzer, caplog):
    @settings(max_examples=ROUNDS, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(calls=fuzzer.rounds())
    def answered_well(calls):
        assert [p for call in calls for p in send(http, call)] == []

    answered_well()
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]  # a stream's failure is logged, not sent
    assert not logged, [r.getMessage() for r in logged]


def _body_operations(doc) -> list[str]:
    return [name for name, op in fuzzing.operations(doc).items() if fuzzing.body_of(op) is not None]


def test_deep_nesting_and_huge_integers_on_every_route(http, doc, fuzzer):
    for name in _body_operations(doc):
        path = name.split(" ", 1)[1].replace("{cid}", fuzzer.ids["cid"][0])
        seed = fuzzing.SEEDS[name][0]
        field = next(iter(seed), None)
        bodies = [fuzzing.DEEP.encode(), b'{"x": %s}' % fuzzing.DEEP.encode(),
                  b'{"x": %s}' % fuzzing.HUGE_INT.encode(), fuzzing.HUGE_INT.encode()]
        if field is not None:
            bodies += [fuzzing.with_raw(seed, (field,), raw) for raw in (fuzzing.DEEP, fuzzing.HUGE_INT)]
        for body in bodies:
            r = _post(http, path, body)
            problems = fuzzing.problems(fuzzing.Call(name, "hostile", "POST", path, body), r.status_code, r.content)
            assert r.status_code in (400, 403) and not problems, (name, body[:80], r.status_code, r.text[:300])


def test_a_lone_surrogate_in_every_string_of_every_seed(http, doc, fuzzer):
    for name in _body_operations(doc):
        path = name.split(" ", 1)[1].replace("{cid}", fuzzer.ids["cid"][0])
        for seed in fuzzing.SEEDS[name]:
            for where, body in fuzzing.surrogate_bodies(seed):
                r = _post(http, path, body)
                assert not fuzzing.problems(fuzzing.Call(name, "hostile", "POST", path, body), r.status_code,
                                            r.content), (name, where, r.text[:300])
                assert r.status_code == (403 if name in fuzzing.DANGEROUS else 400), (name, where, r.text[:300])


WRONG = [7, 1.5, True, None, ["user"], {"x": 1}]


@pytest.mark.parametrize("value", WRONG, ids=[json.dumps(v) for v in WRONG])
def test_non_string_roles_and_ids_of_input_items(http, fuzzer, value):
    cid = fuzzer.ids["cid"][0]
    for field in ("role", "id"):
        if field == "id" and value is None:
            continue  # no id: the server makes one
        item = {"role": "user", "content": "hi", field: value}
        for path, body, param in [("/v1/responses", {"input": [item], "max_output_tokens": 1}, "input[0]"),
                                  ("/v1/conversations", {"items": [item]}, "items[0]"),
                                  (f"/v1/conversations/{cid}/items", {"items": [item]}, "items[0]")]:
            r = _post(http, path, json.dumps(body).encode())
            assert r.status_code == 400, (path, body, r.text[:300])
            assert r.json()["error"]["param"] == f"{param}.{field}", r.text[:300]


HI = [{"role": "user", "content": "hi"}]
FOUND = [  # 500s the fuzz found (a TypeError, an AttributeError, a ValueError), each a 400 naming the field now
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1, "reasoning": {"effort": ["low"]}}, "reasoning.effort"),
    ("/v1/responses", {"input": [{"type": "reasoning", "summary": ["x"]}, *HI], "max_output_tokens": 1},
     "input[0].summary[0]"),
    ("/v1/responses", {"input": [{"type": "reasoning", "content": {"a": 1}}, *HI], "max_output_tokens": 1},
     "input[0].content"),
    ("/v1/responses", {"input": [{"type": "reasoning", "content": [{"text": 5}]},
                                 {"role": "assistant", "content": "x"}]}, "input[0].content[0]"),
    ("/v1/conversations", {"items": [{"type": "reasoning", "summary": 5}]}, "items[0].summary"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 1, "logit_bias": {"²": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 1, "logit_bias": {"1" * 5000: 1}}, "logit_bias"),
]


@pytest.mark.parametrize("path, body, param", FOUND, ids=[f"{p} {param}" for p, _, param in FOUND])
def test_what_the_fuzz_found_is_a_400(http, path, body, param):
    r = _post(http, path, json.dumps(body).encode())
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("n", ["²", "٣", "0", "", "-1"])
def test_admin_logs_refuses_what_is_not_a_positive_integer(http, n):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = http.get("/api/inference/logs", params={"n": n}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text[:300]
    assert http.get("/api/inference/logs", params={"n": "9" * 5000}, headers=auth).status_code == 200  # 1000 lines


# NaN and Infinity, which Python's json takes, were stored and then unreadable by the store's index: a 500.
@pytest.mark.parametrize("raw", fuzzing.NOT_JSON)
def test_nan_in_a_stored_body_is_a_400(http, raw):
    r = _post(http, "/v1/responses", b'{"input": "hi", "max_output_tokens": 1, "metadata": {"a": %s}}' % raw.encode())
    assert r.status_code == 400, r.text[:300]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_a_body_past_the_limit_is_a_413_in_its_apis_shape(http, path):
    body = json.dumps({"messages": [{"role": "user", "content": "x" * (70 << 10)}], "max_tokens": 1}).encode()
    r = _post(http, path, body)
    assert r.status_code == 413 and fuzzing.error_shape_problem(path, 413, r.content) is None, r.text[:300]


EARLY = [(b"POST /v1/nope", 404), (b"POST /health", 405), (b"PATCH /v1/chat/completions", 405),
         (b"DELETE /v1/messages", 405), (b"PUT /openapi.json", 405), (b"POST /api/inference/nope", 404)]


@pytest.mark.parametrize("line, status", EARLY, ids=[e[0].decode() for e in EARLY])
def test_keep_alive_after_an_early_answer(server, line, status):
    """Headers, their answer, then the body and GET /health on the same connection: either the answer
    said ``Connection: close`` and the socket closes, or /health is answered."""
    body = b'{"model": "m", "messages": []}'
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
        sock.sendall(line + b" HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + API_KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        head, answer = fuzzing.read_answer(sock)
        assert head.startswith(b"HTTP/1.1 %d" % status), head
        problem = fuzzing.error_shape_problem(line.split(b" ")[1].decode(), status, answer)
        assert problem is None, problem
        time.sleep(0.05)
        try:
            sock.sendall(body + b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            assert b"connection: close" in head.lower()
            return
        if b"connection: close" in head.lower():
            assert fuzzing.closes(sock), "said Connection: close, but the socket stayed open"
        else:
            health, _ = fuzzing.read_answer(sock)
            assert health.startswith(b"HTTP/1.1 200"), health


def test_the_server_serves_on_after_the_fuzz(server, http):
    assert http.get("/health").status_code == 200
    r = server.client().chat.completions.create(model=server.model, max_tokens=2,
                                                messages=[{"role": "user", "content": "Say hi"}])
    assert r.choices[0].finish_reason in ("stop", "length")
