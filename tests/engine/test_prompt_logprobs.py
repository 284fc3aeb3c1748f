"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token after the first, scored by the
model given the tokens before it, equal to a teacher-forced prefill's logits; whole or chunked, beside
other sequences, and only for the sequences that ask."""

from __future__ import annotations

import pytest
import torch

from spark.engine.offline import generate, prefill_logits
from spark.engine.sampling import SamplingParams

from .test_engine import TEXT

K = 3
SCORED = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=K)
PLAIN = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def reference(engine, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: logprobs at each position but the last, teacher forced."""
    logits = prefill_logits(engine, [prompt], last=len(prompt))[0]
    return torch.log_softmax(logits.double(), -1)[:-1]


def check(scores, prompt: list[int], ref: torch.Tensor, k: int = K) -> None:
    assert [s.token_id for s in scores] == prompt[1:]
    got = torch.tensor([s.logprob for s in scores], dtype=torch.float64)
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    top = ref.topk(k, -1)
    for i, s in enumerate(scores):
        assert len(s.top_logprobs) == k
        torch.testing.assert_close(torch.tensor([lp for _, lp in s.top_logprobs], dtype=torch.float64),
                                   top.values[i], atol=1e-3, rtol=1e-4)
        assert not k or s.top_logprobs[0][0] == top.indices[i, 0].item()


@pytest.mark.parametrize("chunk", [None, 7, 1])
def test_prompt_logprobs_match_teacher_forcing(engine, chunk):
    prompt = engine.tokenizer.encode(TEXT)[:40]
    ref = reference(engine, prompt)
    (outs,) = generate(engine, [prompt], SCORED, max_prefill_tokens=chunk)
    check(outs[0].prompt_logprobs, prompt, ref)
    assert all(o.prompt_logprobs is None for o in outs[1:])  # the first token carries them


def test_only_the_sequences_that_ask_pay(engine):
    long, short = engine.tokenizer.encode(TEXT)[:33], engine.tokenizer.encode(TEXT)[5:14]
    refs = [reference(engine, p) for p in (long, short)]
    plain_alone = generate(engine, [long], PLAIN)[0]
    outs = generate(engine, [long, short, long], [SCORED, attrs_k(0), PLAIN], max_prefill_tokens=10)
    check(outs[0][0].prompt_logprobs, long, refs[0])
    check(outs[1][0].prompt_logprobs, short, refs[1], k=0)
    assert outs[2][0].prompt_logprobs is None
    assert [o.token_id for o in outs[2]] == [o.token_id for o in plain_alone]
    assert [o.token_id for o in outs[0]] == [o.token_id for o in plain_alone]  # scoring changes no sample


def test_a_one_token_prompt_has_nothing_to_score(engine):
    (outs,) = generate(engine, [[42]], SCORED)
    assert outs[0].prompt_logprobs == ()


def attrs_k(k: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=k)
