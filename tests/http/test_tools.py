"""Tool calls through chat completions: a real server replaying scripted model output, the official SDK."""

from __future__ import annotations

import json

import attrs
import openai
import pytest

from spark.http.turn import ChatFormat, chat_format, prepare_turn, template_messages
from spark.serve_config import ServeConfig
from tests.http.replay import ReplayEngine, qwen_like_tokenizer, replay_server, smollm_tokenizer


def _tool(name: str, **props) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": {"type": "object", "properties": props}}}


TOOLS = [_tool("get_weather", city={"type": "string"}, days={"type": "integer"}, metric={"type": "boolean"}),
         _tool("search", query={"type": "string"}, limit={"type": "integer"})]

HERMES_TWO = ('Let me check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
              '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome, \\"Italy\\""}}\n'
              '</tool_call>')
WANT_TWO = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": 'Rome, "Italy"'})]
REPLIES = {
    "[two-calls]": HERMES_TWO,
    "[no-call]": "I can answer that without tools: it is sunny.",
    "[search-call]": '<tool_call>\n{"name": "search", "arguments": {"query": "umbrella"}}\n</tool_call>',
    "[unknown-call]": '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
    "[after-tool]": "Paris is 18C and sunny.",
}
QWEN3_CODER = ("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
               "<parameter=days>\n5\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n</function>\n</tool_call>")
MINIMAX = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n'
           '<parameter name="days">2</parameter>\n<parameter name="metric">true</parameter>\n</invoke>\n'
           '<invoke name="search">\n<parameter name="query">fjords</parameter>\n<parameter name="limit">7</parameter>\n'
           '</invoke>\n</minimax:tool_call>')


@pytest.fixture(scope="module")
def engine():
    return ReplayEngine(qwen_like_tokenizer(), REPLIES)


@pytest.fixture(scope="module")
def server(engine):
    with replay_server(engine) as running:  # tool parser "auto": hermes, detected from the template
        yield running


def _ask(marker: str, **kw) -> dict:
    return {"model": "replay", "messages": [{"role": "user", "content": f"What's the weather? {marker}"}],
            "tools": TOOLS, **kw}


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def _stream_raw(server, body: dict) -> list[dict | str]:
    """The SSE data of a streamed request: parsed JSON objects, and "[DONE]"."""
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_streamed_hermes_calls_accumulate_like_the_non_streamed_ones(server):
    client = server.client()
    with client.chat.completions.stream(**_ask("[two-calls]")) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check both cities.\n"
    assert _calls(choice.message.tool_calls) == WANT_TWO
    # The wire shape: per call, a first delta with index, id, type and name, then argument fragments only
    # (hermes sends a call's arguments whole, when its block closes).
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    for index, call in enumerate(choice.message.tool_calls):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].id == call.id and mine[0].type == "function" and mine[0].function.name == "get_weather"
        assert all(d.id is None and d.function.name is None for d in mine[1:])
        assert "".join(d.function.arguments for d in mine) == call.function.arguments
    assert len({d.id for d in deltas if d.id}) == 2
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    # The text before the calls streams (in one piece or several: waiting tokens are merged).
    assert content and "".join(content) == choice.message.content

    whole = client.chat.completions.create(**_ask("[two-calls]"))
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.content == choice.message.content
    assert _calls(whole.choices[0].message.tool_calls) == _calls(choice.message.tool_calls)
    assert whole.usage.completion_tokens == len(qwen_like_tokenizer().encode(HERMES_TWO)) + 1  # + EOS


def test_tools_reach_the_template_and_a_plain_reply_stops(server, engine):
    r = server.client().chat.completions.create(**_ask("[no-call]"))
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == REPLIES["[no-call]"]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in engine.prompts[-1]


def test_tool_choice_none_hides_the_tools_and_parses_no_calls(server, engine):
    r = server.client().chat.completions.create(**_ask("[two-calls]", tool_choice="none"))
    assert "<tools>" not in engine.prompts[-1]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == HERMES_TWO


def test_required_tool_choice_without_a_call_is_an_error(server):
    client = server.client()
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(**_ask("[no-call]", tool_choice="required"))
    assert info.value.code == "tool_choice_not_satisfied"
    events = _stream_raw(server, _ask("[no-call]", tool_choice="required"))
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "tool_choice_not_satisfied"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
    # no content it then disowns (issue 18.7): the reply's text never went out before the error
    assert not any(e["choices"][0]["delta"].get("content") for e in events[:-2])
    with pytest.raises(openai.APIError, match="tool_choice"):  # the SDK raises on the error event
        for _ in client.chat.completions.create(**_ask("[no-call]", tool_choice="required"), stream=True):
            pass
    with pytest.raises(openai.UnprocessableEntityError):  # a call to a tool that was not offered
        client.chat.completions.create(**_ask("[unknown-call]", tool_choice="required"))
    r = client.chat.completions.create(**_ask("[two-calls]", tool_choice="required"))
    assert _calls(r.choices[0].message.tool_calls) == WANT_TWO


