"""Bad requests get a 4xx in OpenAI's error shape, and the server stays healthy."""

from __future__ import annotations

import json

import openai
import pytest

from tests.http.conftest import MAX_BODY_BYTES, MAX_MODEL_LEN

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def _chat(**fields):
    return {"messages": MSGS, "max_tokens": 2, **fields}


# (path, body (dict, or raw bytes), status, param the error names)
BAD = [
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, b'"a string"', 400, None),
    (CHAT, b"\xff\xfe", 400, None),
    (CHAT, {"max_tokens": 2}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CHAT, _chat(temperature="hot"), 400, "temperature"),
    (CHAT, _chat(temperature=-1), 400, "temperature"),
    (CHAT, _chat(top_p=0), 400, "top_p"),
    (CHAT, _chat(top_p=1.5), 400, "top_p"),
    (CHAT, _chat(top_k=-2), 400, "top_k"),
    (CHAT, _chat(min_p=2), 400, "min_p"),
    (CHAT, _chat(presence_penalty=3), 400, "presence_penalty"),
    (CHAT, _chat(frequency_penalty=-2.5), 400, "frequency_penalty"),
    (CHAT, _chat(repetition_penalty=0), 400, "repetition_penalty"),
    (CHAT, _chat(max_tokens=0), 400, "max_tokens"),
    (CHAT, _chat(max_tokens=1.5), 400, "max_tokens"),
    (CHAT, _chat(max_tokens=True), 400, "max_tokens"),
    (CHAT, _chat(max_completion_tokens=-3), 400, "max_tokens"),
    (CHAT, _chat(n=0), 400, "n"),
    (CHAT, _chat(n=17), 400, "n"),
    (CHAT, _chat(stop=["x"] * 17), 400, "stop"),
    (CHAT, _chat(stop=[""]), 400, "stop"),
    (CHAT, _chat(stop=5), 400, "stop"),
    (CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (CHAT, _chat(top_logprobs=2), 400, "top_logprobs"),
    (CHAT, _chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    (CHAT, _chat(logit_bias={"99999999": 1}), 400, "logit_bias"),
    (CHAT, _chat(logit_bias={"5": "a"}), 400, "logit_bias['5']"),
    (CHAT, _chat(seed="x"), 400, "seed"),
    (CHAT, _chat(stream="yes"), 400, "stream"),
    (CHAT, _chat(stream_options={"include_usage": "y"}), 400, "stream_options.include_usage"),
    (CHAT, _chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    (CHAT, _chat(chat_template_kwargs={"add_generation_prompt": False}), 400, "chat_template_kwargs"),
    (CHAT, _chat(model="gpt-4o"), 404, "model"),
    (COMPLETIONS, {"max_tokens": 2}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, 10**9]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [-1]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "echo": "yes"}, 400, "echo"),  # (echo true was refused, issue 25)
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": list(range(1, MAX_MODEL_LEN + 1))}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_openai_error(server, path, body, status, param):
    with server.http() as http:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = http.post(path, json=body)
        assert r.status_code == status, r.text
        assert r.headers["content-type"].startswith("application/json")
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        assert error["param"] == param
        assert http.get("/health").status_code == 200


def test_context_length_error_names_both_numbers(server):
    with server.http() as http:
        r = http.post(COMPLETIONS, json={"prompt": [1] * (MAX_MODEL_LEN + 3), "max_tokens": 2})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN + 3) in error["message"] and str(MAX_MODEL_LEN) in error["message"]


def test_unknown_route_and_wrong_method_are_json(server):
    with server.http() as http:
        for method, path, status in [("GET", "/v1/nope", 404), ("GET", "/nope", 404), ("GET", CHAT, 405),
                                     ("DELETE", "/health", 405)]:
            r = http.request(method, path)
            assert r.status_code == status and r.json()["error"]["message"], (method, path)


def test_body_over_the_limit_is_413(server):
    big = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
    with server.http() as http:
        r = http.post(COMPLETIONS, content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        chunked = http.post(COMPLETIONS, content=iter([big[:1000], big[1000:]]),
                            headers={"Content-Type": "application/json"})
        assert chunked.status_code == 413
        assert http.get("/health").status_code == 200


def test_api_key_is_required_on_v1_only(server):
    with server.http(auth=False) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
            r = http.post(CHAT, json=_chat(), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models").status_code == 401
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
    with server.client(api_key="sk-wrong") as wrong, pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_sdk_raises_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=MSGS, max_tokens=2, temperature=-1)
    assert info.value.body["param"] == "temperature"
