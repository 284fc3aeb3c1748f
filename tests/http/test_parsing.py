"""Request parsing, validation and response formatting, without a server."""

from __future__ import annotations

import json

import pytest

from spark.actors.messages import TokenLogprob
from spark.http import formatting as fmt
from spark.http.errors import ApiError
from spark.http.params import Limits, base_params, build_job, chat_messages, logprobs_k
from spark.http.schemas import ChatRequest, CompletionRequest, parse_body

LIMITS = Limits(served_name="m", max_model_len=100, vocab_size=1000, default_max_tokens=50)


def _parse(cls=ChatRequest, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}]) if cls is ChatRequest else None
    return parse_body(json.dumps(body).encode(), cls)


def _error(fn, *args, **kw) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kw)
    return info.value


def test_types_are_checked_not_coerced():
    e = _error(_parse, temperature="0.5")
    assert e.message == "invalid value for type, expected float @ $.temperature" and e.param == "temperature"
    assert _error(_parse, n=1.5).param == "n"
    assert _error(_parse, stream=1).param == "stream"
    assert _error(_parse, messages="hi").param == "messages"  # not iterated into characters
    assert _error(_parse, messages=[{"role": "user", "content": "x"}], stop=["a", 3]).param == "stop[1]"
    assert _parse(temperature=1).temperature == 1.0 and _parse(unknown_field={"x": 1}).n is None


def test_prompt_shapes():
    prompts = [("x", ("x",)), ([1, 2], ((1, 2),)), ([[1], [2, 3]], ((1,), (2, 3))), (["a", "b"], ("a", "b"))]
    for given, want in prompts:
        assert _parse(CompletionRequest, prompt=given).prompt == want
    for bad in ([], [1, "a"], [True], [[]], 5):
        assert _error(_parse, CompletionRequest, prompt=bad).param == "prompt"


def test_messages_are_normalized():
    req = _parse(messages=[{"role": "developer", "content": "be brief"},
                           {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                           {"role": "assistant", "content": None}])
    assert chat_messages(req) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                                  {"role": "assistant", "content": ""}]
    assert _error(chat_messages, _parse(messages=[{"role": "robot", "content": "x"}])).param == "messages[0].role"
    assert _error(chat_messages, _parse(messages=[{"role": "tool", "content": "x"}])).param == "messages[0].tool_call_id"


def test_sampling_errors_name_their_field():
    assert _error(base_params, _parse(top_p=0), LIMITS, max_tokens=None, logprobs=None).param == "top_p"
    assert _error(base_params, _parse(), LIMITS, max_tokens=0, logprobs=None).param == "max_tokens"
    assert _error(logprobs_k, _parse(top_logprobs=3)).param == "top_logprobs"
    assert logprobs_k(_parse(logprobs=True)) == 0 and logprobs_k(_parse(logprobs=True, top_logprobs=5)) == 5
    assert logprobs_k(_parse(CompletionRequest, prompt="x", logprobs=2)) == 2


def test_build_job_caps_max_tokens_and_seeds_choices():
    req = _parse(n=3, seed=10, stop="END")
    params = base_params(req, LIMITS, max_tokens=None, logprobs=None)
    job = build_job("chatcmpl-x", req, [list(range(90))], params, LIMITS, api_key="k")
    assert [r.request_id for r in job.requests] == ["chatcmpl-x-0", "chatcmpl-x-1", "chatcmpl-x-2"]
    assert [r.params.seed for r in job.requests] == [10, 11, 12]
    assert {r.params.max_tokens for r in job.requests} == {10}  # 100 - 90, below the default 50
    assert job.requests[0].stop == ("END",) and job.requests[0].api_key == "k" and job.prompt_tokens == 90
    e = _error(build_job, "x", req, [list(range(100))], params, LIMITS, api_key=None)
    assert e.code == "context_length_exceeded" and "100" in e.message


def test_error_body_and_retry_after():
    e = ApiError(429, "slow down", code="rate_limit_exceeded", retry_after=0.2)
    assert e.body() == {"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                  "code": "rate_limit_exceeded"}}
    assert e.response().headers["Retry-After"] == "1"
    assert ApiError(503, "busy", retry_after=2.5).response().headers["Retry-After"] == "3"


def test_logprob_shapes():
    lps = [TokenLogprob(5, "He", -0.1, ((5, "He", -0.1), (6, "\\xe2", -2.0))), TokenLogprob(7, "llo", -0.5, ())]
    chat = fmt.chat_logprobs(lps)["content"]
    assert chat[0]["bytes"] == [72, 101] and chat[0]["top_logprobs"][1]["bytes"] == [0xE2]
    legacy = fmt.completion_logprobs(lps, fmt.TextOffsets(3))
    assert legacy == {"tokens": ["He", "llo"], "token_logprobs": [-0.1, -0.5],
                      "top_logprobs": [{"He": -0.1, "\\xe2": -2.0}, {"llo": -0.5}], "text_offset": [3, 5]}
    offsets = fmt.TextOffsets()  # "a😀b ST|OP": the emoji's two byte tokens at its character, a text cut at 4
    emoji = offsets.take(["a", "\\xf0\\x9f", "\\x98\\x80"])
    assert emoji + offsets.take(["b", " ST", "OP"], end=4) == [0, 1, 1, 2, 3, 4]
    assert fmt.sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