def test_named_tool_choice(server):
    client = server.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(**_ask("[two-calls]", tool_choice=named))
    assert r.choices[0].finish_reason == "tool_calls" and _calls(r.choices[0].message.tool_calls) == WANT_TWO
    other = {"type": "function", "function": {"name": "search"}}
    with pytest.raises(openai.UnprocessableEntityError, match="'search'.*'get_weather'"):
        client.chat.completions.create(**_ask("[two-calls]", tool_choice=other))
    events = _stream_raw(server, _ask("[two-calls]", tool_choice=other))
    assert events[-2]["error"]["code"] == "tool_choice_not_satisfied"
    assert not any(e["choices"][0]["delta"].get("tool_calls") for e in events[:-2])  # the wrong call never went out


def test_parallel_tool_calls_false_keeps_the_first_call(server):
    client = server.client()
    r = client.chat.completions.create(**_ask("[two-calls]", parallel_tool_calls=False))
    assert _calls(r.choices[0].message.tool_calls) == WANT_TWO[:1]
    with client.chat.completions.stream(**_ask("[two-calls]", parallel_tool_calls=False)) as stream:
        final = stream.get_final_completion()
    assert _calls(final.choices[0].message.tool_calls) == WANT_TWO[:1]
    assert final.choices[0].finish_reason == "tool_calls"


def test_n2_gives_each_choice_its_own_calls(server):
    r = server.client().chat.completions.create(**_ask("[two-calls]", n=2))
    first, second = (c.message.tool_calls for c in r.choices)
    assert _calls(first) == _calls(second) == WANT_TWO
    assert len({c.id for c in first + second}) == 4


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "user", "content": "Thanks! Summarize. [after-tool]"},
]
RENDERED_HISTORY = ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                    '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n')


def test_history_with_calls_and_results_renders_and_is_accepted(server, engine):
    r = server.client().chat.completions.create(model="replay", messages=HISTORY, tools=TOOLS)
    assert r.choices[0].message.content == "Paris is 18C and sunny." and r.choices[0].finish_reason == "stop"
    prompt = engine.prompts[-1]
    assert RENDERED_HISTORY in prompt and prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")


def test_arguments_strings_become_mappings_for_the_template():
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}},
             {"id": "c", "type": "function", "function": {"name": "h", "arguments": ""}}]
    out = template_messages([{"role": "assistant", "content": None, "tool_calls": calls},
                             {"role": "tool", "tool_call_id": "b", "content": "r"}])
    assert [c["function"]["arguments"] for c in out[0]["tool_calls"]] == [{"x": [1, 2]}, "not json", {}]
    assert out[1]["name"] == "g" and calls[0]["function"]["arguments"] == '{"x": [1, 2]}'  # input untouched
    turn = prepare_turn(qwen_like_tokenizer(), ChatFormat("hermes", False), HISTORY, tools=TOOLS)
    assert RENDERED_HISTORY in turn.prompt.text


@pytest.mark.parametrize("body, status, param", [
    ({"tools": [{"type": "retrieval"}]}, 400, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, 400, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, 400, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, 400, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]},
     400, "messages[0].tool_calls[0].function.name"),
])
def test_bad_tool_requests_name_the_field(server, body, status, param):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == status and r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("parser, reply, want_content, want", ids=["qwen3_coder", "minimax"], argvalues=[
    ("qwen3_coder", QWEN3_CODER, "I'll check.\n", [("get_weather", {"city": "New York", "days": 5, "metric": False})]),
    ("minimax", MINIMAX, None, [("get_weather", {"city": "Oslo", "days": 2, "metric": True}),
                                ("search", {"query": "fjords", "limit": 7})]),
])
def test_xml_formats_give_typed_arguments(parser, reply, want_content, want):
    # A step per token, so that the stream is read as it is made (a reader that falls behind gets
    # the merged pieces, and the arguments in one fragment).
    engine = ReplayEngine(qwen_like_tokenizer(), {"[call]": reply}, step_seconds=0.02)
    with replay_server(engine, tool_call_parser=parser) as server:
        client = server.client()
        r = client.chat.completions.create(**_ask("[call]"))
        with client.chat.completions.stream(**_ask("[call]")) as stream:
            stream_events = list(stream)
            streamed = stream.get_final_completion()
    for choice in (r.choices[0], streamed.choices[0]):
        assert choice.finish_reason == "tool_calls" and _calls(choice.message.tool_calls) == want
        assert (choice.message.content or None) == want_content
    fragments = [e for e in stream_events if e.type == "tool_calls.function.arguments.delta"]
    assert len(fragments) > len(want)  # XML formats stream a call's arguments parameter by parameter


