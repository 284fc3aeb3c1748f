import math

import pytest
import torch

from spark.engine import sampler as sampler_module
from spark.engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    filter_logits,
    row_keys,
    uniform_noise,
)
from spark.engine.sampling import SamplingParams

sampler = Sampler()


def batch_of(params, seeds=None, steps=None, histories=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=tuple(params),
        token_histories=tuple(histories or [((), ())] * n),
        seeds=tuple(seeds if seeds is not None else range(n)),
        steps=tuple(steps if steps is not None else [0] * n),
    )


# --- SamplingParams -----------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", "hot"),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: math.nan}),
        ("logit_bias", {1: math.inf}),
        ("logit_bias", [(1, 1.0), (1, 2.0)]),
        ("logit_bias", "x"),
        ("seed", 1.5),
        ("logprobs", -1),
        ("logprobs", 21),
        ("max_tokens", 0),
        ("stop_token_ids", [1, -2]),
        ("ignore_eos", "yes"),
    ],
)
def test_params_reject_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_convert_and_flag():
    p = SamplingParams(temperature=0, logit_bias={"7": -100, 3: 2}, stop_token_ids=[5], top_k=-1, logprobs=0)
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.logit_bias == ((3, 2.0), (7, -100.0))
    assert p.stop_token_ids == (5,)
    assert p.is_greedy and not SamplingParams(temperature=0.5).is_greedy
    assert not p.has_penalties and SamplingParams(presence_penalty=0.1).has_penalties
    hash(p)  # frozen and hashable


def test_batch_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        SamplingBatch(params=(SamplingParams(),), token_histories=(), seeds=(1,), steps=(0,))


# --- greedy, mask, bias, logprobs ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = sampler(logits, batch_of([SamplingParams(temperature=0)] * 7))
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert out.logprobs is None and out.top_token_ids is None
    # Off the fast path (logprobs asked), greedy rows still take the argmax.
    out = sampler(logits, batch_of([SamplingParams(temperature=0, logprobs=2)] * 7))
    assert torch.equal(out.token_ids, logits.float().argmax(-1))


def test_token_mask_is_honored():
    g = torch.Generator().manual_seed(1)
    B, V = 6, 50
    logits = torch.randn(B, V, generator=g) * 3
    mask = torch.rand(B, V, generator=g) < 0.2
    mask[:, 0] = True  # at least one allowed token per row
    params = [SamplingParams(temperature=0)] * 2 + [SamplingParams(temperature=1.5)] * 4
    want_greedy = logits.masked_fill(~mask, -math.inf).argmax(-1)
    for step in range(40):
        out = sampler(logits, batch_of(params, steps=[step] * B), token_mask=mask)
        assert mask.gather(1, out.token_ids[:, None]).all()
        assert torch.equal(out.token_ids[:2], want_greedy[:2])


def test_logit_bias_forces_and_bans():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    best = logits.argmax(-1)
    params = [
        SamplingParams(logit_bias={42: 100.0}),  # forced even when sampling
        SamplingParams(temperature=0, logit_bias={42: 100.0}),
        SamplingParams(temperature=0, logit_bias={int(best[2]): -math.inf}),  # banned: runner-up wins
        SamplingParams(temperature=0.7),
    ]
    for step in range(20):
        out = sampler(logits, batch_of(params, steps=[step] * 4))
        assert out.token_ids[:2].tolist() == [42, 42]
        assert out.token_ids[2] == logits[2].topk(2).indices[1]
    with pytest.raises(ValueError, match="logit_bias"):
        sampler(logits, batch_of([SamplingParams(logit_bias={100: 1.0})] * 4))


def test_logprobs_are_raw_log_softmax_with_sorted_top_k():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 80, generator=g).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.3, logprobs=4),
        SamplingParams(temperature=0, logit_bias={9: 5.0}, logprobs=0),
        SamplingParams(),  # asked for none; still gets K columns
    ]
    histories = [((1, 2, 3), (4,)), ((), ()), ((), ())]
    out = sampler(logits, batch_of(params, histories=histories))
    want = logits.float().log_softmax(-1)
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.shape == (3, 4)
    torch.testing.assert_close(out.logprobs, want.gather(1, out.token_ids[:, None]).squeeze(1))
    torch.testing.assert_close(out.top_logprobs, want.gather(1, out.top_token_ids))
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert torch.equal(out.top_token_ids[:, 0], want.argmax(-1))
    assert out.token_ids[1] == 9  # processed distribution drives the choice, not the logprobs
    only_chosen = sampler(logits, batch_of([SamplingParams(logprobs=0)] * 3))
    assert only_chosen.top_token_ids.shape == (3, 0) and only_chosen.logprobs.shape == (3,)


# --- filters against a per-row python reference -------------------------------------


