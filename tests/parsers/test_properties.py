"""Hypothesis: random tool calls rendered in each format parse back, one-piece and streamed, and
cut off anywhere parse to a beginning of that; arbitrary tag-laden text never crashes, streams
like it parses, and is never lost (but for the markup of a call the output ends in)."""

from __future__ import annotations

import json
from typing import Any

import attrs
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from spark.parsers import ChatOutputParser, tool_parser
from tests.parsers.streaming import check_events, pieces_at, stream_pieces

SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TRICKY = ["</tool_call>", "<tool_call>", "</function>", "<function=f>", "<parameter=p>", "</parameter>",
          "</invoke>", '<invoke name="f">', "<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>",
          "<to", "<", ">", '"', "'", "\\", "\\n", "\n", " ", "\t", "{", "}", "[", "é", "\U0001f600", "\u2028", "null"]
BLOCK_OPENS = ["<tool_call>", "<minimax:tool_call>"]
# What an XML value cannot hold: the format's own parameter tags, and a block open (see xml_calls).
XML_FORBIDDEN = {"qwen3_coder": ["</parameter>", "<parameter=", "<tool_call>"],
                 "minimax": ["</parameter>", "<parameter name=", "<minimax:tool_call>"]}
CONTENT_FORBIDDEN = [*BLOCK_OPENS, "<think>"]
XML_CLOSES = {"qwen3_coder": ["</function>", "</tool_call>"], "minimax": ["</invoke>", "</minimax:tool_call>"]}

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,15}", fullmatch=True)


def texts(forbidden: list[str] = (), max_pieces: int = 6) -> st.SearchStrategy[str]:
    piece = st.one_of(st.text(max_size=6), st.sampled_from(TRICKY))
    return st.lists(piece, max_size=max_pieces).map("".join).filter(lambda s: not any(f in s for f in forbidden))


def json_values(forbidden: list[str] = ()) -> st.SearchStrategy[Any]:
    scalars = (st.none() | st.booleans() | st.integers(-10**15, 10**15)
               | st.floats(allow_nan=False, allow_infinity=False) | texts(forbidden))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(texts(forbidden, 3), inner, max_size=3), max_leaves=8)


@st.composite
def xml_params(draw, fmt: str, known: bool, also_forbidden: list[str]) -> dict[str, tuple[str, Any]]:
    forbidden = XML_FORBIDDEN[fmt] + also_forbidden
    by_kind = {
        "string": texts(forbidden),
        "integer": st.integers(-10**15, 10**15),
        "number": st.floats(allow_nan=False, allow_infinity=False),
        "boolean": st.booleans(),
        "object": st.dictionaries(texts(forbidden, 3), json_values(forbidden), max_size=3),
        "array": st.lists(json_values(forbidden), max_size=3),
    }
    kinds = st.sampled_from(list(by_kind) if known else ["string"])
    names = draw(st.lists(NAMES, max_size=4, unique=True))
    params = {}
    for name in names:
        kind = draw(kinds)
        params[name] = (kind, draw(by_kind[kind]))
    return params


def render_xml_value(fmt: str, kind: str, value: Any, wrap: bool) -> str:
    text = value if kind == "string" else json.dumps(value, ensure_ascii=False)
    if fmt == "qwen3_coder" or wrap or text.startswith("\n") or text.endswith("\n"):
        text = f"\n{text}\n"  # the parser strips exactly one newline on each side
    return text


def render_call(fmt: str, name: str, params: dict[str, tuple[str, Any]], args: dict[str, Any], style: bool) -> str:
    if fmt == "hermes":
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=style)}\n</tool_call>"
    if fmt == "qwen3_coder":
        body = "".join(f"<parameter={p}>{render_xml_value(fmt, k, v, style)}</parameter>\n"
                       for p, (k, v) in params.items())
        return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"
    body = "".join(f'<parameter name="{p}">{render_xml_value(fmt, k, v, style)}</parameter>\n'
                   for p, (k, v) in params.items())
    return f'<minimax:tool_call>\n<invoke name="{name}">\n{body}</invoke>\n</minimax:tool_call>'


def without_cut_tag(text: str, tag: str) -> str:
    i = text.rfind("<")
    return text[:i] if i >= 0 and tag.startswith(text[i:]) else text