def test_server_parser_setting():
    tok = qwen_like_tokenizer()
    assert chat_format(ServeConfig(), tok).tool_parser == "hermes"
    assert chat_format(ServeConfig(tool_call_parser="minimax"), tok).tool_parser == "minimax"
    plain = chat_format(ServeConfig(refusal_filter=False, citations=False), smollm_tokenizer())
    # SmolLM2's template shows no tools: Spark writes them in hermes' format, and reads calls in it; no <think>
    assert plain == ChatFormat("hermes", False, tool_prompt=True)
    assert not chat_format(ServeConfig(tool_call_parser="none"), smollm_tokenizer()).tool_prompt  # parsing off
    off = chat_format(ServeConfig(tool_call_parser="none"), tok)
    assert off.tool_parser is None
    parser = prepare_turn(tok, off, [{"role": "user", "content": "x"}], tools=TOOLS).parser()
    parser.feed(HERMES_TWO)
    parser.flush()
    assert parser.finish().tool_calls == () and parser.finish().content == HERMES_TWO


def test_raw_message_shape(server):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json=_ask("[two-calls]"))
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "Let me check both cities.\n" and message["reasoning_content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [a for _, a in WANT_TWO]


async def test_run_turn_streams_events_and_collect_gives_the_same_done():
    """The API the other chat APIs build on, without HTTP: ``prepare_turn`` + ``run_turn``."""
    from spark.actors.messages import GenerateRequest
    from spark.actors.system import open_system
    from spark.engine.sampling import SamplingParams
    from spark.http.turn import ContentDelta, ToolCallDelta, ToolChoice, TurnDone, run_turn

    tok = qwen_like_tokenizer()
    engine = ReplayEngine(tok, REPLIES)
    async with open_system(engine, ServeConfig(device="cpu")) as system:
        turn = prepare_turn(tok, chat_format(system.config, tok), _ask("[two-calls]")["messages"], tools=TOOLS,
                            tool_choice=ToolChoice("required"))
        request = GenerateRequest("t-0", turn.prompt.prompt_ids, turn.sampling(SamplingParams(max_tokens=200)))
        async with run_turn(system, request, turn.parser(id_prefix="call_t")) as events:
            got = [event async for event in events]
        *deltas, done = got
        assert isinstance(done, TurnDone) and done.finish_reason == "tool_calls" and done.error is None
        assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == done.result.content
        assert [d.id for d in deltas if isinstance(d, ToolCallDelta)] == ["call_t00000000", "call_t00000001"]
        assert [(c.name, c.arguments) for c in done.result.tool_calls] == WANT_TWO
        assert done.usage.prompt_tokens == len(turn.prompt.prompt_ids) and done.usage.completion_tokens > 20

        again = await run_turn(system, attrs.evolve(request, request_id="t-1"), turn.parser(id_prefix="call_t")).collect()
        assert again.result == done.result and again.finish_reason == "tool_calls"

        cut = attrs.evolve(request, request_id="t-2", params=attrs.evolve(request.params, max_tokens=5))
        short = await run_turn(system, cut, turn.parser()).collect()  # no call yet, but cut off: not a violation
        assert short.finish_reason == "length" and short.error is None and short.usage.completion_tokens == 5
        assert short.result.content == tok.decode(tok.encode(HERMES_TWO)[:5])


def test_a_streamed_required_call_never_sends_the_content_it_disowns():
    """Issue 18.7: a token a step, so the reply streams as it is made; under tool_choice "required"
    a reply with no call used to send its content deltas and then the error."""
    engine = ReplayEngine(qwen_like_tokenizer(), REPLIES, step_seconds=0.01)
    with replay_server(engine) as server:
        events = _stream_raw(server, _ask("[no-call]", tool_choice="required"))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "tool_choice_not_satisfied"
        assert not any(e["choices"][0]["delta"].get("content") for e in events[:-2])
        plain = _stream_raw(server, _ask("[no-call]"))  # under "auto" the same reply streams as content
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in plain[:-1] if e["choices"]) \
            == REPLIES["[no-call]"]