def reference_kept(row: list[float], p: SamplingParams) -> set[int]:
    """The token ids one row may sample: temperature, top-k, top-p, min-p, plainly."""
    x = [v / p.temperature for v in row]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    kept = set(order[: p.top_k] if p.top_k > 0 else order)
    if p.top_p < 1.0:
        z = sum(math.exp(x[i]) for i in kept)
        mass, top_p_set = 0.0, set()
        for i in (i for i in order if i in kept):
            top_p_set.add(i)
            mass += math.exp(x[i]) / z
            if mass >= p.top_p:
                break
        kept = top_p_set
    if p.min_p > 0.0:
        best = max(x)
        kept = {i for i in kept if math.exp(x[i] - best) >= p.min_p}
    return kept


FILTER_CASES = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=1),
    SamplingParams(top_k=7),
    SamplingParams(top_k=1000),  # larger than the vocabulary: off
    SamplingParams(top_p=0.3),
    SamplingParams(top_p=0.9, temperature=2.0),
    SamplingParams(min_p=0.2),
    SamplingParams(min_p=0.05, temperature=0.5),
    SamplingParams(top_k=20, top_p=0.6),
    SamplingParams(top_k=10, top_p=0.95, min_p=0.1, temperature=1.3),
]


@pytest.mark.parametrize("use_top_p", [True, False])
@pytest.mark.parametrize("top_p_widths", [(), (4, 16)])
def test_filters_keep_exactly_the_reference_set(use_top_p, top_p_widths, monkeypatch):
    # One batch mixes all cases, so per-row parameters must not leak across rows.
    # With top-p widths (4, 16) for 64 tokens, rows find their cut among the best
    # 4, the best 16 or only in the full sort.
    monkeypatch.setattr(sampler_module, "_CPU_TOP_P_WIDTHS", top_p_widths)
    cases = [p for p in FILTER_CASES if use_top_p or p.top_p == 1.0]
    logits = torch.randn(len(cases), 64, generator=torch.Generator().manual_seed(4)) * 2
    out = filter_logits(logits, tuple(cases))
    for row, p in enumerate(cases):
        got = set(torch.nonzero(out[row].isfinite()).flatten().tolist())
        assert got == reference_kept(logits[row].tolist(), p), p
        kept = out[row].isfinite()
        torch.testing.assert_close(out[row][kept], logits[row][kept] / p.temperature)


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]])
    out = filter_logits(logits, (SamplingParams(top_k=2),))
    assert out.isfinite().tolist() == [[True, True, True, True, False]]


# --- penalties ----------------------------------------------------------------------


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 3)
    histories = [((0, 1), (2, 2, 3))] * 3
    params = (
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # no penalties: untouched
    )
    out = apply_penalties(logits, params, tuple(histories))
    # Repetition over prompt + output {0, 1, 2, 3}: positive / 2, negative * 2.
    assert out[0].tolist() == [1.0, -2.0, 0.25, 1.5, -2.0, 1.0]
    # Output only: token 2 twice (0.5 + 2 * 0.25), token 3 once (0.5 + 0.25); prompt ignored.
    assert out[1].tolist() == [2.0, -1.0, -0.5, 2.25, -2.0, 1.0]
    assert out[2].tolist() == logits[2].tolist()


def test_penalties_ignore_out_of_vocab_history():
    out = apply_penalties(torch.ones(1, 4), (SamplingParams(frequency_penalty=1.0),), (((), (3, 9, -1)),))
    assert out.tolist() == [[1.0, 1.0, 1.0, 0.0]]


# --- randomness ---------------------------------------------------------------------


