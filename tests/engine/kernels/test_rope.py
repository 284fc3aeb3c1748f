import os

# Before anything can JIT a kernel: @triton.jit picks interpreter or compiler when it
# runs, and spark's kernels are only decorated at their first launch.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from spark.engine.kernels.rope import apply_rope_reference, apply_rope_triton
from spark.engine.models import llama
from tests.engine.kernels.conftest import assert_bf16_nearly_exact


def _inv_freq(head_dim, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))


def _qkv(positions, num_heads, num_kv_heads, head_dim, dtype=torch.float32, seed=0):
    """q and k as strided views of one fused [T, H + 2*Hkv, Dh] projection output, and that buffer."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(len(positions), num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q, k = fused[:, :num_heads], fused[:, num_heads : num_heads + num_kv_heads]
    return q, k, fused


# Prefill from 0, a continued chunk, decode positions, and long-context angles (~1e5 rad).
POSITIONS = torch.tensor([0, 1, 2, 3, 17, 18, 19, 511, 4096, 32767, 131071])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_llama_apply_rope(dtype):
    q, k, _ = _qkv(POSITIONS, 9, 3, 64, dtype)
    inv_freq = _inv_freq(64)
    # The model's way: cos/sin once per step, then one rotation per tensor.
    freqs = POSITIONS.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    q_out, k_out = apply_rope_reference(q, k, POSITIONS, inv_freq)
    assert torch.equal(q_out, llama.apply_rope(q, cos, sin)) and torch.equal(k_out, llama.apply_rope(k, cos, sin))


def test_reference_rotates_by_position():
    # Position 0 is the identity; a rotation keeps each (x1, x2) pair's norm.
    q, k, _ = _qkv(POSITIONS, 2, 1, 32)
    q_out, _ = apply_rope_reference(q, k, POSITIONS, _inv_freq(32))
    torch.testing.assert_close(q_out[0], q[0], rtol=0, atol=0)
    def pair_norm(x):
        return x[..., :16] ** 2 + x[..., 16:] ** 2

    torch.testing.assert_close(pair_norm(q_out), pair_norm(q))
    assert not torch.allclose(q_out[1:], q[1:])


# (H, Hkv, Dh): GQA groups 3 and 4, MHA, head_dim 64 and 128.
HEADS = [(9, 3, 64), (8, 2, 128), (4, 4, 64)]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", HEADS)
def test_triton_matches_reference(num_heads, num_kv_heads, head_dim):
    q, k, _ = _qkv(POSITIONS, num_heads, num_kv_heads, head_dim)
    inv_freq = _inv_freq(head_dim, theta=500000.0)
    q_out, k_out = apply_rope_triton(q, k, POSITIONS, inv_freq)
    q_ref, k_ref = apply_rope_reference(q, k, POSITIONS, inv_freq)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == q.dtype
    # The angles are the same fp32 products; cos/sin (numpy's here, libdevice's on the
    # GPU, torch's in the reference) differ by ~1-2 fp32 ulps, so results agree to ~1e-6.
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)


def test_triton_in_place_on_a_fused_buffer():
    q, k, fused = _qkv(POSITIONS, 9, 3, 64)
    v_before = fused[:, 12:].clone()
    q_ref, k_ref = apply_rope_reference(q, k, POSITIONS, _inv_freq(64))
    q_out, k_out = apply_rope_triton(q, k, POSITIONS, _inv_freq(64), inplace=True)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    torch.testing.assert_close(fused[:, :9], q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[:, 9:12], k_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused[:, 12:], v_before)  # v, between and after the views, untouched


def test_triton_bf16(bf16_rounds_to_nearest):
    q, k, _ = _qkv(POSITIONS, 9, 3, 64, torch.bfloat16)
    q_out, k_out = apply_rope_triton(q, k, POSITIONS, _inv_freq(64))
    q_ref, k_ref = apply_rope_reference(q, k, POSITIONS, _inv_freq(64))
    assert_bf16_nearly_exact(q_out, q_ref)
    assert_bf16_nearly_exact(k_out, k_ref)


def test_triton_no_tokens():
    q, k, _ = _qkv(torch.zeros(0, dtype=torch.int64), 4, 2, 64)
    q_out, k_out = apply_rope_triton(q, k, torch.zeros(0, dtype=torch.int64), _inv_freq(64))
    assert q_out.shape == (0, 4, 64) and k_out.shape == (0, 2, 64)
