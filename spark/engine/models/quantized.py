"""Compact weights for the CPU: linears in 4 or 8 bits, the embedding and the logits head in 8, by torch's own ops.

A model is loaded dense in float32, then ``pack_model`` swaps its modules for these:

- ``Int4Linear`` (the "int4" format): 4-bit weights in groups of 32 along K, each group a
  scale and a zero (``w = (q - 8) * scale + zero``), through ``aten._weight_int4pack_mm_for_cpu``
  on bfloat16 activations. That is a Q4_1 GGUF's own format (``w = q * d + m``): its groups
  come back exactly, only the scale and the zero are rounded to bfloat16.
- ``Int8Linear`` (the "int8" format, and every format's logits head): int8 weights with one
  scale per row, bfloat16 activations (``aten._weight_int8pack_mm``; from 4 rows on, the
  activations in two int8 levels through ``aten._int_mm``); twice the memory of int4, for
  checkpoints whose 16-bit weights 4 bits would round too far.
- ``Int8Embedding``: the token table in the same int8 rows; a tied head shares them.

The weight-only kernels read their weight once for every 4 rows of activations,
dequantizing as they go: a decode step of 8 sequences costs about twice one of 4. fbgemm's dynamic int8 linears (``quantized.linear_dynamic``) scale better, but
quantize each step's activations with one scale for the whole tensor, which SmolLM2's
outlier channels ruin (logits' cosine to float32 below 0.2). A linear whose shape a kernel
cannot take (4 bits: K not a multiple of 32, N of 16) or that has a bias stays dense.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP = 32  # weights per scale along K in the 4-bit format
# The kernels as torch's own functions where the build has them: a few microseconds a call less than
# through ``torch.ops.aten`` (a decode step of SmolLM2 makes 121 such calls).
_int4_mm = getattr(torch, "_weight_int4pack_mm_for_cpu", None) or getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
_int8_mm = getattr(torch, "_weight_int8pack_mm", None) or getattr(torch.ops.aten, "_weight_int8pack_mm", None)
# name -> the activations' dtype the format computes in (None: the runtime's).
FORMATS: dict[str, torch.dtype | None] = {"dense": None, "int4": torch.bfloat16, "int8": torch.bfloat16}
_OPS = {
    "int4": ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu", "_weight_int8pack_mm", "_int_mm"),
    "int8": ("_weight_int8pack_mm", "_int_mm"),
}


def missing_ops(fmt: str) -> list[str]:
    """The torch ops that ``fmt`` needs and this torch build lacks (none for "dense")."""
    return [f"aten.{op}" for op in _OPS.get(fmt, ()) if not hasattr(torch.ops.aten, op)]


class Int4Linear(nn.Module):
    """``x @ W.T`` with W in 4-bit groups of 32 (asymmetric, round to nearest); x bfloat16 [T, K]."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        n, k = weight.shape
        self.in_features, self.out_features = k, n
        g = weight.float().reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)  # [N, K/32]
        scale = (hi - lo) / 15
        q = torch.where(scale[..., None] > 0, (g - lo[..., None]) / scale[..., None], 0).round_().clamp_(0, 15)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).reshape(n, k), 1))  # [N, K/2] uint8 in the kernel's order
        # [K/32, N, 2]: (scale, zero) with w = (q - 8) * scale + zero, so zero = lo + 8 * scale.
        self.register_buffer("scales_zeros", torch.stack((scale, lo + 8 * scale), -1).transpose(0, 1)
                             .contiguous().to(torch.bfloat16))

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        n, k = weight.shape
        return k % GROUP == 0 and n % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _int4_mm(x, self.packed, GROUP, self.scales_zeros)

    def kernel(self):
        """``forward`` as a function that holds the tensors: no module attribute lookups a call."""
        packed, scales_zeros = self.packed, self.scales_zeros
        return lambda x: _int4_mm(x, packed, GROUP, scales_zeros)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float32 scale [N]): symmetric per-row quantization, ``w ~ q * scale``.

    In blocks of rows (each row is its own), so that a 49k-row embedding costs its int8 rows and
    not three float32 temporaries of its size."""
    q, scale = torch.empty(weight.shape, dtype=torch.int8), torch.empty(weight.shape[0])
    step = max(1, (1 << 20) // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], step):
        w = weight[start:start + step].float()
        s = scale[start:start + step] = w.abs().amax(1).clamp_min(1e-12) / 127
        q[start:start + step] = torch.round(w / s[:, None]).clamp_(-127, 127)
    return q, scale


class Int8Linear(nn.Module):
    """``x @ W.T`` with W int8 per row, x bfloat16 [T, K]. The head's may share its rows with the embedding.

    Below ``INT_MM_ROWS`` rows, ``_weight_int8pack_mm``: x stays bf16, the weight is
    dequantized as it streams, once for every 4 rows, its output rounded to bf16. From
    there on the kernel would be compute-bound (8 rows of SmolLM2's head: 11.5 ms, twice 4
    rows'), so x is quantized instead, in two int8 levels (``q1 = round(x / s1)``, then the
    remainder with ``s2 = s1 / 127``: finer than bf16's 8-bit mantissa), and both levels go
    through one ``torch._int_mm`` (oneDNN's int8 GEMM), whose time hardly grows with rows
    (6.6 ms for 8): exact int32 sums, scaled in float32, returned in ``out_dtype``.
    """

    INT_MM_ROWS = 4

    def __init__(self, rows: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None):
        super().__init__()
        self.out_features, self.in_features = rows.shape
        self.out_dtype = out_dtype  # None: x's
        self.register_buffer("rows", rows)
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("scale_f32", scale.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = self.out_dtype or x.dtype
        if x.shape[0] < self.INT_MM_ROWS:
            return _int8_mm(x.to(torch.bfloat16), self.rows, self.scale).to(out_dtype)
        xf = x.float()
        s1 = xf.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127  # [T, 1]
        q1 = torch.round(xf / s1)
        s2 = s1 / 127
        q2 = torch.round((xf - q1 * s1) / s2)
        acc = torch._int_mm(torch.cat((q1, q2)).to(torch.int8), self.rows.t()).float()  # [2T, N]
        rows = x.shape[0]
        return ((acc[:rows] * s1 + acc[rows:] * s2) * self.scale_f32).to(out_dtype)


class Int8Embedding(nn.Module):
    """Token ids [T] -> rows [T, D] in ``dtype``, from int8 rows with one scale each."""

    def __init__(self, rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("rows", rows)
        self.register_buffer("scale", scale[:, None].to(dtype))  # [V, 1]
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows[ids].to(self.dtype) * self.scale[ids]


def _linear(weight: torch.Tensor, fmt: str, dtype: torch.dtype) -> nn.Module:
    if fmt == "int4" and Int4Linear.fits(weight):
        return Int4Linear(weight)
    if fmt == "int8":
        return Int8Linear(*int8_rows(weight))
    dense = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=dtype)
    dense.weight.data.copy_(weight)
    return dense


@torch.no_grad()
def pack_model(net: nn.Module, fmt: str, dtype: torch.dtype) -> nn.Module:
    """Swap the bias-free linears of a loaded float32 Llama-family ``net`` for ``fmt`` ("int4" or "int8"),
    its embedding (and the head) for int8 rows; the other parameters (norms, biases) go to ``dtype``.

    The dense weights are dropped one by one, as each is packed.
    """
    missing = missing_ops(fmt)
    if missing:
        raise ValueError(f"weight format {fmt!r} needs {', '.join(missing)}, which this torch ({torch.__version__}) lacks")
    for owner, name in _dense_linears(net):  # those ``packed_as_loaded`` left, if any
        _pack(owner, name, fmt, dtype)
    rows, scale = int8_rows(net.tok_embeddings.weight)
    net.tok_embeddings = Int8Embedding(rows, scale, dtype)
    # The head: the embedding's own rows when tied, else its own.
    if net.output is not None:
        rows, scale = int8_rows(net.output.weight)
    net.output = Int8Linear(rows, scale, out_dtype=torch.float32)  # logits in float32, as compute_logits gives
    for param in net.parameters():  # norms, biases; not the buffers (the rope's frequencies stay float32)
        param.data = param.data.to(dtype)
    return net


def packed_as_loaded(net: nn.Module, weights, fmt: str, dtype: torch.dtype):
    """``weights`` for ``net.load_weights``, packing each linear as soon as its last tensor is in.

    Then only the linears being loaded are dense at a time, not the whole model in float32
    (SmolLM2-135M: 538 MB); ``pack_model`` packs the rest. A generator resumes after its
    consumer has copied the tensor it yielded, so a count of the tensors still due per
    parameter says when one is whole.
    """
    params = dict(net.named_parameters())
    linears = {id(getattr(owner, name).weight): (owner, name) for owner, name in _dense_linears(net)}
    due: dict[str, int] = {}
    for hf in net.weight_shapes(net.config):
        target = net.weight_target(hf)[0]
        due[target] = due.get(target, 0) + 1
    for hf, tensor in weights:
        yield hf, tensor
        del tensor
        target = net.weight_target(hf)[0]
        due[target] -= 1
        if due[target] == 0 and id(params[target]) in linears:
            _pack(*linears.pop(id(params[target])), fmt, dtype)
            params[target].data = torch.empty(0)  # load_weights still holds the parameter: free its data


def _dense_linears(net: nn.Module):
    """(module, attribute) of every linear of ``net`` that ``fmt`` packs.

    Kept dense: Qwen2's q/k/v with a bias (the kernels take none), and the stacked experts
    of an MoE layer (a Parameter [E, N, K], not a Linear), in the runtime's dtype."""
    for block in net.layers:
        for owner, name in ((block.attention, "wqkv"), (block.attention, "wo"),
                            (block.feed_forward, "w13"), (block.feed_forward, "w2")):
            linear = getattr(owner, name, None)
            if isinstance(linear, nn.Linear) and linear.bias is None:
                yield owner, name


def _pack(owner: nn.Module, name: str, fmt: str, dtype: torch.dtype) -> None:
    setattr(owner, name, _linear(getattr(owner, name).weight, fmt, dtype))