def noise_reference(seed: int, step: int, vocab_id: int) -> float:
    """uniform_noise in plain Python integers: splitmix64 for the key, two lowbias32 rounds."""
    m64, m32 = (1 << 64) - 1, (1 << 32) - 1

    def mix64(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
        return z ^ (z >> 31)

    def mix32(z: int) -> int:
        z = ((z ^ (z >> 16)) * 0x21F0AAAD) & m32
        z = ((z ^ (z >> 15)) * 0xD35A2D97) & m32
        return z ^ (z >> 15)

    key = mix64((mix64(seed & m64) + step * 0x9E3779B97F4A7C15) & m64)
    h = mix32(mix32((vocab_id + key) & m32) ^ (key >> 32))
    return ((h >> 9) + 0.5) / (1 << 23)


def noise(seeds, steps, vocab_size: int) -> torch.Tensor:
    return uniform_noise(torch.tensor(row_keys(list(seeds), list(steps))), vocab_size)


def test_uniform_noise_matches_a_pure_python_reference():
    seeds, steps = [0, 1, 2**63 - 1, -5, 2**70 + 3], [0, 3, 1000, 7, 1]
    u = noise(seeds, steps, 50)
    for r, (seed, step) in enumerate(zip(seeds, steps)):
        assert u[r].tolist() == [noise_reference(seed, step, v) for v in range(50)]
    big = noise([7], [0], 200_000)
    assert 0.0 < big.min() and big.max() < 1.0
    assert abs(big.mean().item() - 0.5) < 0.003 and abs(big.std().item() - 12**-0.5) < 0.003
    # Neighbouring vocab ids, seeds and steps must be uncorrelated.
    grid = noise(range(1000), [0] * 1000, 1000)
    steps = noise([5] * 1000, range(1000), 1000)
    for a, b in [(grid[:, :-1], grid[:, 1:]), (grid[:-1], grid[1:]), (steps[:-1], steps[1:])]:
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < 0.01


def test_seeded_row_is_independent_of_batch_and_position():
    V, steps = 500, 12
    g = torch.Generator().manual_seed(5)
    logits = [torch.randn(V, generator=g) for _ in range(steps)]
    mine = SamplingParams(temperature=1.2, top_k=40, seed=1234)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.8, logprobs=3),
        SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, logit_bias={1: 3.0}),
        SamplingParams(min_p=0.1, temperature=0.5),
    ]

    def run(position: int, with_others: bool) -> list[int]:
        tokens = []
        for step in range(steps):
            rows = [mine] if not with_others else others[:position] + [mine] + others[position:]
            x = torch.randn(len(rows), V, generator=g)
            x[position] = logits[step]
            seeds = [99 + i for i in range(len(rows))]
            seeds[position] = 1234
            hist = [((1, 2), (3, 4, 4))] * len(rows)
            out = sampler(x, batch_of(rows, seeds=seeds, steps=[step] * len(rows), histories=hist))
            tokens.append(int(out.token_ids[position]))
        return tokens

    alone = run(0, with_others=False)
    assert run(0, with_others=True) == alone
    assert run(3, with_others=True) == alone
    assert len(set(alone)) > 1  # actually random across steps


def test_a_prepared_batch_samples_exactly_as_an_unprepared_one():
    """``prepare`` (columns and noise queued before the logits exist, as for a step whose masks come
    late) changes nothing: the same tokens and logprobs, masked or not; a plain greedy batch needs none."""
    V = 300
    g = torch.Generator().manual_seed(11)
    rows = [SamplingParams(temperature=0.9, seed=3), SamplingParams(temperature=0),
            SamplingParams(top_p=0.7, top_k=50, logprobs=2), SamplingParams(min_p=0.05, temperature=1.3)]
    batch = batch_of(rows, seeds=[7, 8, 9, 10], steps=[0, 4, 2, 9])
    mask = torch.rand(len(rows), V, generator=g) < 0.3
    for token_mask in (None, mask):
        for _ in range(5):
            x = torch.randn(len(rows), V, generator=g)
            plain = sampler(x, batch, token_mask)
            prepared = sampler(x, batch, token_mask, sampler.prepare(batch, V, x.device))
            assert prepared.token_ids.tolist() == plain.token_ids.tolist()
            assert torch.equal(prepared.top_logprobs, plain.top_logprobs)
            if token_mask is not None:
                assert all(token_mask[r, t] for r, t in enumerate(plain.token_ids.tolist()))
    assert sampler.prepare(batch_of([SamplingParams(temperature=0)] * 2), V, torch.device("cpu")) is None


def test_different_seeds_draw_differently():
    logits = torch.zeros(1, 1000)  # uniform: any shared pattern would show
    draws = {}
    for seed in (1, 2, 3):
        batches = [batch_of([SamplingParams()], seeds=[seed], steps=[step]) for step in range(30)]
        draws[seed] = [int(sampler(logits, b).token_ids) for b in batches]
    assert draws[1] != draws[2] != draws[3] != draws[1]
    assert sum(a == b for a, b in zip(draws[1], draws[2])) < 3


def reference_probs(row: list[float], p: SamplingParams) -> list[float]:
    kept = reference_kept(row, p)
    w = [math.exp(v / p.temperature) if i in kept else 0.0 for i, v in enumerate(row)]
    return [v / sum(w) for v in w]


def chi_square_bound(df: int, z: float = 4.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at a z-sigma tail (~3e-5)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.5, top_k=4),
        SamplingParams(top_p=0.8),
        SamplingParams(min_p=0.15),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
    ],
)
@pytest.mark.parametrize("vary", ["step", "seed"])
def test_sampled_frequencies_match_the_distribution(params, vary):
    row = [1.0, 0.4, 2.0, -0.5, 1.5, 0.0, -1.0, 0.8]
    n = 20_000
    seeds = [77] * n if vary == "step" else list(range(n))
    steps = list(range(n)) if vary == "step" else [0] * n
    out = sampler(torch.tensor([row] * n), batch_of([params] * n, seeds=seeds, steps=steps))
    counts = torch.bincount(out.token_ids, minlength=len(row)).tolist()
    probs = reference_probs(row, params)
    assert all(c == 0 for c, p in zip(counts, probs) if p == 0.0)
    support = [(c, p) for c, p in zip(counts, probs) if p > 0.0]
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in support)
    assert stat < chi_square_bound(len(support) - 1), (counts, probs)
