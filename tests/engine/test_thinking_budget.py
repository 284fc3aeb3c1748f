"""The engine ends reasoning itself when a request's thinking budget is spent."""

from spark.engine.offline import generate
from spark.engine.engine import Engine
from spark.engine.sampling import SamplingParams

THINK, END, NEWLINES = 5, 6, 7


def _engine():
    engine = Engine.load("dummy:tiny-llama", device="cpu", progress=False, kv_cache_bytes=8 << 20)
    engine.think_tags = (THINK, (END, NEWLINES))  # the dummy vocabulary has no tags: name two ids as them
    return engine


def test_budget_closes_template_forced_thinking():
    engine = _engine()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, thinking_budget=4, starts_in_thinking=True)
    out = [o.token_id for o in generate(engine, [[1, 2, 3]], params)[0]]
    assert out[4:6] == [END, NEWLINES]  # four reasoning tokens, then the closing tag the engine wrote
    assert len(out) == 12  # and the answer continues


def test_budget_only_counts_inside_thinking():
    engine = _engine()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, thinking_budget=1,
                            logit_bias={THINK: -float("inf"), END: -float("inf"), NEWLINES: -float("inf")})
    out = [o.token_id for o in generate(engine, [[1, 2, 3]], params)[0]]
    assert END not in out  # the model never opened <think>: nothing to close


def test_no_budget_no_forcing():
    engine = _engine()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, starts_in_thinking=True,
                            logit_bias={END: -float("inf"), NEWLINES: -float("inf")})
    out = [o.token_id for o in generate(engine, [[1, 2, 3]], params)[0]]
    assert END not in out and NEWLINES not in out
