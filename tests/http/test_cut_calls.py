"""A tool call cut off by the token limit, through each chat API and its official SDK, in each
tool-call format: its markup never comes back as text. A call whose name was whole comes back,
with its arguments as far as they went (finish "length", stop_reason max_tokens, a function_call
item with status "incomplete"); one whose name was not, not at all. Reasoning cut off stays reasoning.

The replaying engine writes a reply that stops inside a call, and max_tokens ends it right there.
"""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.http.conftest import API_KEY
from tests.http.replay import ReplayEngine, qwen_like_tokenizer, replay_server

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": CITY}}


def _case(cut: str, content: str, calls: list, inputs: list, name_cut: str, name_cut_content: str) -> dict:
    """A reply cut in a call's arguments and one cut in a call's name, with what each API gives back:
    ``calls`` as OpenAI's (name, arguments string), ``inputs`` as Anthropic's tool_use input."""
    return {"[cut]": cut, "[name-cut]": name_cut, "content": content, "calls": calls, "inputs": inputs,
            "name_cut_content": name_cut_content}


FORMATS = {
    # One whole call, then a second cut in its arguments: OpenAI carries the cut JSON text, Anthropic {}.
    "hermes": _case('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro',
                    "Let me look.\n", [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Ro')],
                    [{"city": "Paris"}, {}],
                    'Let me look.\n<tool_call>\n{"name": "get_wea', "Let me look.\n"),
    # XML formats build the arguments parameter by parameter: a cut value is the value so far.
    "qwen3_coder": _case("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew Yo",
                         "I'll check.\n", [("get_weather", '{"city": "New Yo"}')], [{"city": "New Yo"}],
                         "I'll check.\n<tool_call>\n<function=get_wea", "I'll check.\n"),
    "minimax": _case('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n'
                     '<parameter name="da', "", [("get_weather", '{"city": "Oslo"}')], [{"city": "Oslo"}],
                     'Checking.\n<minimax:tool_call>\n<invoke name="get_we', "Checking.\n"),
}
THINK_CUT = "<think>\nThe user wants the weather in Paris, so I will call get_weather with"


def _tokens(reply: str) -> int:
    """The max_tokens that ends a reply by length right at its last token (before the EOS it would write)."""
    return len(qwen_like_tokenizer().encode(reply))


@pytest.fixture(scope="module", params=list(FORMATS))
def fmt(request):
    """(its case, a server replaying the case's replies with that tool-call parser)."""
    case = FORMATS[request.param]
    engine = ReplayEngine(qwen_like_tokenizer(), {"[cut]": case["[cut]"], "[name-cut]": case["[name-cut]"],
                                                  "[think-cut]": THINK_CUT})
    with replay_server(engine, tool_call_parser=request.param) as server:
        yield case, server


def _chat(client, marker: str, reply: str, **kw) -> tuple[str, list, str]:
    r = client.chat.completions.create(model="replay", messages=[{"role": "user", "content": f"Weather? {marker}"}],
                                       max_tokens=_tokens(reply), **kw)
    message = r.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    return message.content or "", calls, r.choices[0].finish_reason


def _chat_streamed(client, marker: str, reply: str, **kw) -> tuple[str, list, str]:
    # By hand: the SDK's stream helper refuses a "length" finish when tools were given.
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(
            model="replay", messages=[{"role": "user", "content": f"Weather? {marker}"}], max_tokens=_tokens(reply),
            stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or ():
                call = calls.setdefault(tc.index, [tc.function.name, ""])
                call[1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("read", [_chat, _chat_streamed], ids=["whole", "streamed"])
def test_chat_completions(fmt, read):
    case, server = fmt
    client = server.client()
    got = read(client, "[cut]", case["[cut]"], tools=[TOOL], tool_choice="required")
    assert got == (case["content"], case["calls"], "length")
    got = read(client, "[name-cut]", case["[name-cut]"], tools=[TOOL], tool_choice="required")
    assert got == (case["name_cut_content"], [], "length")
    got = read(client, "[cut]", case["[cut]"], tools=[TOOL])  # "auto": the same
    assert got == (case["content"], case["calls"], "length")


def test_chat_reasoning_cut_stays_reasoning(fmt):
    _, server = fmt
    r = server.client().chat.completions.create(
        model="replay", messages=[{"role": "user", "content": "Weather? [think-cut]"}], max_tokens=_tokens(THINK_CUT))
    message = r.model_dump()["choices"][0]["message"]
    assert r.choices[0].finish_reason == "length" and not message["content"]
    assert message["reasoning_content"] == THINK_CUT.removeprefix("<think>")


def _messages(server, marker: str, reply: str, **kw) -> list:
    """The Anthropic SDK's message for ``reply``, cut where it ends: created, then streamed."""
    kw = dict(model="replay", max_tokens=_tokens(reply), messages=[{"role": "user", "content": f"Weather? {marker}"}],
              **kw)
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120) as client:
        whole = client.messages.create(**kw)
        with client.messages.stream(**kw) as stream:
            return [whole, stream.get_final_message()]


def test_anthropic_messages(fmt):
    case, server = fmt
    tool = {"name": "get_weather", "description": "The weather", "input_schema": CITY}
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "auto"}):
        for m in _messages(server, "[cut]", case["[cut]"], tools=[tool], tool_choice=choice):
            assert m.stop_reason == "max_tokens"
            assert "".join(b.text for b in m.content if b.type == "text") == case["content"]
            assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == \
                [(name, inp) for (name, _), inp in zip(case["calls"], case["inputs"])]
    for m in _messages(server, "[name-cut]", case["[name-cut]"], tools=[tool], tool_choice={"type": "any"}):
        assert m.stop_reason == "max_tokens"
        assert [(b.type, b.text) for b in m.content] == [("text", case["name_cut_content"])]


