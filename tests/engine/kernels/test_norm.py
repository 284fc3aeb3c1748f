import os

# Before anything can JIT a kernel: @triton.jit picks interpreter or compiler when it
# runs, and spark's kernels are only decorated at their first launch.
os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest
import torch

from tests.engine.kernels.conftest import assert_bf16_nearly_exact
from spark.engine.kernels.norm import (
    add_rms_norm_reference,
    add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from spark.engine.models.llama import RMSNorm
from spark.engine.models.ops import TorchOps

EPS = 1e-5


def _rows(num_tokens, dim, dtype=torch.float32, seed=0):
    """x and residual as strided row views of wider buffers (like slices of a fused output), and a weight."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, dim + 8, generator=gen)[:, 3 : 3 + dim]
    residual = (4 * torch.randn(num_tokens, 2 * dim, generator=gen))[:, :dim]
    weight = 1 + 0.5 * torch.randn(dim, generator=gen)
    return x.to(dtype), residual.to(dtype), weight.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_llama_rmsnorm(dtype):
    x, residual, weight = _rows(5, 576, dtype)
    module = RMSNorm(576, EPS, TorchOps()).to(dtype)
    module.weight.data.copy_(weight)
    with torch.no_grad():
        assert torch.equal(rms_norm_reference(x, weight, EPS), module(x))
        # The fused add is the eager block's `h = x + attn_out` followed by the next norm.
        h = x + residual
        normed, new_residual = add_rms_norm_reference(x, residual, weight, EPS)
        assert torch.equal(new_residual, h) and torch.equal(normed, module(h))


def test_reference_rounds_before_the_weight():
    # HF rounds x / rms to bf16 and then multiplies by the weight; rounding once at the
    # end gives different bits on some elements, so this pins the order.
    x, _, weight = _rows(4, 576, torch.bfloat16)
    xf = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    rounded_once = (weight.float() * xf).bfloat16()
    assert not torch.equal(rms_norm_reference(x, weight, EPS), rounded_once)


# Ragged row counts; D from a small head_dim (qk-norm) through SmolLM's 576 to 8192.
SHAPES = [(1, 64), (7, 576), (3, 4096), (2, 8192)]


@pytest.mark.parametrize("num_tokens, dim", SHAPES)
def test_triton_matches_reference(num_tokens, dim):
    x, residual, weight = _rows(num_tokens, dim)
    out = rms_norm_triton(x, weight, EPS)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens, dim", SHAPES)
def test_add_triton_matches_reference(num_tokens, dim):
    x, residual, weight = _rows(num_tokens, dim, seed=dim)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = add_rms_norm_triton(x, residual, weight, EPS)
    expected_normed, expected_residual = add_rms_norm_reference(x, residual, weight, EPS)
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, expected_normed, rtol=1e-5, atol=1e-5)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched


@pytest.mark.parametrize("parts", [2, 4])
def test_add_of_split_k_partials(parts, bf16_rounds_to_nearest):
    """x as fp32 split-K partials [S, T, D]: summed, rounded to the residual's bf16 as the
    unsplit projection rounds its output, then added; the reference does the same."""
    _, residual, weight = _rows(6, 576, torch.bfloat16, seed=parts)
    partials = torch.randn(parts, 6, 576, generator=torch.Generator().manual_seed(parts))
    normed, new_residual = add_rms_norm_triton(partials, residual, weight, EPS)
    expected_normed, expected_residual = add_rms_norm_reference(partials, residual, weight, EPS)
    assert new_residual.dtype == normed.dtype == torch.bfloat16 and new_residual.shape == (6, 576)
    assert torch.equal(new_residual, expected_residual)
    assert_bf16_nearly_exact(normed, expected_normed)
    # ... and every partial counts: the first alone gives another stream.
    assert not torch.equal(new_residual, add_rms_norm_reference(partials[0], residual.float(), weight, EPS)[1].bfloat16())


@pytest.mark.parametrize("num_tokens, dim", [(9, 576), (2, 4096)])
def test_triton_bf16(num_tokens, dim, bf16_rounds_to_nearest):
    x, residual, weight = _rows(num_tokens, dim, torch.bfloat16)
    assert_bf16_nearly_exact(rms_norm_triton(x, weight, EPS), rms_norm_reference(x, weight, EPS))
    normed, new_residual = add_rms_norm_triton(x, residual, weight, EPS)
    expected_normed, expected_residual = add_rms_norm_reference(x, residual, weight, EPS)
    # The sum is rounded to bf16 exactly as eager torch rounds it.
    assert torch.equal(new_residual, expected_residual)
    assert_bf16_nearly_exact(normed, expected_normed)


def test_triton_leading_dims_and_empty():
    # Qwen3's per-head q/k norm hands over [T, H, Dh]; every row is normalised alone.
    x = torch.randn(3, 4, 64)
    weight = torch.rand(64) + 0.5
    out = rms_norm_triton(x, weight, EPS)
    assert out.shape == x.shape
    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS), rtol=1e-5, atol=1e-5)
    empty = torch.empty(0, 576)
    assert rms_norm_triton(empty, torch.ones(576), EPS).shape == (0, 576)
    normed, new_residual = add_rms_norm_triton(empty, empty, torch.ones(576), EPS)
    assert normed.shape == new_residual.shape == (0, 576)
