"""The public API: names, errors, hold-back of tag prefixes, ids, OpenAI helpers, typing, speed."""

from __future__ import annotations

import json
import random
import time

import pytest

from spark.parsers import (ChatOutputParser, ContentDelta, ReasoningDelta, ToolCallDelta, detect_tool_parser,
                           prompt_ends_in_thinking, reasoning_parser, to_openai_tool_call_deltas,
                           to_openai_tool_calls, tool_parser)
from spark.parsers.schema import convert_value
from tests.parsers.fixtures import TOOLS
from tests.parsers.streaming import check_events, stream_pieces


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="hermes.*qwen3_coder.*minimax"):
        tool_parser("llama3_json")
    with pytest.raises(ValueError, match="think"):
        reasoning_parser("r1")


def test_detect_tool_parser():
    assert detect_tool_parser(None) is None
    assert detect_tool_parser("{{ messages }}") is None
    assert detect_tool_parser("<tool_call>\n{{ tool_call | tojson }}\n</tool_call>") == "hermes"
    assert detect_tool_parser("<tool_call>\n<function={{ name }}>\n<parameter=") == "qwen3_coder"
    assert detect_tool_parser('<minimax:tool_call>\n<invoke name="{{ name }}">') == "minimax"


def test_prompt_ends_in_thinking():
    assert prompt_ends_in_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_ends_in_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_in_thinking("no tags at all")
    assert prompt_ends_in_thinking("<think>old</think> user text <think>")
    assert not prompt_ends_in_thinking("<think>a</think><think>b</think>")


@pytest.mark.parametrize("feeds, expected", [
    (["a <to", "ol"], [[ContentDelta("a ")], []]),  # could still become <tool_call>
    (["<to", "x"], [[], [ContentDelta("<tox")]]),
    (["<tx"], [[ContentDelta("<tx")]]),  # released at once
    (["<", " b"], [[], [ContentDelta("< b")]]),
    (["x<tool_call", ">"], [[ContentDelta("x")], []]),
])
def test_hermes_holds_only_possible_tags(feeds, expected):
    stream = tool_parser("hermes").stream()
    assert [stream.feed(f) for f in feeds] == expected


def test_reasoning_and_xml_hold_back():
    stream = ChatOutputParser("minimax", True).stream()
    assert stream.feed("ok <minimax:tool") == [ContentDelta("ok ")]
    assert stream.feed("s") == [ContentDelta("<minimax:tools")]
    assert stream.feed(" <thin") == [ContentDelta(" ")]
    assert stream.feed("k>hm") == [ReasoningDelta("hm")]
    assert stream.feed("</think") == []
    assert stream.feed("er") == [ReasoningDelta("</thinker")]


def test_hermes_unclosed_call_is_sent_at_flush():
    stream = tool_parser("hermes", id_prefix="call_u").stream()
    assert stream.feed('<tool_call>\n{"name": "ping", ') == []
    assert stream.feed('"arguments": {}}') == []  # a </tool_call> may still come
    assert stream.flush() == [ToolCallDelta(0, "call_u00000000", "ping", "{}")]
    result = stream.finish()
    assert (result.content, [(c.name, c.arguments) for c in result.tool_calls]) == ("", [("ping", {})])


def test_reopened_think_split_across_deltas():
    stream = reasoning_parser("think", prompt_ends_in_thinking=True).stream()
    assert stream.feed("<thi") == []
    assert stream.feed("nk>\nplan") == [ReasoningDelta("\nplan")]
    assert stream.feed("\n</think>\n\nAnswer") == [ReasoningDelta("\n"), ContentDelta("Answer")]
    result = stream.finish()
    assert (result.reasoning, result.content) == ("\nplan\n", "Answer")
    assert result == reasoning_parser("think").parse("<think>\nplan\n</think>\n\nAnswer")


def test_qwen3_coder_streams_each_parameter():
    parser = tool_parser("qwen3_coder", TOOLS, id_prefix="call_a")
    stream = parser.stream()
    head = "<tool_call>\n<function=run_code>\n<parameter=timeout>\n5\n</parameter>\n<parameter=code>\n"
    assert stream.feed(head) == [ToolCallDelta(0, "call_a00000000", "run_code", '{"timeout": 5')]
    assert stream.feed("x = 1\n" * 100) == []  # a value is sent once it is complete
    code = "x = 1\n" * 99 + "x = 1"
    assert stream.feed("</parameter>\n") == [ToolCallDelta(0, None, None, ', "code": ' + json.dumps(code))]
    assert stream.feed("</function>\n</tool_call>") == [ToolCallDelta(0, None, None, "}")]
    assert stream.flush() == []
    assert stream.finish().tool_calls[0].arguments == {"timeout": 5, "code": "x = 1\n" * 99 + "x = 1"}


def test_ids_are_deterministic_per_parser():
    text = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    parser = tool_parser("hermes")
    ids = [c.id for c in parser.parse(text).tool_calls]
    assert ids[0].startswith("call_") and len(ids[0]) == len("call_") + 24 and ids[0] != ids[1]
    int(ids[0][5:], 16)
    streamed, _ = stream_pieces(parser.stream, list(text))
    assert [c.id for c in streamed.tool_calls] == ids == [c.id for c in parser.parse(text).tool_calls]
    assert [c.id for c in tool_parser("hermes").parse(text).tool_calls] != ids
    random.seed(7)
    first = tool_parser("hermes").parse(text).tool_calls[0].id
    random.seed(7)
    assert tool_parser("hermes").parse(text).tool_calls[0].id == first


