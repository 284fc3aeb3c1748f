"""fused_moe.py: the reference, the alignment, the grouped GEMMs and the choice between them and moe_gemv.py."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from spark.engine.kernels import fused_moe as fm  # noqa: E402
from spark.engine.kernels import moe_gemv  # noqa: E402
from tests.engine.kernels.moe_inputs import MIXTRAL_SMALL, make_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_bf16_in_interpreter")  # bf16 as on a GPU (conftest)


def naive(x, w13, w2, weights, ids):
    """Token by token, pick by pick, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            w = w13[ids[t, j]].double()
            h = x[t].double() @ w.T
            out[t] += weights[t, j].double() * (w2[ids[t, j]].double() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("used", [None, [1, 6]])  # all experts, or most with zero tokens
def test_reference_matches_naive(used):
    x, w13, w2, weights, ids = make_moe(7, 8, 3, 32, 24, used=used)
    torch.testing.assert_close(fm.fused_moe_reference(x, w13, w2, weights, ids).double(),
                               naive(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def check_alignment(sorted_slots, block_expert, ids, num_experts, block):
    """Every slot once, in a block of its expert; blocks of one expert ascending; padding and tail marked."""
    flat = ids.reshape(-1)
    n = flat.numel()
    rows, blocks = fm.aligned_sizes(n, num_experts, block)
    assert sorted_slots.shape == (rows,) and block_expert.shape == (blocks,)
    real = sorted_slots < n
    assert sorted(sorted_slots[real].tolist()) == list(range(n))
    assert (sorted_slots[~real] == n).all()
    owner = block_expert.long().repeat_interleave(block)
    assert (owner[real] == flat[sorted_slots[real].long()]).all()
    used = block_expert[block_expert >= 0]
    assert (used[1:] >= used[:-1]).all()  # experts in order, each run of blocks contiguous
    assert int((block_expert >= 0).sum()) == sum(-(-c // block) for c in torch.bincount(flat, minlength=num_experts).tolist())


@pytest.mark.parametrize("tokens, experts, k, used", [
    (1, 8, 2, None), (1, 128, 8, None), (9, 8, 2, [0, 7]), (40, 16, 4, None), (5, 6, 3, [2])])
def test_align_triton_matches_reference(tokens, experts, k, used):
    ids = make_moe(tokens, experts, k, 16, 16, used=used)[4]
    want = fm.align_reference(ids, experts, 16)
    check_alignment(*want, ids, experts, 16)
    got = fm.align_triton(ids, experts, 16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# (tokens, experts, top-k, D, I, experts in use): decode's 1 token; a widths below one tile and
# not a multiple of it; experts with no token; one expert taking every pick, repeats within a token.
SHAPES = [(1, 8, 2, 64, 32, None), (5, 8, 4, 96, 48, [0, 3, 5]), (17, 4, 2, 64, 80, None), (6, 8, 3, 32, 16, [4])]


@pytest.mark.parametrize("tokens, experts, k, hidden, inter, used", SHAPES)
def test_triton_matches_reference_fp32(tokens, experts, k, hidden, inter, used):
    # The grouped GEMMs called directly: at 1 token the dispatch would take the GEMVs.
    x, w13, w2, weights, ids = make_moe(tokens, experts, k, hidden, inter, used=used, seed=tokens)
    out = fm.fused_moe_grouped_triton(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, fm.fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_triton_bf16():
    x, w13, w2, weights, ids = make_moe(6, 8, 2, 64, 32, torch.bfloat16, seed=3)
    assert fm.moe_path(6, 2, 8) == "grouped"
    out, ref = fm.fused_moe_triton(x, w13, w2, weights, ids), fm.fused_moe_reference(x, w13, w2, weights, ids)
    # The reference rounds gate/up to bf16 before the silu; the kernel keeps them in fp32.
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert (out.float() - naive(x, w13, w2, weights, ids).float()).abs().max() < 5e-2


def test_many_slots_align_by_sort(monkeypatch):
    # Past _ALIGN_IN_ONE_PROGRAM slots the torch alignment runs: the same layout, the same output.
    monkeypatch.setattr(fm, "_ALIGN_IN_ONE_PROGRAM", 8)
    x, w13, w2, weights, ids = make_moe(12, 8, 2, 32, 16, seed=5)
    torch.testing.assert_close(fm.fused_moe_triton(x, w13, w2, weights, ids),
                               fm.fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens, k, experts, path", [
    (1, 8, 128, "gemv"), (4, 8, 128, "gemv"), (8, 8, 128, "grouped"), (64, 8, 128, "grouped"),  # Qwen3-MoE
    (1, 2, 8, "gemv"), (2, 2, 8, "gemv"), (3, 2, 8, "grouped"), (64, 2, 8, "grouped"),  # Mixtral
])
def test_moe_path_by_the_shapes(tokens, k, experts, path):
    assert fm.moe_path(tokens, k, experts) == path


@pytest.mark.parametrize("tokens, path", [(1, "gemv"), (2, "gemv"), (8, "grouped")])
def test_fused_moe_triton_dispatches_by_token_count(monkeypatch, tokens, path):
    taken = []
    for name, module in (("gemv", moe_gemv), ("grouped", fm)):  # where fused_moe_triton looks each up
        real = getattr(module, f"fused_moe_{name}_triton")
        monkeypatch.setattr(module, f"fused_moe_{name}_triton",
                            lambda *a, name=name, real=real: taken.append(name) or real(*a))
    x, w13, w2, weights, ids = make_moe(tokens, *MIXTRAL_SMALL[:2], 64, 32, seed=tokens)
    out = fm.fused_moe_triton(x, w13, w2, weights, ids)
    assert taken == [path]
    torch.testing.assert_close(out, fm.fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
