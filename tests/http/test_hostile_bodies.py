"""Bodies no later stage can take get one 400 in their API's shape (issue 27.1-5): nested past any API's
depth, integers past Python's digit limit, lone UTF-16 surrogates in any string; the server serves on."""

from __future__ import annotations

import pytest

DEEP = b"[" * 5000 + b"]" * 5000
CHAT = '{"model": "%s", "messages": [{"role": "user", "content": %s}], "max_tokens": 2}'


def bodies(model: str):
    nested = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "metadata": %s}' % (
        model, "[" * 3000 + "]" * 3000)
    return [
        ("/v1/chat/completions", DEEP, None),
        ("/v1/chat/completions", nested.encode(), None),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", None),
        ("/v1/chat/completions", (CHAT % (model, '"\\ud800"')).encode(), "messages[0].content"),
        ("/v1/completions", b'{"prompt": "a\\udfffb", "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions", (CHAT % ("\\ud800", '"hi"')).encode(), "model"),
        ("/v1/messages", b'{"model": "m", "max_tokens": 2, "system": "\\ud800", "messages": []}', "system"),
        ("/v1/responses", b'{"input": "hi", "metadata": {"k": "\\udc00"}}', "metadata.k"),
        ("/v1/responses", b'{"input": "hi", "instructions": "\\ud83d"}', "instructions"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_hostile_bodies_get_a_400_in_the_apis_shape(server, case):
    path, body, param = bodies(server.model)[case]
    with server.http() as http:
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        payload = r.json()
        if path == "/v1/messages":
            assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
        else:
            assert payload["error"]["code"] == "invalid_json" and payload["error"]["message"]
            assert payload["error"]["param"] == param
        assert "Traceback" not in r.text
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/responses", {"input": [{"role": {"x": 1}, "content": "hi"}]}, "input[0].role"),
    ("/v1/responses", {"input": [{"role": ["user"], "content": "hi"}]}, "input[0].role"),
    ("/v1/responses", {"input": ["hi"]}, "input[0]"),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi", "id": {"a": 1}}]}, "input[0].id"),
    ("/v1/conversations", {"items": [{"role": 7, "content": "hi"}]}, "items[0].role"),
    ("/v1/conversations", {"items": [{"role": "user", "content": "hi", "id": [1]}]}, "items[0].id"),
])
def test_wrong_typed_roles_and_ids_are_a_400(server, path, body, param):
    """Issue 27.6-7: a non-string role was a TypeError, a non-scalar id a SQLite error (500)."""
    with server.http() as http:
        r = http.post(path, json=body)
        assert r.status_code == 400, (r.status_code, r.text[:300])
        assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("raw,needle", [
    (b'{"prompt": "hi", "max_tokens": 1, "metadata": {"a": NaN}}', "NaN is not a JSON number"),
    (b'{"input": "hi", "metadata": {"a": Infinity}}', "Infinity is not a JSON number"),
    (b'{"prompt": "hi", "temperature": 1e999}', "out of range"),
])
def test_numbers_json_has_not_are_refused(server, raw, needle):
    # Python's json takes NaN and Infinity; a stored body holding one was a 500 from SQLite's index.
    path = "/v1/responses" if b'"input"' in raw else "/v1/completions"
    with server.http() as http:
        r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text[:300]


def test_an_integer_past_the_largest_float_in_a_number_field_says_so(server):
    with server.http() as http:
        r = http.post("/v1/completions", content=b'{"prompt": "hi", "temperature": ' + b"9" * 400 + b"}",
                      headers={"Content-Type": "application/json"})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "temperature" and "too large" in error["message"], r.text
