"""Anthropic's Messages API through the official ``anthropic`` SDK: the real model for plain text,
a replaying server for tool use, thinking and stop sequences."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.http.conftest import API_KEY, MAX_BODY_BYTES, MAX_MODEL_LEN
from tests.http.replay import ReplayEngine, qwen_like_tokenizer, replay_server, smollm_tokenizer

GREEDY = {"temperature": 0, "top_k": 1, "top_p": 1.0}  # the newest SDKs take these through extra_body only
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
REPLIES = {
    "[call]": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\""}}'
              '\n</tool_call>',
    "[after-tool]": "It is 18C and sunny in Paris.",
    "[stop]": "The answer is 42. STOP and then more words",
    "[think]": "<think>The user wants a number.</think>Seven.",
}


def _client(server, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(**{"base_url": server.url, "api_key": API_KEY, "max_retries": 0, "timeout": 120, **kw})


@pytest.fixture(scope="module")
def real(server):
    with _client(server) as client:
        yield client


@pytest.fixture(scope="module")
def replay_engine():
    return ReplayEngine(qwen_like_tokenizer(), REPLIES)


@pytest.fixture(scope="module")
def replay(replay_engine):
    with replay_server(replay_engine) as running, _client(running) as client:
        client.model_name = running.model
        yield client


def _raw_events(server, body: dict, **headers) -> list[tuple[str, dict]]:
    with server.http() as http, http.stream("POST", "/v1/messages", json={**body, "stream": True},
                                            headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    events, kind = [], None
    for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == kind
            events.append((kind, data))
    return events


def test_create_non_streamed(real, server):
    m = real.messages.create(model=server.model, max_tokens=12, messages=HELLO, extra_body=GREEDY,
                             system="You are terse.", metadata={"user_id": "u1"})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == server.model
    assert m.content[0].type == "text" and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 0 < m.usage.output_tokens <= 12 and m.usage.input_tokens > 10


def test_stream_accumulates_to_the_non_streamed_message(real, server):
    kw = dict(model=server.model, max_tokens=16, messages=HELLO, extra_body=GREEDY)
    whole = real.messages.create(**kw)
    with real.messages.stream(**kw) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert texts and "".join(texts) == final.content[0].text == whole.content[0].text  # merged or not
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    # the second of the two finds the prompt's pages cached: the input is counted apart, not lost
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_raw_event_sequence(server):
    events = _raw_events(server, {"model": server.model, "max_tokens": 8, "messages": HELLO, "temperature": 0},
                         **{"x-api-key": API_KEY})
    kinds = [k for k, _ in events if k != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    body = kinds[1:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    delta = [d for k, d in events if k == "message_delta"][0]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 8
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for k, d in events if k == "content_block_delta")


def test_count_tokens_equals_input_tokens(real, server):
    messages = [{"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    system = [{"type": "text", "text": "Be brief."}]
    counted = real.messages.count_tokens(model=server.model, messages=messages, system=system)
    m = real.messages.create(model=server.model, max_tokens=2, messages=messages, system=system)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 10


def test_count_tokens_counts_a_prompt_too_long_to_answer_as_rendered(real, server):
    """count_tokens generates nothing: it counts the prompt as sent, never compacted, never refused for its length."""
    words = "word " * 150
    turns = [{"role": r, "content": words} for _ in range(3) for r in ("user", "assistant")]
    single = [{"role": "user", "content": words * 4}]
    for messages in (turns + [{"role": "user", "content": "Hi"}], single):
        raw = real.messages.with_raw_response.count_tokens(model=server.model, messages=messages)
        rendered = smollm_tokenizer().encode_chat(messages, add_generation_prompt=True)
        assert raw.parse().input_tokens == len(rendered) > MAX_MODEL_LEN
        assert "X-Spark-Compaction" not in raw.headers and "spark_compaction" not in raw.parse().model_extra


def test_errors_have_anthropic_shape(server):
    with _client(server, api_key="wrong") as bad, pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model=server.model, max_tokens=2, messages=HELLO)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "authentication_error"
    with _client(server) as client:
        with pytest.raises(anthropic.NotFoundError) as info:
            client.messages.create(model="claude-nope", max_tokens=2, messages=HELLO)
        assert info.value.body["error"]["type"] == "not_found_error" and "claude-nope" in info.value.message
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
        with pytest.raises(anthropic.BadRequestError, match="text only") as info:
            client.messages.create(model=server.model, max_tokens=2,
                                   messages=[{"role": "user", "content": [image]}])
        assert info.value.body["error"]["type"] == "invalid_request_error"
    with server.http() as http:
        cases = [(http.post("/v1/messages", content=b"{nope", headers={"Content-Type": "application/json"}), 400),
                 (http.post("/v1/messages", json={"messages": HELLO}), 400),  # max_tokens is required
                 (http.post("/v1/messages", content=b"x" * (MAX_BODY_BYTES + 1)), 413),
                 (http.post("/v1/messages/count_tokens", json={"messages": HELLO}, headers={"Authorization": ""}), 401),
                 (http.get("/v1/messages"), 405)]
        for r, status in cases:
            body = r.json()
            assert r.status_code == status and body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert "max_tokens" in cases[1][0].json()["error"]["message"]
        assert cases[2][0].json()["error"]["type"] == "request_too_large"
        other = http.post("/v1/chat/completions", json={"messages": HELLO, "model": "nope"})
        assert other.status_code == 404 and "type" not in other.json()  # OpenAI's shape elsewhere


def test_tool_use_round_trip(replay, replay_engine):
    ask = [{"role": "user", "content": "Weather in Paris? [call]"}]
    first = replay.messages.create(model=replay.model_name, max_tokens=64, messages=ask, tools=[WEATHER])
    assert first.stop_reason == "tool_use"
    text, call = first.content
    assert text.type == "text" and text.text.startswith("Let me look.")
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": 'Paris, "FR"'}
    assert call.id.startswith("toolu_")
    follow = ask + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": "18C, sunny [after-tool]"}]}]
    second = replay.messages.create(model=replay.model_name, max_tokens=64, messages=follow, tools=[WEATHER])
    assert second.stop_reason == "end_turn" and second.content[0].text == REPLIES["[after-tool]"]
    prompt = replay_engine.prompts[-1]  # the call and its result, rendered by the template
    assert '"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\""}' in prompt
    assert "<tool_response>\n18C, sunny [after-tool]\n</tool_response>" in prompt


def test_streamed_tool_use_sends_partial_json(replay):
    kw = dict(model=replay.model_name, max_tokens=64, tools=[WEATHER],
              messages=[{"role": "user", "content": "Weather? [call]"}])
    with replay.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    fragments = [d.partial_json for d in deltas if d.type == "input_json_delta"]
    assert fragments and json.loads("".join(fragments)) == {"city": 'Paris, "FR"'}
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["text", "tool_use"]
    whole = replay.messages.create(**kw).model_dump()["content"]
    whole[1]["id"] = final.content[1].id  # ids differ per request
    assert final.model_dump()["content"] == whole


def test_tool_choice_any_without_a_call_fails_and_none_hides_tools(replay, replay_engine):
    with pytest.raises(anthropic.UnprocessableEntityError) as info:
        replay.messages.create(model=replay.model_name, max_tokens=32, tools=[WEATHER], tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "Hello [after-tool]"}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    m = replay.messages.create(model=replay.model_name, max_tokens=64, tools=[WEATHER], tool_choice={"type": "none"},
                               messages=[{"role": "user", "content": "Weather? [call]"}])
    assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"]
    assert "<tools>" not in replay_engine.prompts[-1]


def test_stop_sequence_reports_the_match(replay):
    kw = dict(model=replay.model_name, max_tokens=64, messages=[{"role": "user", "content": "Answer [stop]"}],
              stop_sequences=["@@", "STOP"])
    m = replay.messages.create(**kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "STOP"
    assert m.content[0].text == "The answer is 42. "
    with replay.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "STOP"
    assert final.content[0].text == m.content[0].text


def test_thinking_blocks(replay, replay_engine):
    kw = dict(model=replay.model_name, max_tokens=64, messages=[{"role": "user", "content": "Pick one [think]"}],
              thinking={"type": "enabled", "budget_tokens": 32})
    m = replay.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "The user wants a number." and m.content[1].text == "Seven."
    assert replay_engine.params[-1].thinking_budget == 32
    with replay.messages.stream(**kw) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and kinds[-1] == "text_delta"
    assert final.content[0].thinking == m.content[0].thinking and final.content[1].text == "Seven."
    # A thinking block in the history reaches the template as reasoning_content (it may drop it).
    history = [{"role": "user", "content": "Pick one"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "Seven."}]},
        {"role": "user", "content": "Again [after-tool]"}]
    again = replay.messages.create(model=replay.model_name, max_tokens=64, messages=history,
                                   thinking={"type": "disabled"})
    assert again.content[0].text == REPLIES["[after-tool]"] and replay_engine.params[-1].thinking_budget == 0


def test_a_failed_generation_is_an_api_error(replay, replay_engine):
    kw = dict(model=replay.model_name, max_tokens=16, messages=[{"role": "user", "content": "Hi [after-tool]"}])
    replay_engine.fail_if = lambda plan: True
    try:
        with pytest.raises(anthropic.InternalServerError) as info:
            replay.messages.create(**kw)
        with replay.messages.stream(**kw) as stream, pytest.raises(anthropic.APIStatusError) as streamed:
            list(stream)
    finally:
        replay_engine.fail_if = None
    assert info.value.body["error"]["type"] == "api_error" and "generation failed" in info.value.message
    assert "generation failed" in str(streamed.value)
    assert replay.messages.create(**kw).content[0].text == REPLIES["[after-tool]"]  # and the server goes on


def test_a_final_assistant_message_is_a_prefill_the_reply_continues(replay, replay_engine):
    ask = [{"role": "user", "content": "The weather, please. [after-tool]"}]
    opened = replay.messages.create(model=replay.model_name, max_tokens=64, messages=ask)
    prefill = 'Here it is: "'
    reply = replay.messages.create(model=replay.model_name, max_tokens=64,
                                   messages=ask + [{"role": "assistant", "content": prefill}])
    # the prompt is the open answer plus the prefill, not a closed assistant turn and a new one
    assert replay_engine.prompts[-1] == replay_engine.prompts[-2] + prefill
    assert reply.content[0].text == REPLIES["[after-tool]"]  # only the new text, as Anthropic answers
    def prompt_tokens(usage):
        return usage.input_tokens + (usage.cache_read_input_tokens or 0)

    assert prompt_tokens(reply.usage) > prompt_tokens(opened.usage)
    counted = replay.messages.count_tokens(model=replay.model_name, messages=ask + [
        {"role": "assistant", "content": prefill}])
    assert counted.input_tokens == prompt_tokens(reply.usage)
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        replay.messages.create(model=replay.model_name, max_tokens=8,
                               messages=ask + [{"role": "assistant", "content": prefill + " "}])
    empty = replay.messages.create(model=replay.model_name, max_tokens=64,
                                   messages=ask + [{"role": "assistant", "content": ""}])
    assert replay_engine.prompts[-1] == replay_engine.prompts[-3] and empty.content[0].text == opened.content[0].text


def test_an_x_api_key_opens_the_model_list_too(server):
    # Anthropic's clients send x-api-key to /v1/models as to /v1/messages (it was a 401 there)
    import httpx

    with httpx.Client(base_url=server.url) as http:
        assert http.get("/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
        assert http.get("/v1/models", headers={"x-api-key": "sk-wrong"}).status_code == 401
        missing = http.get("/v1/models")
        assert missing.status_code == 401 and "x-api-key" in missing.json()["error"]["message"]


def test_the_model_list_reads_as_anthropics_too(real, server):
    listed = real.models.list()
    assert listed.data and all(m.type == "model" and m.display_name and m.created_at for m in listed.data)
    assert listed.first_id == listed.data[0].id and listed.last_id == listed.data[-1].id and not listed.has_more
    one = real.models.retrieve(server.model)
    assert one.id == server.model and one.display_name and one.created_at.year >= 2026


def test_anthropics_ranges_and_field_names_in_errors(real, server):
    ask = dict(model=server.model, max_tokens=4, messages=HELLO)
    with pytest.raises(anthropic.BadRequestError) as hot:
        real.messages.create(**ask, extra_body={"temperature": 1.5})  # fine for OpenAI, not for Anthropic
    assert hot.value.body["error"]["type"] == "invalid_request_error" and "between 0 and 1" in str(hot.value)
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences must not hold an empty string"):
        real.messages.create(**ask, stop_sequences=["", "x"])
