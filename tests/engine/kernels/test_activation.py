import os

# Before anything can JIT a kernel: @triton.jit picks interpreter or compiler when it
# runs, and spark's kernels are only decorated at their first launch.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

from spark.engine.kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from tests.engine.kernels.conftest import assert_bf16_nearly_exact


def _gate_up(num_tokens, inter, dtype=torch.float32, seed=0):
    """[T, 2*I] fused gate/up output as a strided row view, spread wide enough to reach silu's tails."""
    gen = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(num_tokens, 2 * inter + 5, generator=gen))[:, : 2 * inter].to(dtype)


def test_reference_matches_eager_fp32():
    x = _gate_up(6, 96)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul_reference(x), F.silu(gate) * up)


def test_reference_within_one_ulp_of_eager_bf16():
    # Eager bf16 rounds after the silu and again after the product; the reference rounds
    # once, so about a quarter of the elements sit one bf16 ulp away, none further.
    x = _gate_up(16, 1536, torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    assert_bf16_nearly_exact(silu_and_mul_reference(x), F.silu(gate) * up, min_exact=0.5)


# Ragged token counts; I below, at, and past the 1024-column block (2500: three blocks, the last partial).
SHAPES = [(1, 64), (5, 1536), (3, 2500)]


@pytest.mark.parametrize("num_tokens, inter", SHAPES)
def test_triton_matches_reference(num_tokens, inter):
    x = _gate_up(num_tokens, inter, seed=inter)
    out = silu_and_mul_triton(x)
    assert out.shape == (num_tokens, inter) and out.dtype == x.dtype
    # Same fp32 formula; numpy's exp here (ex2.approx on the GPU) vs torch's differ by ulps.
    torch.testing.assert_close(out, silu_and_mul_reference(x), rtol=1e-5, atol=1e-5)


def test_triton_bf16(bf16_rounds_to_nearest):
    x = _gate_up(8, 1536, torch.bfloat16)
    assert_bf16_nearly_exact(silu_and_mul_triton(x), silu_and_mul_reference(x))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy, by design here
def test_triton_extreme_gates_stay_finite():
    # exp(-g) overflows to inf for g << 0: silu must come out as (-)0, not NaN.
    gate = torch.tensor([[-1000.0, -100.0, 0.0, 100.0, 1000.0]])
    x = torch.cat([gate, torch.full_like(gate, 2.0)], dim=1)
    out = silu_and_mul_triton(x)
    assert out.isfinite().all()
    torch.testing.assert_close(out, silu_and_mul_reference(x))


def test_triton_no_tokens():
    assert silu_and_mul_triton(torch.empty(0, 128)).shape == (0, 64)
