"""The Responses and Conversations APIs through the official ``openai`` SDK, on a replaying server
with a SQLite store: turns, streams, tools, state across turns and restarts, isolation, SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import typing

import httpx
import openai
import pytest
from openai.types.conversations import Conversation
from openai.types.responses import Response, ResponseStreamEvent

from spark.state import Store, owner_of
from tests.http.replay import replay_server
from tests.http.replay import ReplayEngine, qwen_like_tokenizer

KEY_A, KEY_B = "sk-a", "sk-b"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
REPLIES = {
    "[hello]": "Hello! The sea is calm today.",
    "[second]": "You said hello first.",
    "[third]": "That was the third turn.",
    "[call]": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "[after-tool]": "Paris is 18C and sunny.",
    "[think]": "<think>Short answer.</think>Seven.",
    "[long]": "la " * 3000,
}


@contextlib.contextmanager
def serving(engine, **config):
    """A server for ``engine`` on a free port, in a thread, accepting keys A and B; yields its ``Server``."""
    with replay_server(engine, **{"api_keys": (KEY_A, KEY_B), **config}) as server:
        yield server


def _client(server, key: str = KEY_A) -> openai.OpenAI:
    return server.client(api_key=key)


@pytest.fixture(scope="module")
def engine():
    return ReplayEngine(qwen_like_tokenizer(), REPLIES)


@pytest.fixture(scope="module")
def state_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("state") / "state.sqlite3")


@pytest.fixture(scope="module")
def server(engine, state_path):
    with serving(engine, state_path=state_path) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with _client(server) as c:
        yield c


def _raw_stream(server, body: dict) -> list[dict]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as http, \
            http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]
    return events


def test_create_retrieve_input_items_delete(client):
    r = client.responses.create(model="replay", input="Hi [hello]", instructions="Be kind.", max_output_tokens=32)
    assert r.id.startswith("resp_") and r.status == "completed" and r.output_text == REPLIES["[hello]"]
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens > 5 and r.usage.output_tokens > 3 and r.instructions == "Be kind."
    again = client.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Hi [hello]")]
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_streamed_event_sequence_and_stored_result(server, client):
    events = _raw_stream(server, {"model": "replay", "input": "Hi [hello]"})
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = [k for k in kinds if k == "response.output_text.delta"]
    # One delta or many: tokens that wait for the reader are merged into one piece.
    assert deltas and "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == REPLIES["[hello]"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *deltas, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[0]["response"]["status"] == "in_progress"
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == REPLIES["[hello]"] == events[-4]["text"]
    assert client.responses.retrieve(final["id"]).model_dump(exclude_none=True)["output"] == final["output"]


def test_sdk_streaming(client):
    with client.responses.stream(model="replay", input="Hi [hello]") as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == REPLIES["[hello]"]
    created = [e for e in client.responses.create(model="replay", input="Hi [hello]", stream=True)]
    assert created[0].type == "response.created" and created[-1].type == "response.completed"
    assert client.responses.retrieve(created[0].response.id).status == "completed"


def test_previous_response_id_continues_the_chain(client, engine):
    first = client.responses.create(model="replay", input="Hello there [hello]")
    second = client.responses.create(model="replay", input="What did I say? [second]", previous_response_id=first.id)
    assert second.output_text == REPLIES["[second]"] and second.previous_response_id == first.id
    prompt = engine.prompts[-1]
    assert prompt.index("Hello there [hello]") < prompt.index(REPLIES["[hello]"]) < prompt.index("What did I say?")
    # the second prompt holds the first one's input and output, plus its own input
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    third = client.responses.create(model="replay", input="And now? [third]", previous_response_id=second.id)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert "Hello there" in engine.prompts[-1] and REPLIES["[second]"] in engine.prompts[-1]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="replay", input="x", previous_response_id="resp_missing")


def test_function_call_round_trip(server, client, engine):
    first = client.responses.create(model="replay", input="Weather in Paris? [call]", tools=[WEATHER])
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id and call.id.startswith("fc_")
    second = client.responses.create(
        model="replay", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C [after-tool]"}])
    assert second.output_text == REPLIES["[after-tool]"]
    assert "<tool_response>\n18C [after-tool]\n</tool_response>" in engine.prompts[-1]
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in engine.prompts[-1]
    events = _raw_stream(server, {"model": "replay", "input": "Weather? [call]", "tools": [WEATHER]})
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"]) == {"city": "Paris"} and done["name"] == "get_weather"


def test_reasoning_output_item(client):
    r = client.responses.create(model="replay", input="Pick [think]", reasoning={"effort": "low"})
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Short answer."
    assert message.type == "message" and r.output_text == "Seven."
    # issue 18.5: the reasoning's tokens are counted (it was always 0)
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    with client.responses.stream(model="replay", input="Pick [think]") as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and [o.type for o in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens_details.reasoning_tokens


# Every stream event class of the installed SDK, by its ``type``: validated one by one, an error names its class.
STREAM_EVENTS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
                 for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
SHAPES = [{"input": "Hi [hello]", "instructions": "Be kind.", "metadata": {"k": "v"}},
          {"input": "Pick [think]", "reasoning": {"effort": "low"}},
          {"input": "Weather? [call]", "tools": [WEATHER], "tool_choice": "auto"},
          {"input": "Go [long]", "max_output_tokens": 4, "truncation": "disabled"},  # incomplete
          {"input": "Hi [hello]", "include": ["message.output_text.logprobs"], "top_logprobs": 1}]


@pytest.mark.parametrize("body", SHAPES, ids=["text", "reasoning", "call", "incomplete", "logprobs"])
def test_bodies_and_events_are_the_sdks_types_strictly(server, engine, body):
    body = {"model": "replay", **body}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as http:
        whole = http.post("/v1/responses", json=body).json()
        assert whole["status"] == ("incomplete" if "max_output_tokens" in body else "completed")
        Response.model_validate(whole, strict=True)
        Response.model_validate(http.get(f"/v1/responses/{whole['id']}").json(), strict=True)
    for event in _raw_stream(server, body):
        STREAM_EVENTS[event["type"]].model_validate(event, strict=True)
    engine.fail_if = lambda plan: True
    try:
        failed = _raw_stream(server, body)
    finally:
        engine.fail_if = None
    assert failed[-1]["type"] == "response.failed"
    for event in failed:
        STREAM_EVENTS[event["type"]].model_validate(event, strict=True)


def test_conversation_of_three_turns(client, engine):
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
                                       metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and client.conversations.retrieve(conv.id).metadata == {"topic": "names"}
    answers = []
    for marker in ("[hello]", "[second]", "[third]"):
        r = client.responses.create(model="replay", conversation=conv.id, input=f"Turn {marker}")
        assert r.conversation.id == conv.id
        answers.append(r.output_text)
    assert answers == [REPLIES["[hello]"], REPLIES["[second]"], REPLIES["[third]"]]
    assert all(text in engine.prompts[-1] for text in ("My name is Ada.", "Turn [hello]", REPLIES["[second]"]))
    items = client.conversations.items.list(conv.id, order="asc")
    texts = [i.content[0].text for i in items.data]
    assert texts == ["My name is Ada.", "Turn [hello]", answers[0], "Turn [second]", answers[1], "Turn [third]",
                     answers[2]]
    newest = client.conversations.items.list(conv.id, limit=2)  # desc by default
    assert [i.content[0].text for i in newest.data] == texts[:-3:-1] and newest.has_more
    client.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="replay", conversation=conv.id, input="x")


def test_an_empty_previous_response_or_conversation_id_is_not_found(client):
    # "" is a conversation (or previous response) given, not a turn without one: a 404 from the create,
    # unstored and stored alike, and from the token count (a 500 once, found by test_fuzz).
    for field in ("conversation", "previous_response_id"):
        for create in (dict(store=False), {}):
            with pytest.raises(openai.NotFoundError) as info:
                client.responses.create(model="replay", input="x", **{field: ""}, **create)
            assert info.value.body["param"] == field
        with pytest.raises(openai.NotFoundError):
            client.post("/responses/input_tokens", body={"model": "replay", field: "", "input": "x"},
                        cast_to=object)
    # and both given is refused whatever either holds
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="replay", input="x", previous_response_id="resp_x", conversation="")
    assert "cannot both be given" in info.value.message


def test_conversation_metadata_update(server, client):
    conv = client.conversations.create(metadata={"topic": "names"})
    updated = client.conversations.update(conv.id, metadata={"topic": "weather", "lang": "en"})
    assert isinstance(updated, Conversation) and updated.id == conv.id and updated.created_at == conv.created_at
    assert updated.metadata == {"topic": "weather", "lang": "en"}
    assert client.conversations.retrieve(conv.id).model_dump() == updated.model_dump()
    assert client.conversations.update(conv.id, metadata=None).metadata == {}  # null clears it
    with pytest.raises(openai.NotFoundError) as info:
        client.conversations.update("conv_missing", metadata={})
    assert "conv_missing" in info.value.message and info.value.body["code"] == "not_found"
    with _client(server, KEY_B) as other, pytest.raises(openai.NotFoundError):
        other.conversations.update(conv.id, metadata={"evil": "1"})
    assert client.conversations.retrieve(conv.id).metadata == {}


# OpenAI's bounds: 16 keys, keys of 64 characters, string values of 512
BAD_METADATA = [({f"k{n}": "v" for n in range(17)}, "metadata"), ({"k" * 65: "v"}, "metadata." + "k" * 65),
                ({"k": "v" * 513}, "metadata.k"), ({"k": 1}, "metadata.k")]


@pytest.mark.parametrize("metadata, param", BAD_METADATA, ids=["keys", "key", "value", "not-a-string"])
def test_metadata_out_of_bounds_is_refused(client, metadata, param):
    conv = client.conversations.create(metadata={"kept": "yes"})
    for call in (lambda: client.conversations.create(metadata=metadata),
                 lambda: client.conversations.update(conv.id, metadata=metadata),
                 lambda: client.responses.create(model="replay", input="hi", max_output_tokens=1, metadata=metadata)):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"
    assert client.conversations.retrieve(conv.id).metadata == {"kept": "yes"}
    at_the_bounds = {f"{n:02d}" + "k" * 62: "v" * 512 for n in range(16)}
    assert client.conversations.update(conv.id, metadata=at_the_bounds).metadata == at_the_bounds


def test_conversation_items_retrieve_and_delete(server, client, engine):
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."},
                                              {"type": "message", "role": "user", "content": "Forget me."}])
    first = client.responses.create(model="replay", conversation=conv.id, input="Turn [hello]")
    listed = client.conversations.items.list(conv.id, order="asc").data
    assert [i.content[0].text for i in listed] == ["My name is Ada.", "Forget me.", "Turn [hello]",
                                                   first.output_text]
    for item in listed:
        assert client.conversations.items.retrieve(item.id, conversation_id=conv.id).model_dump() == item.model_dump()
    forget = listed[1]
    assert "Forget me." in engine.prompts[-1]
    deleted = client.conversations.items.delete(forget.id, conversation_id=conv.id)
    assert isinstance(deleted, Conversation) and deleted.id == conv.id  # OpenAI answers the conversation
    assert [i.id for i in client.conversations.items.list(conv.id, order="asc").data] == \
        [listed[0].id, listed[2].id, listed[3].id]
    second = client.responses.create(model="replay", conversation=conv.id, input="Again [second]")
    assert second.output_text == REPLIES["[second]"]
    assert "My name is Ada." in engine.prompts[-1] and "Forget me." not in engine.prompts[-1]
    for call in (lambda: client.conversations.items.retrieve(forget.id, conversation_id=conv.id),
                 lambda: client.conversations.items.delete(forget.id, conversation_id=conv.id)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert forget.id in info.value.message and conv.id not in info.value.message
    for call in (lambda: client.conversations.items.retrieve(listed[0].id, conversation_id="conv_missing"),
                 lambda: client.conversations.items.delete(listed[0].id, conversation_id="conv_missing")):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert "conv_missing" in info.value.message and info.value.body["code"] == "not_found"
    with _client(server, KEY_B) as other:
        for call in (lambda: other.conversations.items.retrieve(listed[0].id, conversation_id=conv.id),
                     lambda: other.conversations.items.delete(listed[0].id, conversation_id=conv.id)):
            with pytest.raises(openai.NotFoundError):
                call()
    assert client.conversations.items.retrieve(listed[0].id, conversation_id=conv.id).id == listed[0].id


def test_a_failed_generation_is_streamed_and_stored_as_failed(server, client, engine):
    engine.fail_if = lambda plan: True
    try:
        events = _raw_stream(server, {"model": "replay", "input": "Hi [hello]"})
        with pytest.raises(openai.InternalServerError):
            client.responses.create(model="replay", input="Hi [hello]")
    finally:
        engine.fail_if = None
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = client.responses.retrieve(events[0]["response"]["id"])
    assert failed.status == "failed" and "generation failed" in failed.error.message


def test_a_client_that_hangs_up_leaves_a_cancelled_response(server, client, engine):
    # Paced so the 3000 tokens take 30 s: unpaced, a busy machine replayed them all before the
    # server heard the hang-up, and the response ended "incomplete" (CI, stop 46).
    engine.step_seconds = 0.01
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as http, \
                http.stream("POST", "/v1/responses", json={"model": "replay", "input": "Go [long]", "stream": True,
                                                          "max_output_tokens": 3000}) as r:
            created = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
        rid = created["response"]["id"]
        assert client.responses.retrieve(rid).status in ("in_progress", "cancelled")  # stored before we heard of it
        deadline = time.monotonic() + 10
        while client.responses.retrieve(rid).status != "cancelled" and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        engine.step_seconds = 0.0
    assert client.responses.retrieve(rid).status == "cancelled"


def test_store_false_is_not_kept(client):
    r = client.responses.create(model="replay", input="Hi [hello]", store=False)
    assert r.output_text == REPLIES["[hello]"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_keys_are_isolated(server, client):
    r = client.responses.create(model="replay", input="Secret [hello]")
    conv = client.conversations.create()
    with _client(server, KEY_B) as other:
        for call in (lambda: other.responses.retrieve(r.id), lambda: other.responses.delete(r.id),
                     lambda: other.responses.input_items.list(r.id), lambda: other.conversations.retrieve(conv.id),
                     lambda: other.conversations.items.list(conv.id), lambda: other.conversations.delete(conv.id),
                     lambda: other.responses.create(model="replay", input="x", previous_response_id=r.id),
                     lambda: other.responses.create(model="replay", input="x", conversation=conv.id)):
            with pytest.raises(openai.NotFoundError):
                call()
    assert client.responses.retrieve(r.id).id == r.id and client.conversations.retrieve(conv.id).id == conv.id


def test_bad_requests(client):
    with pytest.raises(openai.BadRequestError, match="text only"):
        client.responses.create(model="replay", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/x.png"}]}])
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="replay", input=[{"type": "function_call_output", "output": "x"}])
    assert info.value.body["param"] == "input[0].call_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")


def _refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value


def test_items_that_do_not_fit_their_history_are_refused(client, engine):
    """An output answering no call, and an item id sent twice, are 400s naming the item, as OpenAI's; the
    stored state is left as it was."""
    fresh = _refused(lambda: client.responses.create(model="replay", input=[
        {"type": "function_call_output", "call_id": "call_nowhere", "output": "18C"}]))
    assert fresh.body["param"] == "input[0].call_id" and "call_nowhere" in fresh.message
    paired = client.responses.create(model="replay", tools=[WEATHER], input=[
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "18C [after-tool]"}])
    assert paired.output_text == REPLIES["[after-tool]"]  # the call in the same input answers it
    first = client.responses.create(model="replay", input="Weather? [call]", tools=[WEATHER])
    wrong = _refused(lambda: client.responses.create(
        model="replay", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": first.output[0].call_id + "x", "output": "18C"}]))
    assert wrong.body["param"] == "input[0].call_id"
    resent = _refused(lambda: client.responses.create(
        model="replay", previous_response_id=first.id, tools=[WEATHER],
        input=[first.output[0].model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "18C"}]))
    assert resent.body["param"] == "input[0].id" and first.output[0].id in resent.message
    assert "history" in resent.message
    twice = _refused(lambda: client.responses.create(model="replay", input=[
        {"type": "message", "role": "user", "content": "a", "id": "msg_mine"},
        {"type": "message", "role": "user", "content": "b", "id": "msg_mine"}]))
    assert twice.body["param"] == "input[1].id" and "earlier item of this request" in twice.message

    assert _refused(lambda: client.conversations.create(items=[
        {"type": "message", "role": "user", "content": "a", "id": "msg_1"},
        {"type": "message", "role": "user", "content": "b", "id": "msg_1"}])).body["param"] == "items[1].id"
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "a", "id": "msg_1"}])
    for items, param in (([{"type": "message", "role": "user", "content": "again", "id": "msg_1"}], "items[0].id"),
                         ([{"type": "function_call_output", "call_id": "c9", "output": "x"}], "items[0].call_id")):
        assert _refused(lambda: client.conversations.items.create(conv.id, items=items)).body["param"] == param
    assert [i.id for i in client.conversations.items.list(conv.id).data] == ["msg_1"]  # nothing was added
    client.conversations.items.create(conv.id, items=[
        {"type": "function_call", "call_id": "c9", "name": "get_weather", "arguments": "{}"}])
    client.conversations.items.create(conv.id, items=[{"type": "function_call_output", "call_id": "c9", "output": "x"}])
    assert len(client.conversations.items.list(conv.id).data) == 3
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.create("conv_missing", items=[{"type": "message", "role": "user", "content": "a"}])


def test_a_turn_that_leaves_a_call_unanswered_is_refused(client, engine):
    """Each call of the turn being continued, and each call sent, needs its output in the input: a 400
    naming the call, as OpenAI's "No tool output found"; calls before the last user message are not judged."""
    first = client.responses.create(model="replay", input="Weather? [call]", tools=[WEATHER])
    (call,) = first.output
    prompts = len(engine.prompts)
    moved_on = _refused(lambda: client.responses.create(model="replay", previous_response_id=first.id,
                                                        tools=[WEATHER], input="Never mind. [hello]"))
    assert moved_on.body["param"] == "input" and call.call_id in moved_on.message and "get_weather" in moved_on.message
    assert len(engine.prompts) == prompts  # refused before anything reached the engine
    c1 = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    c2 = {**c1, "call_id": "c2"}
    one_of_two = _refused(lambda: client.responses.create(model="replay", tools=[WEATHER], input=[
        c1, c2, {"type": "function_call_output", "call_id": "c1", "output": "18C [after-tool]"}]))
    assert one_of_two.body["param"] == "input[1]" and "'c2'" in one_of_two.message
    answered = client.responses.create(model="replay", previous_response_id=first.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C [after-tool]"}])
    assert answered.output_text == REPLIES["[after-tool]"]
    cut = client.responses.create(model="replay", input="Weather? [call]", tools=[WEATHER], max_output_tokens=20)
    assert cut.status == "incomplete" and [(i.type, i.status) for i in cut.output] == [("function_call", "incomplete")]
    after_cut = client.responses.create(model="replay", previous_response_id=cut.id, input="Again. [hello]")
    assert after_cut.output_text == REPLIES["[hello]"]  # a call cut off cannot be run: nothing to answer

    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Weather?"}])
    client.conversations.items.create(conv.id, items=[{**c1, "call_id": "c7"}])  # adding a call alone is fine
    pending = _refused(lambda: client.responses.create(model="replay", conversation=conv.id, input="[hello]"))
    assert pending.body["param"] == "input" and "'c7'" in pending.message
    client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "Skip it."}])
    later = client.responses.create(model="replay", conversation=conv.id, input="[hello]")  # c7 is before a user turn
    assert later.output_text == REPLIES["[hello]"]


