"""Kernel choice, made once: the ops a model's math calls, as torch references or Triton kernels.

A model holds one ``Ops`` (from its ``Runtime``) and calls ``self.ops.rms_norm(...)``
where it used to ask each tensor ``x.is_cuda``. ``TorchOps`` spells out the math
(the references every kernel is tested against); ``TritonOps`` is the same math in
the GPU kernels, with the fusions that make decode fast: an add fused into the next
norm, projections of 33-64 rows in the small-row kernel (maybe split over K), and
for a one-row step the whole dense block in four small-row launches (an MoE block's experts in
three launches, ``moe_gemv.moe_one_row_triton``), Qwen3's q/k norms inside the decode attention launch. ``CpuOps`` is
the CPU's path: the references, but a decode step's attention in one batched call.
An MoE layer's experts (``moe``) run the loop-over-experts reference on the CPU and
the fused, graph-capturable kernels on the GPU: GEMVs for a few tokens (``kernels/moe_gemv.py``),
grouped GEMMs for more (``kernels/fused_moe.py``).

The ops are plain functions bound on the class, so that a call costs what the old
``if x.is_cuda`` branch did: no wrapper frame on the hot path. Kernels are reached
through their modules at call time (``small_linear.small_linear_triton``), so a
benchmark that swaps a kernel module's function still reaches every caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from spark.engine import attention
from spark.engine.kernels import activation, embedding, fp8, fused_moe, moe_gemv, moe_routing, norm, small_linear
from spark.engine.kv_cache import pages_and_scale

if TYPE_CHECKING:
    from spark.engine.attention import AttentionMetadata

HALF = (torch.bfloat16, torch.float16)
Rope = tuple[torch.Tensor, torch.Tensor]  # what ``Ops.rope`` makes once a step and every layer's ``attend`` reads


class Ops(Protocol):
    """What a model's math may call. Shapes: x [T, D]; q [T, H, Dh]; k, v [T, Hkv, Dh]."""

    fuses_one_row: bool  # has ``block_one_row``: the dense block for a one-token step
    fuses_moe_one_row: bool  # ``block_one_row`` takes an MoE block too
    fuses_qk_norm: bool  # ``attend`` takes ``qk_norm=(q weight, k weight, eps)``: Qwen3's per-head norms, inside

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The rows [T, D] of ``weight`` [V, D] (a plain embedding's) at ``ids`` [T]."""

    def rope(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> Rope: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); x may be ``project``'s split-K partials, summed here."""

    def project(self, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """``linear(x)``, or its split-K partials [S, T, N]: only ever fed to ``add_rms_norm``."""

    def attend(self, q, k, v, rope: Rope, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate q and k, write k, v into the cache, attend over it. Returns [T, H, Dh]: ``out`` (any
        strides) when given, written in place."""

    def swiglu(self, x: torch.Tensor, w13: nn.Linear, w2: nn.Linear) -> torch.Tensor:
        """``w2(silu(gate) * up)`` with ``gate, up = w13(x)`` (w13's rows: gate, then up); may be partials."""

    def moe(self, x: torch.Tensor, router: nn.Linear, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
            renormalize: bool) -> torch.Tensor:
        """Routed experts: each token's top-k of ``softmax(router(x))`` (renormalised if asked), the weighted
        sum of their SwiGLU MLPs (w13 [E, 2I, D], w2 [E, D, I]). Returns [T, D]."""

    def head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The vocabulary scores ``x @ weight.T`` of the head's rows [V, D] (its own, or the tied embedding's):
        [T, V] in x's dtype, or fp32 holding the same values."""


def _rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> Rope:
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, Dh // 2]
    return freqs.cos(), freqs.sin()


def _linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    return linear(x)


def _swiglu_reference(x: torch.Tensor, w13: nn.Linear, w2: nn.Linear) -> torch.Tensor:
    gate, up = w13(x).split(w13.out_features // 2, dim=-1)  # [T, I] each
    return w2(nn.functional.silu(gate) * up)


def _moe_reference(x, router: nn.Linear, w13, w2, top_k: int, renormalize: bool) -> torch.Tensor:
    weights, ids = moe_routing.route(router(x), top_k, renormalize)
    return fused_moe.fused_moe_reference(x, w13, w2, weights, ids)


def _moe_triton(x, router: nn.Linear, w13, w2, top_k: int, renormalize: bool) -> torch.Tensor:
    weights, ids = moe_routing.route_triton(router(x), top_k, renormalize)
    return fused_moe.fused_moe_triton(x, w13, w2, weights, ids)


class TorchOps:
    """The torch references: the CPU's path, and the ground truth of every kernel."""

    fuses_one_row = False
    fuses_moe_one_row = False
    fuses_qk_norm = False
    embed = staticmethod(embedding.embedding_reference)
    rope = staticmethod(_rope_cos_sin)
    rms_norm = staticmethod(norm.rms_norm_reference)
    add_rms_norm = staticmethod(norm.add_rms_norm_reference)
    project = staticmethod(_linear)
    attend = staticmethod(attention.rope_attend_reference)
    swiglu = staticmethod(_swiglu_reference)
    moe = staticmethod(_moe_reference)
    head = staticmethod(F.linear)


def _rope_positions(positions: torch.Tensor, inv_freq: torch.Tensor) -> Rope:
    return positions, inv_freq  # the fused kernels compute cos/sin themselves


def _project_triton(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    # For a decode batch of 33-64 rows of a wide model the small-row kernel streams the
    # weight faster than cuBLAS (kernels/small_linear.py); where it splits K the result
    # is its fp32 partials [S, T, N], which the next add-norm sums.
    m, k = x.shape[0], linear.in_features
    if linear.bias is None and small_linear.beats_cublas(m, k, x.dtype):
        split = small_linear.split_config(m, linear.out_features, k)
        if split is not None:
            return small_linear.small_linear_split_k_triton(x, linear.weight, split)
        return small_linear.small_linear_triton(x, linear.weight)
    return linear(x)


def _head_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # One row (batch-1 decode, a lone prompt's last token) of a half-precision head at least 2048 wide
    # in the small-row kernel, its default shape (4 rows x 2048 columns a program): inside the graphed
    # batch-1 step on an H100, 23 us a step faster than cuBLAS for Qwen3-30B-A3B's 151936 x 2048 head
    # and 37 us for Llama-3.1-8B's 128256 x 4096 (decode_ablation.py head:*; the other shapes tried
    # within 6 us of it, and the final norm in its prologue no faster). Its scores come out in fp32,
    # the sampler's dtype, the values still the projection's rounding: no cast launch after it.
    if x.shape[0] == 1 and x.shape[1] >= 2048 and weight.dtype == x.dtype and x.dtype in HALF \
            and weight.stride(1) == 1:
        return small_linear.small_linear_triton(x, weight, out_dtype=torch.float32)
    return F.linear(x, weight)


def _swiglu_triton(x: torch.Tensor, w13: nn.Linear, w2: nn.Linear) -> torch.Tensor:
    if small_linear.beats_cublas(x.shape[0], x.shape[1], x.dtype):
        # The gate in the w13 product's epilogue: one launch less, the [T, 2I] product never stored.
        return _project_triton(small_linear.small_linear_triton(x, w13.weight, gated_output=True), w2)
    return w2(activation.silu_and_mul_triton(w13(x)))


def _block_one_row(block, h: torch.Tensor, rope: Rope, k_cache, v_cache, meta) -> torch.Tensor:
    """A dense (Llama-family) block for one token: h is the residual stream [1, D]; returns the next.

    Four launches of the small-row kernel replace the two norms, the gate and the four
    matmuls: each norm, the gate and each residual add ride along with the projection
    next to them (see ``kernels/small_linear.py``): the gate in w13's epilogue for a wide
    model, in w2's prologue for a small one (``gate_in_epilogue``). An MoE block's experts take three
    launches instead of two (``moe_gemv.moe_one_row_triton``: the router, gate/up, down). Under tensor parallelism
    ``wo`` and ``w2`` give this rank's part, summed over the ranks (``block.tp.reduce``): only
    rank 0 adds the residual to its part, so that the sum holds it once.
    """
    attn, ffn, tp = block.attention, block.feed_forward, block.tp
    qkv = small_linear.small_linear_triton(
        h, attn.wqkv.weight, norm_weight=block.attention_norm.weight, eps=block.attention_norm.eps)
    h = tp.reduce(small_linear.small_linear_triton(attn.attend(qkv, rope, k_cache, v_cache, meta), attn.wo.weight,
                                                   residual=h if tp.leads else None))
    if ffn.routed:  # routed experts (models/moe.py): router, GEMVs, residual add in three launches
        assert tp.world_size == 1, "MoE layers are not split over ranks"
        return moe_gemv.moe_one_row_triton(h, block.ffn_norm.weight, block.ffn_norm.eps, ffn.gate.weight, ffn.w13,
                                           ffn.w2, ffn.top_k, ffn.renormalize)
    ffn_norm = dict(norm_weight=block.ffn_norm.weight, eps=block.ffn_norm.eps)
    residual = h if tp.leads else None
    if small_linear.gate_in_epilogue(h.shape[0], h.shape[1]):
        gated = small_linear.small_linear_triton(h, ffn.w13.weight, gated_output=True, **ffn_norm)
        return tp.reduce(small_linear.small_linear_triton(gated, ffn.w2.weight, residual=residual))
    gate_up = small_linear.small_linear_triton(h, ffn.w13.weight, **ffn_norm)
    return tp.reduce(small_linear.small_linear_triton(gate_up, ffn.w2.weight, gated=True, residual=residual))


class TritonOps:
    """The GPU kernels, and the one-row block they make possible."""

    fuses_one_row = True
    fuses_moe_one_row = True  # block_one_row takes an MoE block too
    fuses_qk_norm = True  # in the decode launch (rope_attend_triton)
    embed = staticmethod(embedding.embedding_triton)
    rope = staticmethod(_rope_positions)
    rms_norm = staticmethod(norm.rms_norm_triton)
    add_rms_norm = staticmethod(norm.add_rms_norm_triton)
    project = staticmethod(_project_triton)
    attend = staticmethod(attention.rope_attend_triton)
    swiglu = staticmethod(_swiglu_triton)
    moe = staticmethod(_moe_triton)
    head = staticmethod(_head_triton)
    block_one_row = staticmethod(_block_one_row)


def _rope_cos_sin_full(positions: torch.Tensor, inv_freq: torch.Tensor) -> Rope:
    """(cos, sin) [T, 1, Dh] fp32, both halves: ``x * cos + rotate_half(x) * sin`` is the rotation."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, Dh // 2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rope.rotate`` in five ops instead of nine: x [T, H, Dh] by full-width cos, sin [T, 1, Dh] (fp32).

    The halves swap in one ``flip`` of a [T, H, 2, Dh/2] view (a cat of two slices was three ops)."""
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)
    return (x * cos + swapped * sin).to(x.dtype)


def _rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm.rms_norm_reference`` bit for bit, its fp32 arithmetic in one C++ op (``rms_norm`` without
    a weight rounds ``x / rms(x)`` to x's dtype, as the reference does, before the weight's product)."""
    y = weight * torch.rms_norm(x, (x.shape[-1],), None, eps)
    return y if y.dtype == x.dtype else y.to(x.dtype)  # (a cast to its own dtype still costs a dispatch)


def _add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    if x.dim() != residual.dim():  # split-K partials (not made on the CPU; the reference sums them)
        return norm.add_rms_norm_reference(x, residual, weight, eps)
    h = x + residual
    return _rms_norm_cpu(h, weight, eps), h


def _one_row_plan(block) -> tuple | bool:
    """What ``CpuOps.block_one_row`` reads of a dense block, as plain references (the linears as their
    kernels' calls, ``forward`` for those without one); False for a block it leaves to the generic path.
    Kept on the block: its linears and norms are packed and loaded before its first step."""
    attn, ffn = block.attention, block.feed_forward
    if attn.q_norm is not None or block.tp.world_size > 1:
        return False

    def call(linear):
        return linear.kernel() if hasattr(linear, "kernel") else linear.forward

    return (block.attention_norm.weight, block.attention_norm.eps, call(attn.wqkv), attn.num_heads,
            attn.num_kv_heads, attn.head_dim, attn.scale, call(attn.wo), block.ffn_norm.weight,
            block.ffn_norm.eps, call(ffn.w13), ffn.w13.out_features // 2, call(ffn.w2))


class CpuOps(TorchOps):
    """The CPU's path: the references' math in fewer, larger torch ops.

    On the CPU every op costs microseconds of dispatch, a few times what a decode-sized
    op computes, so what counts is how many there are: the rotation is five ops with cos
    and sin made full-width once a step, q and k rotated as one, and a decode-only step attends
    in one batched SDPA instead of the reference's dozen small ops per sequence. (The
    norm rounds as the reference and the GPU kernels do, ``x / rms(x)`` to x's dtype before the
    weight's product: ``F.rms_norm`` given the weight rounds once, and in bf16 its greedy tokens
    agreed less often with float32's; without the weight it is the reference's arithmetic in
    one C++ op, bit for bit.) Each
    layer writes the step's K/V with one ``index_copy_`` per cache and gathers every
    sequence's context into one padded ``[B, Hkv, L, Dh]`` batch with one
    ``index_select``; the gather map and the padding mask are built at the step's first
    layer and reused by the others (keyed on the step's metadata object). The CPU has no
    CUDA graphs, but a replayed graph's padded rows (slot -1) write to the scratch page. Other steps take the
    reference.
    """

    fuses_one_row = True
    rope = staticmethod(_rope_cos_sin_full)
    rms_norm = staticmethod(_rms_norm_cpu)
    add_rms_norm = staticmethod(_add_rms_norm_cpu)

    def __init__(self):
        self._context = None  # (meta, and what _decode_context returns) of the last decode step
        self._writes = None  # (meta, the slots its K/V go to) of the last decode step

    def _write_slots(self, meta: AttentionMetadata) -> torch.Tensor:
        """The step's slot mapping with padded rows (-1, as a replayed graph pads them) sent to the scratch
        page 0, built once a step."""
        if self._writes is None or self._writes[0] is not meta:
            self._writes = (meta, meta.slot_mapping.clamp_min(0))
        return self._writes[1]

    def attend(self, q, k, v, rope: Rope, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = rope
        if not meta.decode_only:
            half = q.shape[-1] // 2
            return attention.rope_attend_reference(q, k, v, (cos[:, 0, :half], sin[:, 0, half:]), k_cache, v_cache,
                                                   meta, scale, out)
        heads = q.shape[1]
        qk = _rotate(torch.cat((q, k), 1), cos, sin)  # q and k rotated as one [T, H + Hkv, Dh]
        attn = self._decode_attend(qk[:, :heads], qk[:, heads:], v, k_cache, v_cache, meta, scale)
        return attn if out is None else out.copy_(attn)

    def block_one_row(self, block, h: torch.Tensor, rope: Rope, k_cache, v_cache, meta: AttentionMetadata):
        """A dense block for one token: h is the residual stream [1, D]; returns the next.

        The block's math in straight-line code, with the fewest ops: q and k are one view of
        the qkv product (already side by side there), and each residual add is done where
        its sublayer ends rather than in the next norm (the same sums, in the same dtype).
        What it reads of the block is gathered once (``_one_row_plan``): each module attribute
        costs a lookup through ``nn.Module.__getattr__``. A block with a per-head q/k norm, or
        under tensor parallelism, takes the generic path.
        """
        plan = block.__dict__.get("_cpu_one_row")
        if plan is None:
            plan = block.__dict__["_cpu_one_row"] = _one_row_plan(block)
        if not plan or not meta.decode_only:
            x, residual = block(h, None, rope, k_cache, v_cache, meta)
            return x + residual
        norm1, eps1, wqkv, heads, kv_heads, head_dim, scale, wo, norm2, eps2, w13, inter, w2 = plan
        qkv = wqkv(_rms_norm_cpu(h, norm1, eps1))  # [1, q + 2 kv]
        qk = _rotate(qkv[:, :(heads + kv_heads) * head_dim].view(1, heads + kv_heads, head_dim), *rope)
        v = qkv[:, (heads + kv_heads) * head_dim:].view(1, kv_heads, head_dim)
        a = self._decode_attend(qk[:, :heads], qk[:, heads:], v, k_cache, v_cache, meta, scale)
        h = h + wo(a.view(1, heads * head_dim))
        gate, up = w13(_rms_norm_cpu(h, norm2, eps2)).split(inter, dim=-1)
        return h + w2(F.silu(gate) * up)

    def _decode_attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """A decode step's attention of rotated q [T, H, Dh] (T = B), this step's k, v [T, Hkv, Dh] written
        first. Returns [T, H, Dh]."""
        (k_cache, k_scale), (v_cache, v_scale) = pages_and_scale(k_cache), pages_and_scale(v_cache)
        _, page_size, num_kv_heads, head_dim = k_cache.shape
        k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
        write = self._write_slots(meta)
        if k_scale is not None:  # fp8: stored quantized; moved as bytes (the CPU's index ops take no fp8)
            k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
            k, v = fp8.quantize_reference(k, k_scale).view(torch.uint8), fp8.quantize_reference(v, v_scale).view(torch.uint8)
        k_flat.index_copy_(0, write, k)
        v_flat.index_copy_(0, write, v)
        slots, batch, length, mask = self._decode_context(meta, page_size)
        # The context as [B, Hkv, L, Dh] (SDPA's layout) in one op a cache: a view of the cache itself when
        # one sequence's pages lie in a row, else of the rows gathered.
        shape, strides = (batch, num_kv_heads, length, head_dim), (length * num_kv_heads * head_dim, head_dim,
                                                                   num_kv_heads * head_dim, 1)
        if isinstance(slots, int) and k_scale is None:
            keys = k_flat.as_strided(shape, strides, k_flat.storage_offset() + slots * num_kv_heads * head_dim)
            values = v_flat.as_strided(shape, strides, v_flat.storage_offset() + slots * num_kv_heads * head_dim)
        else:
            if isinstance(slots, int):
                slots = torch.arange(slots, slots + length, device=k_flat.device)
            keys, values = k_flat.index_select(0, slots), v_flat.index_select(0, slots)
            if k_scale is not None:
                keys = fp8.dequantize_reference(keys.view(fp8.FP8), k_scale, q.dtype)
                values = fp8.dequantize_reference(values.view(fp8.FP8), v_scale, q.dtype)
            keys, values = keys.as_strided(shape, strides), values.as_strided(shape, strides)
        # Each GQA group's query heads are query rows of its kv head: [B, Hkv, group, Dh].
        return F.scaled_dot_product_attention(q.reshape(batch, num_kv_heads, -1, head_dim), keys, values,
                                              attn_mask=mask, scale=scale).view(q.shape)

    def _decode_context(self, meta: AttentionMetadata, page_size: int):
        """(where the sequences' contexts lie, B, the longest's length L, the mask of the real keys [B, 1, 1, L]
        or None when every context has the longest's length). Where: the first flat cache slot, when there
        is one sequence and its pages lie in a row (as a fresh allocator gives a lone stream's out); else the
        flat slots [B * L] of every sequence's context in turn, padded with page 0."""
        if self._context is not None and self._context[0] is meta:
            return self._context[1:]
        lens = meta.seq_lens.long()
        batch, longest = lens.shape[0], int(lens.max())
        pages = -(-longest // page_size)
        if batch == 1:
            table = meta.block_tables[0, :pages].tolist()
            if table == list(range(table[0], table[0] + pages)):
                self._context = (meta, table[0] * page_size, 1, longest, None)
                return self._context[1:]
        pos = torch.arange(longest, device=lens.device)
        slots = (meta.block_tables.long()[:, pos // page_size] * page_size + pos % page_size).view(-1)
        mask = None if int(lens.min()) == longest else (pos < lens[:, None])[:, None, None, :]
        self._context = (meta, slots, batch, longest, mask)
        return self._context[1:]
