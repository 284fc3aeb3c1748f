"""The grammar alone makes a forced call valid (issue 21): random weights, which know no format, with
the default model's tokenizer; for each tool-call format (hermes, qwen3_coder, minimax) every forced
call parses with that format's parser and its arguments validate against the tool's schema."""

from __future__ import annotations

import jsonschema
import pytest

from spark.core.core import Core
from spark.core.events import Failed, TokenBatch
from spark.core.policies import Limits, make_policy
from spark.core.scheduler import Scheduler
from spark.engine.engine import Engine
from spark.engine.grammar import XGrammars
from spark.engine.sampling import SamplingParams
from spark.engine.weights.dummy import dummy_config
from spark.http.chat_prompt import ToolChoice
from spark.http.structured import turn_grammar
from spark.parsers import tool_parser
from tests.grammar_cases import FORCED_SCHEMAS as SCHEMAS, FORCED_TOOLS as TOOLS

import attrs
import torch



@pytest.fixture(scope="module")
def random_engine(engine):
    """Random weights of a tiny shape over the default model's vocabulary (its tokenizer decodes them)."""
    config = attrs.evolve(dummy_config("tiny-llama"), vocab_size=engine.vocab_size)
    return Engine.load("dummy", dummy_config=config, device="cpu", dtype=torch.float32, progress=False,
                       kv_cache_tokens=4096), engine.tokenizer


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "minimax"])
def test_forced_calls_on_random_weights_are_all_valid(random_engine, fmt):
    model, tokenizer = random_engine
    grammar = turn_grammar(tool_parser=fmt, tools=TOOLS, tool_choice=ToolChoice("required"),
                           parallel_tool_calls=False, schema=None, reasoning="disabled")
    core = Core(model, Scheduler(model.new_page_allocator(), make_policy("fifo", Limits()), max_batch_size=16),
                grammars=XGrammars(tokenizer, model.vocab_size))
    prompt = tokenizer.encode("Call a tool.")
    for i in range(20):
        params = SamplingParams(temperature=1.0, max_tokens=160, seed=i, stop_token_ids=tokenizer.eos_token_ids)
        core.submit(i, prompt, params, grammar=grammar)
    out: dict = {i: [] for i in range(20)}
    reasons = {}
    while core.busy:
        for event in core.step():
            if isinstance(event, Failed):
                raise AssertionError(event.error)
            if isinstance(event, TokenBatch):
                for o in event.outputs:
                    out[o.seq_id].append(o.token_id)
                    if o.finish_reason:
                        reasons[o.seq_id] = o.finish_reason
    assert set(reasons.values()) == {"stop"}, reasons  # each ended by the grammar (EOS), not by max_tokens
    for ids in out.values():
        text = tokenizer.decode(ids, skip_special_tokens=True)
        parsed = tool_parser(fmt, TOOLS).parse(text)
        assert len(parsed.tool_calls) == 1 and not parsed.content.strip(), text
        call = parsed.tool_calls[0]
        assert not call.unknown
        jsonschema.validate(call.arguments, SCHEMAS[call.name])


def test_a_finished_grammar_allows_only_the_stop_tokens(engine):
    """A request that ignores EOS asks for masks past the grammar's end: the stop tokens alone, again."""
    import numpy as np

    from spark.core.grammar import GrammarSpec

    tokenizer = engine.tokenizer
    matcher = XGrammars(tokenizer, engine.vocab_size).matcher(GrammarSpec("json_schema", '{"type": "boolean"}'))
    for token in tokenizer.encode("true") + [tokenizer.eos_token_ids[0]]:
        assert matcher.accept(token)
    allowed = np.unpackbits(np.frombuffer(matcher.mask(), dtype=np.uint8), bitorder="little")[:engine.vocab_size]
    assert sorted(np.flatnonzero(allowed)) == sorted(tokenizer.eos_token_ids)


def test_accept_in_one_call_matches_each_matcher_alone(engine):
    """``XGrammars.accept`` (one xgrammar call for a step's rows) says what each matcher's own
    ``accept`` says: a token the grammar allows, one it forbids (state unchanged), a finished grammar."""
    from spark.core.grammar import GrammarSpec

    tokenizer = engine.tokenizer
    grammars = XGrammars(tokenizer, engine.vocab_size)
    spec = GrammarSpec("json_schema", '{"type": "boolean"}')
    done, fresh, other = (grammars.matcher(spec) for _ in range(3))
    for token in tokenizer.encode("true") + [tokenizer.eos_token_ids[0]]:
        assert done.accept(token)
    t, x = tokenizer.encode("t")[0], tokenizer.encode("x")[0]
    assert grammars.accept([done, fresh, other], [x, t, x]) == [True, True, False]
    assert grammars.accept([other], [t]) == [True]  # the refused token left it where it was