def test_lists_check_their_include_values(client):
    r = client.responses.create(model="replay", input="Hi [hello]", conversation=client.conversations.create().id)
    assert len(client.conversations.items.list(r.conversation.id, include=["message.output_text.logprobs"]).data) == 2
    typo = _refused(lambda: client.conversations.items.list(r.conversation.id, include=["message.output_text.logprob"]))
    assert typo.body["param"] == "include[0]" and "message.output_text.logprob'" in typo.message
    assert _refused(lambda: client.responses.input_items.list(r.id, include=["nope"])).body["param"] == "include[0]"


def test_logprobs_are_computed_only_when_included(client, engine):
    r = client.responses.create(model="replay", input="Hi [hello]", include=["message.output_text.logprobs"],
                                top_logprobs=1)
    assert engine.params[-1].logprobs == 1
    logprobs = r.output[0].content[0].logprobs
    assert "".join(lp.token for lp in logprobs) == r.output_text == REPLIES["[hello]"]
    # stored with the text, and shown by a retrieve that includes them, as a create's include does
    assert client.responses.retrieve(r.id, include=["message.output_text.logprobs"]).output[0].content[0].logprobs \
        == logprobs
    assert client.responses.retrieve(r.id).output[0].content[0].logprobs == []
    assert client.responses.retrieve(r.id).output_text == r.output_text
    bad = _refused(lambda: client.responses.retrieve(r.id, include=["message.output_text.logprob"]))
    assert bad.body["param"] == "include[0]"
    plain = client.responses.create(model="replay", input="Hi [hello]", top_logprobs=5)
    assert engine.params[-1].logprobs is None and plain.output[0].content[0].logprobs == []
    # the other values OpenAI defines name items Spark never makes: accepted, they add nothing
    client.responses.create(model="replay", input="Hi [hello]",
                            include=["reasoning.encrypted_content", "file_search_call.results"])
    assert engine.params[-1].logprobs is None
    call = client.responses.create(model="replay", input="Weather? [call]", tools=[WEATHER],
                                   include=["message.output_text.logprobs"])
    assert [o.type for o in call.output] == ["function_call"]  # a call's tokens are no output text's
    for _ in range(3):  # pieces merge or not, as the reader keeps up: the reasoning's tokens never join the text
        think = client.responses.create(model="replay", input="Pick [think]", reasoning={"effort": "low"},
                                        include=["message.output_text.logprobs"])
        assert "".join(lp.token for lp in think.output[1].content[0].logprobs) == think.output_text == "Seven."


