"""moe_gemv.py: the few-token GEMV path and the one-row MoE sublayer against their references."""

import pytest
import torch

from spark.engine.kernels import fused_moe, moe_gemv, moe_routing
from tests.engine.kernels.conftest import assert_bf16_nearly_exact
from tests.engine.kernels.moe_inputs import MIXTRAL_SMALL, QWEN3_MOE_SMALL, make_moe

pytestmark = pytest.mark.usefixtures("exact_bf16_in_interpreter")  # bf16 as on a GPU (conftest)


# Small blocks: the K loops take several steps (gate/up 128 / 32, 192 / 64), the down's last one
# ragged (96 / 64, 448 / 128), and a last column block partial (the gate/up's 96 outputs in blocks
# of 64, the down's 192 in blocks of 128).
SMALL_BLOCKS = dict(gate_up=dict(BLOCK_N=64, BLOCK_K=32, num_warps=2),
                    down=dict(BLOCK_N=64, BLOCK_K=64, num_warps=4))
SMALL_BLOCKS_MIXTRAL = dict(gate_up=dict(BLOCK_N=64, BLOCK_K=64, num_warps=2),
                            down=dict(BLOCK_N=128, BLOCK_K=128, num_warps=4))


@pytest.mark.parametrize("tokens", [1, 2, 4])
@pytest.mark.parametrize("shape", [QWEN3_MOE_SMALL, MIXTRAL_SMALL], ids=["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("small_blocks", [False, True])
def test_gemv_matches_reference_fp32(tokens, shape, small_blocks):
    experts, k, hidden, inter = shape
    config = (SMALL_BLOCKS if shape == QWEN3_MOE_SMALL else SMALL_BLOCKS_MIXTRAL) if small_blocks else None
    x, w13, w2, weights, ids = make_moe(tokens, experts, k, hidden, inter, seed=tokens)
    out = moe_gemv.fused_moe_gemv_triton(x, w13, w2, weights, ids.to(torch.int32), config)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, fused_moe.fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 2, 4])
@pytest.mark.parametrize("shape", [QWEN3_MOE_SMALL, MIXTRAL_SMALL], ids=["qwen3_moe", "mixtral"])
def test_gemv_bf16_rounds_as_the_reference(tokens, shape):
    # Gate and up rounded before the SwiGLU, each pick's product before its weight, as the
    # reference: only the order of fp32 sums differs.
    experts, k, hidden, inter = shape
    x, w13, w2, weights, ids = make_moe(tokens, experts, k, hidden, inter, torch.bfloat16, seed=tokens)
    assert_bf16_nearly_exact(moe_gemv.fused_moe_gemv_triton(x, w13, w2, weights, ids),
                             fused_moe.fused_moe_reference(x, w13, w2, weights, ids), min_exact=0.98)


def test_gemv_repeated_expert_within_a_token():
    # A token may pick one expert twice (the reference allows it): both picks count.
    x, w13, w2, weights, ids = make_moe(2, 8, 4, 64, 32, used=[5], seed=9)
    torch.testing.assert_close(moe_gemv.fused_moe_gemv_triton(x, w13, w2, weights, ids),
                               fused_moe.fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_gemv_token_does_not_depend_on_its_batch():
    # One program per token and output block, the picks summed in one order: a token's bits are
    # the same alone and in a batch (batch-invariant within the GEMV path).
    x, w13, w2, weights, ids = make_moe(4, *QWEN3_MOE_SMALL, torch.bfloat16, seed=4)
    batch = moe_gemv.fused_moe_gemv_triton(x, w13, w2, weights, ids)
    for t in range(4):
        alone = moe_gemv.fused_moe_gemv_triton(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1])
        assert torch.equal(alone, batch[t:t + 1])