def test_anthropic_thinking_cut_stays_thinking(fmt):
    _, server = fmt
    for m in _messages(server, "[think-cut]", THINK_CUT, thinking={"type": "enabled", "budget_tokens": 1024}):
        assert m.stop_reason == "max_tokens"
        assert [b.thinking for b in m.content if b.type == "thinking"] == [THINK_CUT.removeprefix("<think>")]
        assert not "".join(b.text for b in m.content if b.type == "text")


def _responses(client, marker: str, reply: str, **kw) -> list:
    """The Response for ``reply``, cut where it ends: created, then streamed (its last event's)."""
    kw = dict(model="replay", input=f"Weather? {marker}", max_output_tokens=_tokens(reply), **kw)
    *_, last = client.responses.create(**kw, stream=True)
    assert last.type == "response.incomplete"
    return [client.responses.create(**kw), last.response]


def test_responses(fmt):
    case, server = fmt
    client = server.client()
    tool = {"type": "function", "name": "get_weather", "description": "The weather", "parameters": CITY}
    *done, cut = case["calls"]
    want = [(name, arguments, "completed") for name, arguments in done] + [(*cut, "incomplete")]
    for r in _responses(client, "[cut]", case["[cut]"], tools=[tool], tool_choice="required"):
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert [(i.name, i.arguments, i.status) for i in r.output if i.type == "function_call"] == want
        assert "".join(p.text for i in r.output if i.type == "message" for p in i.content) == case["content"]
    for r in _responses(client, "[name-cut]", case["[name-cut]"], tools=[tool], tool_choice="required"):
        assert r.status == "incomplete" and not [i for i in r.output if i.type == "function_call"]
        assert "".join(p.text for i in r.output if i.type == "message" for p in i.content) == case["name_cut_content"]


def test_no_markup_in_any_streamed_text(fmt):
    """The raw SSE of each API, cut in a call: the text deltas are the text before the call, no more."""
    case, server = fmt
    tokens, ask = _tokens(case["[cut]"]), "Weather? [cut]"
    chat = {"messages": [{"role": "user", "content": ask}], "max_tokens": tokens}
    apis = {
        "/v1/chat/completions": ({**chat, "tools": [TOOL], "tool_choice": "required"},
                                 lambda e: e["choices"][0]["delta"].get("content") if e.get("choices") else None),
        "/v1/messages": ({**chat, "tools": [{"name": "get_weather", "input_schema": CITY}],
                          "tool_choice": {"type": "any"}},
                         lambda e: e["delta"]["text"] if e["type"] == "content_block_delta"
                         and e["delta"]["type"] == "text_delta" else None),
        "/v1/responses": ({"input": ask, "max_output_tokens": tokens, "tool_choice": "required",
                           "tools": [{"type": "function", "name": "get_weather", "parameters": CITY}]},
                          lambda e: e["delta"] if e["type"] == "response.output_text.delta" else None),
    }
    for path, (body, text_of) in apis.items():
        with server.http() as http, http.stream("POST", path, json={"model": "replay", "stream": True, **body}) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(text_of(e) or "" for e in events) == case["content"], path