BAD_LOGPROBS = [({"top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": -1}, "top_logprobs"),
                ({"include": ["message.output_text.logprobs"], "top_logprobs": 99}, "top_logprobs"),
                ({"include": ["message.output_text.logprobs", "nope"]}, "include[1]")]  # a value OpenAI lacks too


@pytest.mark.parametrize("body, param", BAD_LOGPROBS, ids=["21", "-1", "99-included", "unknown-include"])
def test_bad_logprobs_requests(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="replay", input="Hi [hello]", **body)
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"


def test_a_restart_keeps_what_was_stored(state_path, server):
    # Each server gets an engine of its own, as a restarted process would: one engine's KV pages
    # shared by two servers' prefix caches would hold one server's tokens where the other's cache
    # says its own are (the module's server maps them after this test).
    with serving(ReplayEngine(qwen_like_tokenizer(), REPLIES), state_path=state_path) as first, _client(first) as c:
        r = c.responses.create(model="replay", input="Remember me [hello]")
        conv = c.conversations.create(items=[{"role": "user", "content": "kept"}])
    with serving(ReplayEngine(qwen_like_tokenizer(), REPLIES), state_path=state_path) as second, _client(second) as c:
        assert c.responses.retrieve(r.id).output_text == REPLIES["[hello]"]
        assert c.conversations.items.list(conv.id).data[0].content[0].text == "kept"
        follow = c.responses.create(model="replay", input="Again [second]", previous_response_id=r.id)
        assert follow.output_text == REPLIES["[second]"]


