"""Structured output (issue 21): the decoding follows the request's JSON schema or forced tool call,
whatever the model would have written (the default model on the CPU, sampling at temperature 0.7)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.grammar_cases import PERSON
from tests.http.conftest import API_KEY

TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": params}}
         for name, desc, params in (
    ("get_tide", "High and low tide at a port", {"type": "object", "properties": {
        "port": {"type": "string"}, "day": {"type": "integer", "minimum": 1, "maximum": 31}}, "required": ["port"]}),
    ("book_berth", "Book a berth for a ship", {"type": "object", "properties": {
        "ship": {"type": "string"}, "hours": {"type": "integer", "minimum": 1, "maximum": 72}},
        "required": ["ship", "hours"]}),
    ("weather", "The weather at sea", {"type": "object", "properties": {"area": {"type": "string"}},
                                      "required": ["area"]}))]
ASK = [{"role": "user", "content": "Describe one harbour worker."}]


def test_a_json_schema_answer_parses_and_validates(server):
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        answer = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=120, temperature=0.7,
                                                seed=seed, response_format=fmt)
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    obj = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=80, temperature=0.7, seed=7,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_a_required_tool_call_streams_as_tool_calls_from_its_first_delta(server):
    client = server.client()
    stream = client.chat.completions.create(model=server.model, messages=[
        {"role": "user", "content": "I need a berth for the Aurora for 10 hours."}], tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0.7, seed=3, stream=True)
    chunks = [c for c in stream if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    first = next(d for d in deltas if d.content or d.tool_calls)
    assert first.tool_calls and not any(d.content for d in deltas)  # one call, then the end: nothing else
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    name = "".join(tc.function.name or "" for d in deltas for tc in d.tool_calls or () if tc.index == 0)
    arguments = "".join(tc.function.arguments or "" for d in deltas for tc in d.tool_calls or () if tc.index == 0)
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
    jsonschema.validate(json.loads(arguments), schema)


def test_a_named_tool_and_anthropics_tool_choice_are_forced(server):
    client = server.client()
    answer = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi!"}], tools=TOOLS, max_tokens=120,
        temperature=0.7, seed=2, tool_choice={"type": "function", "function": {"name": "weather"}},
        parallel_tool_calls=False)
    call = answer.choices[0].message.tool_calls[0]
    assert call.function.name == "weather" and answer.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[2]["function"]["parameters"])
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0) as claude:
        message = claude.messages.create(model=server.model, max_tokens=120, tools=tools,
                                         tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0},
                                         messages=[{"role": "user", "content": "Good morning."}])
        use = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and use
        jsonschema.validate(use[0].input, {t["name"]: t["input_schema"] for t in tools}[use[0].name])


def test_a_responses_text_format_is_followed(server):
    client = server.client()
    # Greedy (the Responses API takes no seed: at 0.7 a string sometimes ran out max_output_tokens), with room:
    # the default model spends 119 tokens here, blank lines between the JSON tokens included.
    response = client.responses.create(model=server.model, input="Describe one harbour worker.", store=False,
                                       max_output_tokens=256, temperature=0, text={"format": {
                                           "type": "json_schema", "name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(response.output_text), PERSON)


def test_a_schema_that_cannot_compile_is_a_400_naming_it(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=server.model, messages=ASK, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                           "maximum": 1}}})
    assert refused.value.body["param"] == "response_format" and "minimum greater than maximum" in str(refused.value)


def test_a_tool_without_parameters_is_called_with_an_object(server):
    # OpenAI takes a function without parameters as one called with no arguments; before, the forced
    # call's grammar let the model write any JSON there, and the parser dropped the non-object: a 422.
    client = server.client()
    for i, ping in enumerate(({"name": "ping"}, {"name": "ping", "parameters": None})):
        answer = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Ping the server."}], max_tokens=60,
            temperature=0.7, seed=i, tools=[{"type": "function", "function": ping}], parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "ping"}})
        call = answer.choices[0].message.tool_calls[0]
        assert call.function.name == "ping" and isinstance(json.loads(call.function.arguments), dict)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=server.model, messages=ASK, max_tokens=4, tools=[
            {"type": "function", "function": {"name": "ping", "parameters": {"type": "array"}}}])
    assert refused.value.body["param"] == "tools[0].function.parameters.type"