def make_one_row(tokens, shape, dtype, seed):
    """(h [T, D], norm weight [D], router [E, D], w13, w2, top-k) of ``shape`` (experts, top-k, D, I); a router
    wide enough that the kernel's and the reference's logits pick the same experts."""
    experts, k, hidden, inter = shape
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype)
    norm_weight = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    router = (4 * torch.randn(experts, hidden, generator=g) / hidden**0.5).to(dtype)
    _, w13, w2, _, _ = make_moe(tokens, experts, k, hidden, inter, dtype, seed=seed)
    return h, norm_weight, router, w13, w2, k


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("shape", [QWEN3_MOE_SMALL, MIXTRAL_SMALL], ids=["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_one_row_matches_reference_fp32(tokens, shape, renormalize):
    h, norm_weight, router, w13, w2, k = make_one_row(tokens, shape, torch.float32, seed=tokens)
    out = moe_gemv.moe_one_row_triton(h, norm_weight, 1e-6, router, w13, w2, k, renormalize)
    assert out.shape == h.shape and out.dtype == h.dtype
    want = moe_gemv.moe_one_row_reference(h, norm_weight, 1e-6, router, w13, w2, k, renormalize)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_one_row_reference_is_the_unfused_layer():
    # norm, router, route, experts, residual add, each as the generic path computes it (fp32: the
    # norm's roundings do not matter).
    from spark.engine.kernels import norm

    h, norm_weight, router, w13, w2, k = make_one_row(2, QWEN3_MOE_SMALL, torch.float32, seed=7)
    x = norm.rms_norm_reference(h, norm_weight, 1e-6)
    weights, ids = moe_routing.route(x @ router.T, k, True)
    torch.testing.assert_close(moe_gemv.moe_one_row_reference(h, norm_weight, 1e-6, router, w13, w2, k, True),
                               h + fused_moe.fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [QWEN3_MOE_SMALL, MIXTRAL_SMALL], ids=["qwen3_moe", "mixtral"])
def test_one_row_bf16_rounds_as_the_reference(shape):
    h, norm_weight, router, w13, w2, k = make_one_row(1, shape, torch.bfloat16, seed=3)
    assert_bf16_nearly_exact(moe_gemv.moe_one_row_triton(h, norm_weight, 1e-6, router, w13, w2, k, True),
                             moe_gemv.moe_one_row_reference(h, norm_weight, 1e-6, router, w13, w2, k, True),
                             min_exact=0.98)


def test_gate_up_routes_as_route_triton():
    # The ids and weights the gate/up kernel stores for the down kernel are route_triton's, bit for bit.
    h, norm_weight, router, w13, w2, k = make_one_row(2, QWEN3_MOE_SMALL, torch.bfloat16, seed=5)
    logits = (3 * torch.randn(2, w13.shape[0], generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    ids = torch.empty(2 * k, dtype=torch.int32)
    weights = torch.empty(2 * k)
    moe_gemv._launch_gemvs(h, w13, w2, k, ids, weights, logits=logits, renormalize=True)
    want_w, want_i = moe_routing.route_triton(logits, k, True)
    assert torch.equal(ids, want_i.reshape(-1)) and torch.equal(weights, want_w.reshape(-1))


@pytest.mark.parametrize("routed", [True, False], ids=["from_logits", "from_ids"])
def test_one_token_of_small_experts_routed_or_given(routed):
    # One token of small experts (gemv_config's one-warp shapes): the down kernel reads the ids and
    # weights gate/up wrote from the logits, or the ones given; the same sums either way.
    experts, k, hidden, inter = QWEN3_MOE_SMALL
    h, norm_weight, router, w13, w2, _ = make_one_row(1, QWEN3_MOE_SMALL, torch.float32, seed=11)
    logits = h @ router.T
    weights, ids = moe_routing.route(logits, k, True)
    flat_ids, flat_weights = ids.reshape(-1).to(torch.int32), weights.reshape(-1)
    if routed:  # garbage in: gate/up writes them from the logits
        flat_ids, flat_weights = torch.full_like(flat_ids, -1), torch.full_like(flat_weights, float("nan"))
    got = moe_gemv._launch_gemvs(h, w13, w2, k, flat_ids, flat_weights, logits=logits if routed else None,
                                 renormalize=True)
    torch.testing.assert_close(got, fused_moe.fused_moe_reference(h, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
