"""Shared by the kernel tests: kernels run under Triton's CPU interpreter unless a GPU run says otherwise."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def bf16_rounds_to_nearest(monkeypatch):
    """Make the interpreter round fp32 -> bf16 casts to nearest even, as GPUs do.

    Triton 3.6's interpreter truncates them instead, which puts a 1-ulp error on about
    half of all bf16 outputs and would hide whether a kernel rounds at the right
    places. With this, bf16 kernels can be held to (nearly) bit-exact agreement.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return  # compiled kernels round correctly already
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl",
                        rounding_cast(interpreter.InterpreterBuilder.cast_impl))


@pytest.fixture
def exact_bf16_in_interpreter(bf16_rounds_to_nearest, monkeypatch):
    """bf16 as a GPU computes it: casts rounded to nearest (``bf16_rounds_to_nearest``) and the
    interpreter's bf16 `tl.dot` multiplying numbers, not their bits (``dot_of_values``)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot_of_values)


def rounding_cast(truncating):
    """The interpreter's ``cast_impl`` with fp32 -> bf16 rounded to nearest even (``truncating`` otherwise)."""
    import triton.language as tl
    from triton.runtime import interpreter

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return truncating(self, src, dst_type)

    return cast_impl


def dot_of_values(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's ``create_dot`` multiplying bf16 numbers, as a GPU does.

    Triton 3.6's interpreter hands bf16 operands to numpy as their raw uint16 bits, so
    a bf16 dot comes out as a product of integers; the GPU multiplies bf16 values exactly
    and accumulates in fp32, which widening the bits to fp32 reproduces.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    def as_float(h):
        return (h.data.astype(np.uint32) << 16).view(np.float32) if h.dtype.scalar == tl.bfloat16 else h.data

    return interpreter.TensorHandle(np.matmul(as_float(a), as_float(b), dtype=d.data.dtype) + d.data, d.dtype.scalar)


def assert_bf16_nearly_exact(actual, expected, min_exact=0.99):
    """At most 1 bf16 ulp apart everywhere, and bit-equal on at least `min_exact` of the elements.

    Kernel and reference compute the same fp32 formula; only the order of a sum or an
    ulp of exp/cos can differ, which rarely moves a value across a bf16 rounding boundary.
    """
    assert actual.dtype == expected.dtype == torch.bfloat16 and actual.shape == expected.shape
    # Same-sign bf16 values are ordered like their bit patterns, so the difference counts ulps.
    ulps = (actual.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert ulps.max() <= 1
    assert (ulps == 0).float().mean() >= min_exact


