"""Bounded repeats as chains of rules (spark.engine.grammar_chains): the text rewrite, and the same masks
bit for bit as xgrammar's own grammar on walks through the XML-style tool formats' bounded strings."""

from __future__ import annotations

import random

import numpy as np
import pytest

from spark.engine.grammar import XGrammars
from spark.engine.grammar_chains import chain_bounded_repeats
from spark.engine.tokenizer import Tokenizer
from spark.engine.weights import default_model_path
from spark.http.chat_prompt import ToolChoice
from spark.http.structured import turn_grammar
from tests.grammar_cases import FORCED_TOOLS


def test_a_repeat_before_a_literal_becomes_a_chain_that_ends_in_it():
    ebnf = "\n".join([
        'root ::= (("<a>" ws s ws2 "</a>" tail) | (s))',
        "s ::= ((ch{1, 3}))",
        "ch ::= (([\\0-\\U0010ffff]))",
        'ws2 ::= ("" | ([ \\n]))',
    ])
    out = chain_bounded_repeats(ebnf).splitlines()
    assert out[0] == 'root ::= (("<a>" ws s_chain0_0 tail) | (s))'  # the use without a literal after keeps s
    assert out[4:] == [
        "s_chain0_0 ::= (ch s_chain0_1)",  # below the lower bound: no way out yet
        's_chain0_1 ::= (ch s_chain0_2) | (ws2 "</a>")',
        's_chain0_2 ::= (ch s_chain0_3) | (ws2 "</a>")',
        's_chain0_3 ::= (ws2 "</a>")',
    ]


def test_grammars_without_a_bounded_repeat_or_over_the_cap_are_unchanged():
    plain = 'root ::= (("a" s "b"))\ns ::= ((ch{0, -1}))\nch ::= (([a-z]))'
    assert chain_bounded_repeats(plain) == plain
    long = 'root ::= (("a" s "b"))\ns ::= ((ch{0, 300}))\nch ::= (([a-z]))'
    assert chain_bounded_repeats(long, max_chain=256) == long


# Tools whose strings are bounded in several ways, each forced, so that every walk goes through them.
_STRINGS = {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
    "label": {"type": "string", "maxLength": 6},
    "code": {"type": "string", "minLength": 2, "maxLength": 4},
    "text": {"type": "string"},
    "level": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["label", "code", "level"]}}}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def shortest(tokenizer):
    """The tokens in order of their text's length, shortest first."""
    lengths = [len(tokenizer.decode([t])) for t in range(tokenizer.vocab_size)]
    return np.argsort(lengths, kind="stable")


@pytest.mark.parametrize("fmt", ["qwen3_coder", "minimax", "hermes"])
@pytest.mark.parametrize("tools", ["forced", "strings"])
def test_chained_grammars_give_the_same_masks_as_xgrammars_own(tokenizer, shortest, fmt, tools):
    tools = FORCED_TOOLS if tools == "forced" else [_STRINGS]
    spec = turn_grammar(tool_parser=fmt, tools=tools, tool_choice=ToolChoice("required"), parallel_tool_calls=False,
                        schema=None, reasoning="disabled")
    chained, plain = (XGrammars(tokenizer, tokenizer.vocab_size, chain_repeats=on) for on in (True, False))
    if fmt != "hermes":  # (a JSON string closes in its own rule: nothing to chain)
        assert chained.compiled(spec) is not plain.compiled(spec)
    ended = 0
    for seed in range(12):
        rng, a, b = random.Random(seed), chained.matcher(spec), plain.matcher(spec)
        for _ in range(160):
            mask_a, mask_b = (np.frombuffer(m, dtype=np.uint8) for m in chained.masks([a]) + plain.masks([b]))
            assert np.array_equal(mask_a, mask_b)
            if a._matcher.is_terminated():
                break
            bits = np.unpackbits(mask_a, bitorder="little")[:tokenizer.vocab_size].astype(bool)
            # Half the walks take among the 40 shortest tokens allowed: a string then runs to its bound.
            pick = shortest[bits[shortest]][:40] if seed % 2 else np.flatnonzero(bits)
            token = int(rng.choice(list(pick)))
            assert a.accept(token) and b.accept(token)
        assert a._matcher.is_terminated() == b._matcher.is_terminated()
        ended += a._matcher.is_terminated()
    assert ended >= 4  # walks went through the whole call (one into the free "text" may not end)


@pytest.mark.parametrize("fmt, opening", [("qwen3_coder", "<tool_call>\n<function=note>\n"),
                                          ("minimax", '<minimax:tool_call>\n<invoke name="note">\n')])
def test_a_strict_tool_under_auto_with_reasoning_keeps_its_masks_too(tokenizer, shortest, fmt, opening):
    """Free text, an optional think block and triggered calls (xgrammar's tag dispatch) read back from the
    printed grammar as they were: the masks of a call entered after some text are the same."""
    strict = {"type": "function", "function": {**_STRINGS["function"], "strict": True}}
    spec = turn_grammar(tool_parser=fmt, tools=[strict], tool_choice=ToolChoice("auto"), parallel_tool_calls=True,
                        schema=None, reasoning="auto")
    chained, plain = (XGrammars(tokenizer, tokenizer.vocab_size, chain_repeats=on) for on in (True, False))
    assert chained.compiled(spec) is not plain.compiled(spec)
    for seed in range(6):
        rng, a, b = random.Random(seed), chained.matcher(spec), plain.matcher(spec)
        for text in ("<think>hm</think>\n\nSure.\n", opening):
            assert [a._matcher.accept_string(text), b._matcher.accept_string(text)] == [True, True]
        for _ in range(40):
            mask_a, mask_b = (np.frombuffer(m, dtype=np.uint8) for m in chained.masks([a]) + plain.masks([b]))
            assert np.array_equal(mask_a, mask_b)
            bits = np.unpackbits(mask_a, bitorder="little")[:tokenizer.vocab_size].astype(bool)
            token = int(rng.choice(list(shortest[bits[shortest]][:40])))
            assert a.accept(token) and b.accept(token)