def test_sigkill_loses_no_acknowledged_response(tmp_path):
    path = str(tmp_path / "state.sqlite3")
    env = {**os.environ, "SPARK_MODEL": "dummy:tiny-llama", "SPARK_PORT": "0", "SPARK_DEVICE": "cpu",
           "SPARK_STATE_PATH": path, "SPARK_API_KEYS": KEY_A, "SPARK_MAX_MODEL_LEN": "256",
           "SPARK_KV_CACHE_BYTES": str(16 << 20), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "spark.http.serve"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        url = re.search(r"on (http://\S+)", line)
        assert url, line + proc.stdout.read(2000)
        acknowledged: list[str] = []
        stop = threading.Event()

        def hammer(streamed: bool) -> None:
            with openai.OpenAI(base_url=url[1] + "/v1", api_key=KEY_A, max_retries=0, timeout=30) as c:
                while not stop.is_set():
                    try:
                        if streamed:
                            for event in c.responses.create(model="sparky", input="t5 t6", max_output_tokens=16,
                                                            stream=True):
                                acknowledged.append(event.response.id)  # response.created carries the id
                                break
                        else:
                            acknowledged.append(c.responses.create(model="sparky", input="t1 t2",
                                                                   max_output_tokens=4).id)
                    except (openai.APIConnectionError, openai.APIStatusError, httpx.HTTPError):
                        return

        threads = [threading.Thread(target=hammer, args=(i % 2 == 0,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(acknowledged) < 16 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # mid-traffic: requests in flight, commits under way
        proc.wait(timeout=10)
        stop.set()
        for t in threads:
            t.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    assert len(acknowledged) >= 16
    store = Store(path)
    missing = [rid for rid in acknowledged if store.get_response(owner_of(KEY_A), rid) is None]
    store.close()
    assert not missing


def test_input_tokens_counts_what_a_create_would_send(client):
    body = {"model": "replay", "input": "Hi [hello]", "instructions": "Be kind.", "tools": [WEATHER]}
    counted = client.responses.input_tokens.count(**body)
    assert counted.object == "response.input_tokens"
    first = client.responses.create(**body)
    assert counted.input_tokens == first.usage.input_tokens > 20
    follow = {**body, "input": "More [second]", "previous_response_id": first.id}
    assert client.responses.input_tokens.count(**follow).input_tokens == \
        client.responses.create(**follow).usage.input_tokens > counted.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model="replay", input="x", previous_response_id="resp_missing")
    call = client.responses.create(model="replay", input="Weather? [call]", tools=[WEATHER])
    refused = _refused(lambda: client.responses.input_tokens.count(model="replay", input="Hm. [hello]",
                                                                    previous_response_id=call.id))
    assert refused.body["param"] == "input" and call.output[0].call_id in refused.message
