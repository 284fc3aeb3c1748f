"""Sampling fidelity (issue 18): the first sampled token of the default model, drawn 2,000 times, follows
softmax(logits / T) after top-k, top-p and min-p, by a chi-square test. A sampler bug cannot hide
behind "the small model rambles": the reference is computed here, in float64, from the same logits."""

from __future__ import annotations

import math

import pytest
import torch

from spark.engine.sampler import Sampler, SamplingBatch
from spark.engine.sampling import SamplingParams

from .conftest import prefill_logits

DRAWS = 2000
PROMPT = "The weather today is"


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution the sampler must draw from, per the OpenAI / vLLM semantics, in float64."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    if p.top_k > 0:
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if p.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, 0) - ordered  # mass of the more likely tokens
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order] = before < p.top_p * ordered.sum()
        probs = torch.where(keep, probs, 0.0)
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (z = 3.09), Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.fixture(scope="module")
def logits(engine) -> torch.Tensor:
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    return prefill_logits(engine, [ids])[0].float()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=20),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=1.1, top_k=50, top_p=0.9, min_p=0.02),
], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_first_token_draws_follow_the_filtered_softmax(logits, params):
    expected = reference(logits, params)
    batch = SamplingBatch(params=[params] * DRAWS, token_histories=[((), ())] * DRAWS,
                          seeds=range(1, DRAWS + 1), steps=[0] * DRAWS)
    drawn = Sampler()(logits.expand(DRAWS, -1).contiguous(), batch).token_ids
    counts = torch.bincount(drawn, minlength=logits.numel()).double()
    assert counts[expected == 0].sum() == 0, "drew a token the filters exclude"
    # Bins of expected count >= 5; the rest lumped into one.
    want = expected * DRAWS
    big = want >= 5
    observed = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    wanted = torch.cat([want[big], want[~big].sum(0, keepdim=True)])
    if wanted[-1] < 5:  # the lumped rest is too small to be a bin of its own
        observed, wanted = observed[:-1], wanted[:-1]
        observed[-1] += counts[~big].sum()
        wanted[-1] += want[~big].sum()
    dof = len(wanted) - 1
    assert dof >= 3, "the test needs a distribution of several likely tokens: pick another prompt"
    chi2 = (((observed - wanted) ** 2) / wanted).sum().item()
    assert chi2 < chi_square_critical(dof), f"chi2 {chi2:.1f} over {dof} degrees of freedom"


def test_the_test_catches_a_wrong_temperature(logits):
    """The statistic is not vacuous: draws at T=1.0 fail against the T=0.7 reference."""
    params, wrong = SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)
    expected = reference(logits, wrong)
    batch = SamplingBatch(params=[params] * DRAWS, token_histories=[((), ())] * DRAWS,
                          seeds=range(1, DRAWS + 1), steps=[0] * DRAWS)
    counts = torch.bincount(Sampler()(logits.expand(DRAWS, -1).contiguous(), batch).token_ids,
                            minlength=logits.numel()).double()
    want = expected * DRAWS
    big = want >= 5
    chi2 = (((counts[big] - want[big]) ** 2) / want[big]).sum().item()
    assert chi2 > chi_square_critical(int(big.sum()) - 1)
