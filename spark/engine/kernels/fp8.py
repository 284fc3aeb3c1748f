"""FP8 (e4m3) KV-cache values: quantize on store, dequantize on load; torch reference and Triton.

A scaled cache holds ``clamp(x / scale, ±448)`` rounded to e4m3 (nearest, ties to even) and
reads back ``stored * scale``, with one fp32 scale per KV head of a layer (``[Hkv]``). The
kernels that write K/V (kv_write.py, rope.py, the fused decode kernel) call ``quantize``;
the attention kernels fold the read's ``* scale`` into the score multiplier (K) and the
output (V), so their key loop only upcasts.

``quantize`` rounds with integer arithmetic rather than by a cast: Triton 3.6's
interpreter converts fp32 to fp8 wrongly where rounding carries into the exponent (7.9
becomes 4.0) and breaks ties away from zero. On exactly representable values every cast
agrees, so the rounded value's cast is the same on a GPU, in the interpreter and in torch.
"""

import functools

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value; e4m3fn has no infinity, an overflowing cast is NaN

# Bound by `jit_quantize()` on first use, never at import (see kv_write.py).
triton = None
tl = None


def quantize_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., Hkv, D]`` as e4m3: ``clamp(x / scale, ±448)`` rounded to nearest even; scale ``[Hkv]`` fp32."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored e4m3 ``x [..., Hkv, D]`` back to values: fp32 upcast times ``scale [Hkv]``, cast to ``dtype``."""
    return (x.float() * scale[:, None]).to(dtype)


@functools.cache
def jit_quantize():
    """JIT and return ``quantize(x, scale)``: fp32 ``x`` divided by ``scale``, clamped to ±448 and rounded
    to the nearest e4m3 value (ties to even), still fp32; the caller casts it to the cache's dtype."""
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def quantize(x, scale):
        x = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        # Normal range (|x| >= 2**-6): keep 3 of fp32's 23 mantissa bits, rounding the 20 dropped
        # ones to nearest even; a carry moves into the exponent, as it should.
        bits = x.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        # Subnormals: multiples of 2**-9. Adding 1.5 * 2**14 puts the 2**-9 place at fp32's last
        # mantissa bit, so the add rounds (to nearest even) and the subtraction is exact; the sign
        # goes back on after, so that what rounds to zero keeps it (-0.0, as torch's cast gives).
        magnitude = (tl.abs(x) + 24576.0) - 24576.0
        subnormal = tl.where(bits < 0, magnitude * -1.0, magnitude)  # not -magnitude: Triton negates as 0 - x
        return tl.where(tl.abs(x) < 0.015625, subnormal, normal)

    return quantize
