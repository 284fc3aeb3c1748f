"""Every fixture parsed one-piece matches its expected result, and streams to the same
result under every two-part split, one-character deltas and 50 random splits."""

from __future__ import annotations

import random

import pytest

from spark.parsers import ChatOutputParser, reasoning_parser, tool_parser
from tests.parsers.fixtures import FIXTURES, Fixture
from tests.parsers.streaming import assert_split_invariant, check_events, random_cuts, stream_pieces


def _parser(fx: Fixture) -> ChatOutputParser:
    return ChatOutputParser(fx.parser, fx.think, fx.tools, fx.prompt_ends_in_thinking, id_prefix="call_fx")


def _expected_calls(fx: Fixture) -> list[tuple]:
    return [(name, args, unknown) for name, args, unknown in fx.calls]


def test_fixture_count_and_coverage():
    assert len(FIXTURES) >= 40
    assert len({fx.name for fx in FIXTURES}) == len(FIXTURES)
    for kind in ("hermes", "qwen3_coder", "minimax"):
        assert sum(fx.parser == kind for fx in FIXTURES) >= 6
    assert sum(fx.think for fx in FIXTURES) >= 8


@pytest.mark.parametrize("fx", FIXTURES, ids=lambda fx: fx.name)
def test_one_piece(fx: Fixture):
    result = _parser(fx).parse(fx.text)
    assert result.content == fx.content
    assert result.reasoning == fx.reasoning
    assert [(c.name, c.arguments, c.unknown) for c in result.tool_calls] == _expected_calls(fx)
    assert [c.id for c in result.tool_calls] == [f"call_fx{i:08x}" for i in range(len(fx.calls))]
    cut = [(c.arguments_json(), c.incomplete) for c in result.tool_calls[-1:] if c.incomplete]
    assert cut == ([] if fx.cut is None else [(fx.cut, True)])
    assert not any(c.incomplete for c in result.tool_calls[:-1])
    # The parsers on their own agree with the composition.
    if fx.parser and not fx.think:
        alone = tool_parser(fx.parser, fx.tools, id_prefix="call_fx").parse(fx.text)
        assert (alone.content, alone.tool_calls) == (result.content, result.tool_calls)
    if fx.think and not fx.parser:
        alone = reasoning_parser("think", fx.prompt_ends_in_thinking).parse(fx.text)
        assert (alone.reasoning, alone.content) == (result.reasoning, result.content)


@pytest.mark.parametrize("fx", FIXTURES, ids=lambda fx: fx.name)
def test_streamed_every_split(fx: Fixture):
    parser = _parser(fx)
    expected = parser.parse(fx.text)
    rng = random.Random(fx.name)
    splits = [[k] for k in range(len(fx.text) + 1)]
    splits.append(range(1, len(fx.text)))  # one character at a time
    splits += [random_cuts(fx.text, rng) for _ in range(50)]
    assert_split_invariant(parser.stream, fx.text, expected, splits)


@pytest.mark.parametrize("fx", [fx for fx in FIXTURES if fx.parser and not fx.think], ids=lambda fx: fx.name)
def test_tool_parser_alone_streams_one_char(fx: Fixture):
    parser = tool_parser(fx.parser, fx.tools)
    result, events = stream_pieces(parser.stream, list(fx.text))
    assert result == parser.parse(fx.text)
    check_events(result, events)
