"""Rejection sampling of drafts keeps the output distribution (issue 22): on a vocabulary of 8 with
synthetic logits, 20,000 seeded verifications of a one- or two-token draft through the sampler and
``verified`` emit a first token distributed as p (the row's distribution after temperature and
top-k), accept the draft with probability p(d), resample from p without d on rejection, and after
an accepted token draw the next from the next row's distribution; chi-square tests, fixed seeds."""

from __future__ import annotations

import math

import pytest
import torch

from spark.engine.sampler import Sampler, SamplingBatch, verified
from spark.engine.sampling import SamplingParams

from .test_sampling_fidelity import chi_square_critical, reference

V, DRAWS = 8, 20_000
PARAMS = SamplingParams(temperature=0.9, top_k=6)


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    return torch.randn(3, V, generator=torch.Generator().manual_seed(22)) * 1.5  # the rows of a verify chunk


def _verify(logits: torch.Tensor, draft: tuple[int, ...], params: SamplingParams) -> list[list[int]]:
    """The emitted tokens of DRAWS verifications of ``draft``, one seed each (rows as the engine builds them)."""
    rows = len(draft) + 1
    batch = SamplingBatch(params=[params] * (DRAWS * rows), token_histories=[((), ())] * (DRAWS * rows),
                          seeds=[seed for seed in range(DRAWS) for _ in range(rows)],
                          steps=[i for _ in range(DRAWS) for i in range(rows)])
    samples = Sampler()(logits[:rows].repeat(DRAWS, 1), batch).token_ids.view(DRAWS, rows).tolist()
    return [row[:verified(row, draft)] for row in samples]


def _chi_square(tokens: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    assert counts[probs == 0].sum() == 0, "a token the distribution excludes was emitted"
    kept = probs > 0
    expected = probs[kept] * len(tokens)
    stat = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert stat < chi_square_critical(int(kept.sum()) - 1), (stat, counts.tolist(), expected.tolist())


def _ranked(logits: torch.Tensor) -> list[int]:
    return reference(logits[0], PARAMS).argsort(descending=True).tolist()


@pytest.mark.parametrize("rank", [0, 2, 5])  # the likeliest token, a middling one, the least likely kept
def test_one_drafted_token(logits, rank):
    p = reference(logits[0], PARAMS)
    d = _ranked(logits)[rank]
    emitted = _verify(logits, (d,), PARAMS)
    _chi_square([e[0] for e in emitted], p)  # the first token is distributed as without speculation
    accepted = sum(len(e) == 2 for e in emitted)
    sigma = math.sqrt(DRAWS * p[d] * (1 - p[d]))
    assert abs(accepted - DRAWS * p[d]) < 4 * sigma + 1  # accepted with probability p(d)
    rejected = [e[0] for e in emitted if len(e) == 1]
    without = p.clone()
    without[d] = 0
    _chi_square(rejected, without / without.sum())  # resampled from p without d, renormalised
    if accepted > 500:
        _chi_square([e[1] for e in emitted if len(e) == 2], reference(logits[1], PARAMS))


def test_a_token_the_filters_drop_is_never_accepted(logits):
    d = reference(logits[0], PARAMS).argmin().item()  # cut by top-k
    emitted = _verify(logits, (d,), PARAMS)
    assert all(len(e) == 1 for e in emitted)
    _chi_square([e[0] for e in emitted], reference(logits[0], PARAMS))


def test_two_drafted_tokens(logits):
    """The pair (first, second) emitted is distributed as p0(first) * p1(second) where the draft's first
    token was accepted; both rows' samples are what decoding would draw."""
    p0, p1 = reference(logits[0], PARAMS), reference(logits[1], PARAMS)
    d0, d1 = _ranked(logits)[0], reference(logits[1], PARAMS).argmax().item()
    emitted = _verify(logits, (d0, d1), PARAMS)
    _chi_square([e[0] for e in emitted], p0)
    _chi_square([e[1] for e in emitted if len(e) >= 2], p1)
    both = sum(len(e) == 3 for e in emitted)
    expected = DRAWS * p0[d0] * p1[d1]
    assert abs(both - expected) < 4 * math.sqrt(expected * (1 - p0[d0] * p1[d1])) + 1


def test_greedy_accepts_exactly_the_argmax_chain(logits):
    greedy = SamplingParams(temperature=0.0)
    best0, best1 = logits[0].argmax().item(), logits[1].argmax().item()
    other = (best0 + 1) % V
    assert all(e == [best0, best1] for e in _verify(logits, (best0,), greedy)[:100])
    assert all(e == [best0] for e in _verify(logits, (other,), greedy)[:100])