@st.composite
def chat_outputs(draw):
    """A rendered reply and what it should parse to."""
    fmt = draw(st.sampled_from(["hermes", "qwen3_coder", "minimax"]))
    # "reopened": the template opened the block and the model writes its own <think> anyway.
    think = draw(st.sampled_from(["none", "block", "forced", "reopened"]))
    # Reasoning is split off first, so with it on a "<think>" in an argument would open a block.
    no_think = ["<think>"] if think != "none" else []
    calls, tools = [], []
    for name in draw(st.lists(NAMES, max_size=3, unique=True)):
        known = draw(st.booleans())
        if fmt == "hermes":
            params = {}
            args = draw(st.dictionaries(texts(no_think, 3), json_values(no_think), max_size=4))
        else:
            params = draw(xml_params(fmt, known, no_think))
            args = {p: v for p, (_, v) in params.items()}
        if known:
            tools.append({"type": "function", "function": {"name": name, "parameters": {
                "type": "object", "properties": {p: {"type": k} for p, (k, _) in params.items()}}}})
        calls.append((name, params, args, not known))
    segments = draw(st.lists(texts(CONTENT_FORBIDDEN), min_size=len(calls) + 1, max_size=len(calls) + 1))
    reasoning_text = draw(texts(["</think>"]))
    style = draw(st.booleans())
    # A hermes call left open at the very end (only whitespace after it) is still a call.
    unclosed = fmt == "hermes" and bool(calls) and not segments[-1].strip() and draw(st.booleans())

    rendered = [render_call(fmt, name, params, args, style) for name, params, args, _ in calls]
    if unclosed:
        rendered[-1] = rendered[-1].removesuffix("</tool_call>")
    text = segments[0] + "".join(r + segment for r, segment in zip(rendered, segments[1:]))
    reasoning = "" if think == "none" else f"\n{reasoning_text}\n"
    if think in ("block", "reopened"):
        text = f"<think>{reasoning}</think>\n\n{text}"
    elif think == "forced":
        text = f"{reasoning_text}\n</think>\n\n{text}"
        reasoning = reasoning[1:]
        if reasoning.lstrip().startswith("<think>"):  # the model reopened the block: the tag is dropped
            reasoning = reasoning.lstrip()[len("<think>"):]
    if reasoning.isspace():  # a whitespace-only block is a template no-op
        reasoning = ""
    if think != "none":  # whitespace after </think> is dropped
        segments[0] = segments[0].lstrip()
    # A tag the output ended inside is dropped: a <think> (the reasoning parser reads first), then a call's.
    last = segments[-1]
    if think != "none":
        segments[-1] = without_cut_tag(segments[-1], "<think>")
    segments[-1] = without_cut_tag(segments[-1], BLOCK_OPENS[fmt == "minimax"])
    cut = segments[-1] != last
    content = "".join(s for s in segments if not ((calls or cut) and s.isspace()))
    expected = (reasoning, content, [(n, a, unknown) for n, _, a, unknown in calls])
    return fmt, think, tools, text, expected


@SETTINGS
@given(case=chat_outputs(), data=st.data())
def test_rendered_calls_parse_back(case, data):
    fmt, think, tools, text, expected = case
    parser = ChatOutputParser(fmt, think != "none", tools, think in ("forced", "reopened"), id_prefix="call_p")
    result = parser.parse(text)
    assert (result.reasoning, result.content, [(c.name, c.arguments, c.unknown) for c in result.tool_calls]) == expected
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12), label="cuts")
    streamed, events = stream_pieces(parser.stream, pieces_at(text, cuts), flush=data.draw(st.booleans()))
    assert streamed == result
    check_events(streamed, events)


@SETTINGS
@given(case=chat_outputs(), data=st.data())
def test_a_reply_cut_anywhere_parses_to_a_beginning_of_its_whole_parse(case, data):
    """The token limit may end a reply anywhere: the content and reasoning are beginnings of the whole
    reply's (no markup of the call it ended in), the calls too, the last one incomplete if it was cut."""
    fmt, think, tools, text, (_, _, calls) = case
    # An XML value that holds a closing tag, cut right after it, reads as one that forgot `</parameter>`.
    assume(all(text.count(tag) == len(calls) for tag in XML_CLOSES.get(fmt, ())))
    parser = ChatOutputParser(fmt, think != "none", tools, think in ("forced", "reopened"), id_prefix="call_p")
    whole = parser.parse(text)
    cut = parser.parse(text[:data.draw(st.integers(0, len(text)), label="end")])
    assert whole.reasoning.startswith(cut.reasoning)
    assert whole.content.startswith(cut.content) or cut.content.isspace()  # blank: the answer when no call follows
    *done, last = cut.tool_calls or [None]
    assert done == whole.tool_calls[:len(done)]
    if last is not None:
        same = whole.tool_calls[len(done)]
        assert last == same or last.incomplete and attrs.evolve(last, arguments=same.arguments, incomplete=False,
                                                                cut_arguments=None) == same


@st.composite
def mutated_outputs(draw):
    """A rendered reply with a few random cuts, insertions and duplications: malformed output."""
    fmt, think, _, text, _ = draw(chat_outputs())
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 20)))
        kind = draw(st.sampled_from(["delete", "insert", "duplicate"]))
        if kind == "delete":
            text = text[:i] + text[j:]
        elif kind == "insert":
            text = text[:i] + draw(st.sampled_from(TRICKY)) + text[i:]
        else:
            text = text[:j] + text[i:j] + text[j:]
    return fmt, think != "none", think in ("forced", "reopened"), text


SOUP = st.tuples(st.sampled_from(["hermes", "qwen3_coder", "minimax"]), st.booleans(), st.booleans(),
                 st.lists(st.sampled_from(TRICKY) | st.text(max_size=4), max_size=30).map("".join))


@SETTINGS
@given(case=st.one_of(SOUP, mutated_outputs()), data=st.data())
def test_any_text_streams_like_it_parses(case, data):
    fmt, think, forced, text = case
    parser = ChatOutputParser(fmt, think, prompt_ends_in_thinking=forced, id_prefix="call_z")
    result = parser.parse(text)
    for cuts in (data.draw(st.lists(st.integers(0, len(text)), max_size=10), label="cuts"), range(1, len(text))):
        streamed, events = stream_pieces(parser.stream, pieces_at(text, cuts))
        assert streamed == result
        check_events(streamed, events)
    if not think:
        alone = tool_parser(fmt, id_prefix="call_z").parse(text)
        assert (alone.content, alone.tool_calls) == (result.content, result.tool_calls)
        if not alone.tool_calls:  # nothing the model wrote is lost, but for the markup of a call cut off at the end
            assert text.startswith(alone.content)
            assert text[len(alone.content):].lstrip()[:1] in ("", "<")