def test_openai_deltas():
    parser = tool_parser("qwen3_coder", TOOLS, id_prefix="call_q")
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>\n</tool_call>")
    stream = parser.stream()
    items = [item for ch in text for item in to_openai_tool_call_deltas(stream.feed(ch))]
    items += to_openai_tool_call_deltas(stream.flush())
    assert items[0] == {"index": 0, "id": "call_q00000000", "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert all(set(item) == {"index", "function"} and set(item["function"]) == {"arguments"} for item in items[1:])
    assert json.loads("".join(item["function"]["arguments"] for item in items)) == {"city": "Rome", "days": 2}
    # Events of one feed are merged per call.
    merged = to_openai_tool_call_deltas([ContentDelta("x"), ToolCallDelta(1, "id1", "f", ""),
                                         ToolCallDelta(1, None, None, "{}"), ToolCallDelta(2, "id2", "g", "{}")])
    assert merged == [{"index": 1, "id": "id1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                      {"index": 2, "id": "id2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    result = stream.finish()
    assert to_openai_tool_calls(result.tool_calls) == [
        {"id": "call_q00000000", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]


def test_stream_protocol():
    parser = ChatOutputParser("hermes", reasoning=True, id_prefix="call_c")
    events = parser.feed("<think>hmm</think>\n\nOK <tool_call>{\"name\": \"f\"}</tool_call>")
    events += parser.flush()
    assert events == [ReasoningDelta("hmm"), ContentDelta("OK "), ToolCallDelta(0, "call_c00000000", "f", "{}")]
    result = parser.finish()
    assert (result.reasoning, result.content, [c.name for c in result.tool_calls]) == ("hmm", "OK ", ["f"])
    assert parser.finish() is result and parser.flush() == []
    with pytest.raises(RuntimeError):
        parser.feed("more")
    # Without flush(), finish() hands the held-back tail over in final_events.
    stream = tool_parser("qwen3_coder", id_prefix="call_t").stream()
    assert stream.feed("a <tool_call>\n<function=f>\n<parameter=x>\n1") == [
        ContentDelta("a "), ToolCallDelta(0, "call_t00000000", "f", "")]
    result = stream.finish()
    assert result.final_events == (ToolCallDelta(0, None, None, '{"x": "1"}'),)
    assert result.tool_calls[0].arguments == {"x": "1"} and stream.flush() == []
    plain = ChatOutputParser(None, reasoning=False)
    assert plain.feed("<think>a</think>") == [ContentDelta("<think>a</think>")]
    assert plain.finish().content == "<think>a</think>"


@pytest.mark.parametrize("text, schema, expected", [
    ("42", {"type": "integer"}, 42),
    ("4.0", {"type": "integer"}, 4),
    ("4.5", {"type": "integer"}, "4.5"),
    ("-1e2", {"type": "number"}, -100.0),
    ("NaN", {"type": "number"}, "NaN"),
    ("TRUE", {"type": "boolean"}, True),
    ("[1, 'a']", {"type": "array"}, [1, "a"]),
    ("{1: 2}", {"type": "object"}, "{1: 2}"),  # a non-string key would not survive JSON
    ("(1, 2)", {"type": "array"}, "(1, 2)"),
    ("7", {"anyOf": [{"type": "null"}, {"type": "integer"}]}, 7),
    ("null", {"type": ["integer", "null"]}, None),
    ("007", {"type": "string"}, "007"),
    ("007", None, "007"),
    (" 5 ", {"type": "integer"}, 5),
])
def test_convert_value(text, schema, expected):
    value = convert_value(text, schema)
    assert value == expected and type(value) is type(expected)


def _long_outputs() -> dict[str, tuple[str, bool, str]]:
    code = "".join(f"print('line {i}: </tool_call> ü')\n" for i in range(700))
    return {
        "hermes": ("hermes", False,
                   '<tool_call>{"name": "run_code", "arguments": {"code": ' + json.dumps(code) + "}}</tool_call>"),
        "qwen3_coder": ("qwen3_coder", False,
                        "<tool_call>\n<function=run_code>\n<parameter=code>\n" + code
                        + "</parameter>\n</function>\n</tool_call>"),
        "minimax": ("minimax", False, '<minimax:tool_call><invoke name="run_code"><parameter name="code">' + code
                    + "</parameter></invoke></minimax:tool_call>"),
        "think+content": ("hermes", True, "<think>" + code[:len(code) // 2].replace("<", "< ") + "</think>"
                          + code[len(code) // 2:].replace("<", "<t ")),
    }


@pytest.mark.parametrize("case", list(_long_outputs()))
def test_streaming_is_linear(case):
    name, think, text = _long_outputs()[case]
    assert len(text) >= 20_000
    parser = ChatOutputParser(name, think, TOOLS)
    start = time.perf_counter()
    result, events = stream_pieces(parser.stream, list(text))
    elapsed = time.perf_counter() - start
    assert result == parser.parse(text)
    check_events(result, events)
    assert elapsed < 1.0, f"{len(text)} one-character feeds took {elapsed:.2f} s"
