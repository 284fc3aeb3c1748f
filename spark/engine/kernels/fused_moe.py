"""A mixture-of-experts feed-forward: every token's top-k experts, reference and Triton.

Each of the ``T`` tokens picks ``k`` experts (moe_routing.py: softmax and top-k of the router's
logits); ``slot = t * k + j`` names its ``j``-th pick.
Expert ``e`` is a SwiGLU MLP: ``w2[e] @ (silu(gate) * up)`` with ``gate, up = w13[e] @ x``
(``w13`` [E, 2I, D], gate rows first; ``w2`` [E, D, I]: each expert's weights as ``nn.Linear``
would hold them, K contiguous). The output of a token is the routing-weighted sum of its picks.

The Triton path, as vLLM's fused MoE does it:

0. ``moe_routing.route_triton``: softmax, top-k and renormalisation in one launch;
1. ``align``: the slots sorted by expert, each expert's run padded to a multiple of
   ``BLOCK_M`` (padding holds the sentinel ``T * k``), and the expert of every block of
   ``BLOCK_M`` rows. Sizes are the static worst case (every used expert wastes
   ``BLOCK_M - 1`` rows), so nothing leaves the device and a decode step can be captured
   in a CUDA graph; blocks past the end are marked -1 and exit at once.
2. one grouped GEMM over those blocks for gate/up, SwiGLU in its epilogue: ``h`` [T * k, I];
3. one for down, the routing weight applied in its epilogue: ``y`` [T * k, D];
4. the combine: ``y.view(T, k, D).sum(1)``.

Rounding, both paths: products accumulate in fp32, ``h`` and each slot's weighted ``y`` are
rounded to the activations' dtype, the top-k sum is taken in fp32 and rounded once.

A few tokens (decode) take the GEMV path of moe_gemv.py instead (``moe_path`` says when): the
experts read straight from ``topk_ids``, no alignment; decode's one row also folds the norm, the
router and the residual add into it.
"""

from __future__ import annotations

import functools

import torch

from spark.engine.kernels import activation, moe_gemv

triton = None  # bound by _kernels() on first use: TRITON_INTERPRET is read when @triton.jit runs
tl = None
_silu_mul = None

# Slots from which the alignment is done by torch's sort (many programs) instead of the one-program kernel.
_ALIGN_IN_ONE_PROGRAM = 4096


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Sum over each token's experts of ``weight * expert(x)`` (torch reference: a loop over experts).

    Args:
      x: [T, D]; w13: [E, 2I, D]; w2: [E, D, I]; topk_weights: [T, k] (fp32); topk_ids: [T, k],
        any expert in 0..E-1, repeats allowed.

    Returns:
      [T, D] in x's dtype.
    """
    num_tokens, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1).float()
    order = torch.argsort(flat, stable=True)  # slots, grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    y = torch.zeros(num_tokens * k, x.shape[1], dtype=x.dtype, device=x.device)  # per slot
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        h = activation.silu_and_mul_reference(x[slots // k] @ w13[e].T)  # [n, I]
        y[slots] = ((h @ w2[e].T).float() * weights[slots, None]).to(x.dtype)
    return y.view(num_tokens, k, -1).float().sum(1).to(x.dtype)


# The GEMV path reads one expert's weights per slot (per token and pick), where the grouped
# GEMM reads each distinct expert once for all its tokens. Up to this many slots (32: Qwen3-MoE's
# 4 tokens x top-8) a GEMV program per slot still leaves each program a long weight stream; past
# it tokens share experts often enough that the grouped GEMM's shared tiles win.
GEMV_MAX_SLOTS = 32
# ... and only while the extra reads of experts picked by several tokens stay this small (a
# fraction of the distinct experts' bytes, expected for uniform routing): Mixtral's 8 experts,
# top-2, repeat often from 3 tokens on.
GEMV_MAX_REREAD = 0.25


def moe_path(num_tokens: int, top_k: int, num_experts: int) -> str:
    """Which Triton path ``fused_moe_triton`` takes: "gemv" (few tokens) or "grouped" (the aligned GEMMs).

    A function of the shapes alone (no host sync), so that a captured graph's path is fixed by its batch.
    """
    slots = num_tokens * top_k
    if slots > GEMV_MAX_SLOTS:
        return "grouped"
    # Distinct experts among the slots, expected when each token's picks are uniform.
    distinct = num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)
    return "gemv" if slots <= (1 + GEMV_MAX_REREAD) * distinct else "grouped"


def block_m(num_slots: int) -> int:
    """Rows per expert block: small for decode (each used expert wastes at most this less one)."""
    return 16 if num_slots <= 1024 else 64


def aligned_sizes(num_slots: int, num_experts: int, block: int) -> tuple[int, int]:
    """(rows, blocks) of the sorted slots at worst: each expert in use pads its run by < ``block`` rows."""
    rows = num_slots + min(num_experts, num_slots) * (block - 1)
    blocks = -(-rows // block)
    return blocks * block, blocks


def align_reference(topk_ids: torch.Tensor, num_experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted slots [rows] int32, padded with ``T * k``; each block's expert [blocks] int32, -1 past the end).

    Slots of one expert come in ascending order; expert ``e``'s run starts where the runs of
    the experts before it, each rounded up to ``block`` rows, end. Torch ops only, no host sync.
    """
    flat = topk_ids.reshape(-1).long()
    num_slots = flat.numel()
    rows, blocks = aligned_sizes(num_slots, num_experts, block)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    first = counts.cumsum(0) - counts  # where each expert's slots begin in `order`
    dest = (ends - padded)[experts] + torch.arange(num_slots, device=flat.device) - first[experts]
    sorted_slots = torch.full((rows,), num_slots, dtype=torch.int32, device=flat.device)
    sorted_slots[dest] = order.to(torch.int32)
    owner = torch.searchsorted(ends, torch.arange(blocks, device=flat.device) * block, right=True)
    return sorted_slots, torch.where(owner < num_experts, owner, -1).to(torch.int32)


def align_triton(topk_ids: torch.Tensor, num_experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_reference`` in one Triton program (one launch: decode's case); torch's sort for many slots."""
    num_slots = topk_ids.numel()
    if num_slots > _ALIGN_IN_ONE_PROGRAM:
        return align_reference(topk_ids, num_experts, block)
    align_kernel = _kernels()[0]
    rows, blocks = aligned_sizes(num_slots, num_experts, block)
    sorted_slots = torch.empty(rows, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=topk_ids.device)
    e_pad = triton.next_power_of_2(num_experts)
    align_kernel[(1,)](topk_ids, sorted_slots, block_expert, num_slots, rows, blocks, num_experts,
                        BLOCK_M=block, E_PAD=e_pad, CHUNK=max(16, 8192 // e_pad), FILL=1024, num_warps=8)
    return sorted_slots, block_expert


def _gemm_config(num_slots: int) -> dict:
    # Decode: narrow tiles, long K steps, so that the few blocks in use still spread over the SMs.
    if num_slots <= 1024:
        return dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    return dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``fused_moe_reference`` by the GEMVs for a few tokens, else by the aligned grouped GEMMs
    (``moe_path``; see the module's docstring)."""
    if moe_path(topk_ids.shape[0], topk_ids.shape[1], w13.shape[0]) == "gemv":
        return moe_gemv.fused_moe_gemv_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_grouped_triton(x, w13, w2, topk_weights, topk_ids)


def fused_moe_grouped_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                             topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``fused_moe_reference`` by the aligned grouped GEMMs, for any number of tokens (see the module's docstring)."""
    num_tokens, k = topk_ids.shape
    num_experts, inter2, hidden = w13.shape
    inter = inter2 // 2
    num_slots = num_tokens * k
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    gemm = _kernels()[1]
    block = block_m(num_slots)
    sorted_slots, block_expert = align_triton(topk_ids, num_experts, block)
    cfg = _gemm_config(num_slots)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    blocks = block_expert.shape[0]
    weights = topk_weights.reshape(-1).float()
    gemm[(blocks, triton.cdiv(inter, cfg["BLOCK_N"]))](
        x, w13, h, sorted_slots, block_expert, weights, num_slots, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), h.stride(0),
        TOP_K=k, GATED=True, PER_TOKEN=True, WEIGHTED=False, BLOCK_M=block, PRECISION=precision, **cfg)
    gemm[(blocks, triton.cdiv(hidden, cfg["BLOCK_N"]))](
        h, w2, y, sorted_slots, block_expert, weights, num_slots, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0),
        TOP_K=k, GATED=False, PER_TOKEN=False, WEIGHTED=True, BLOCK_M=block, PRECISION=precision, **cfg)
    if k == 1:
        return y
    return y.view(num_tokens, k, hidden).sum(1)  # accumulated in fp32, rounded once


@functools.cache
def _kernels():
    """(align kernel, grouped GEMM kernel), JIT-ed at first use."""
    global triton, tl, _silu_mul
    import triton
    import triton.language as tl

    _silu_mul = activation.jit_silu_mul()

    @triton.jit
    def moe_align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_slots, rows, blocks, num_experts,
                         BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
        experts = tl.arange(0, E_PAD)
        counts = tl.zeros([E_PAD], dtype=tl.int32)
        # while, not range(): the Triton 3.6 interpreter cannot take runtime bounds of a range
        # under numpy >= 2.4 (see key_block.py), and one program needs no software pipelining.
        start = 0
        while start < num_slots:
            offs = start + tl.arange(0, CHUNK)
            e = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1).to(tl.int32)
            counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
            start += CHUNK
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        starts = ends - padded
        # A block's expert: how many experts' runs end at or before its first row.
        b0 = 0
        while b0 < blocks:
            b = b0 + tl.arange(0, CHUNK)
            owner = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, tl.where(owner < num_experts, owner, -1), mask=b < blocks)
            b0 += CHUNK
        r0 = 0
        while r0 < rows:
            r = r0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + r, tl.full([FILL], 0, tl.int32) + num_slots, mask=r < rows)
            r0 += FILL
        tl.debug_barrier()  # the padding is written before any slot lands over it
        seen = tl.zeros([E_PAD], dtype=tl.int32)
        start = 0
        while start < num_slots:
            offs = start + tl.arange(0, CHUNK)
            e = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1).to(tl.int32)
            hit = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD], one 1 per real slot
            rank = tl.cumsum(hit, axis=0)  # 1 + earlier slots of the same expert in this chunk
            dest = tl.sum(hit * ((starts + seen - 1)[None, :] + rank), axis=1)
            # (an id outside 0..E-1 hits nothing: dropped, rather than written over row 0)
            tl.store(sorted_ptr + dest, offs, mask=(offs < num_slots) & (tl.sum(hit, axis=1) > 0))
            seen += tl.sum(hit, axis=0)
            start += CHUNK

    @triton.jit
    def moe_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, weights_ptr,
                        num_slots, N: tl.constexpr, K: tl.constexpr, stride_am, stride_we, stride_wn, stride_wk, stride_om,
                        TOP_K: tl.constexpr, GATED: tl.constexpr, PER_TOKEN: tl.constexpr,
                        WEIGHTED: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # N and K are the model's widths, constexpr: a range() over K the compiler can pipeline.
        # out[slot, n] = (A[row(slot)] @ W[e].T)[n] for the BLOCK_M slots of one expert e; GATED:
        # silu(gate) * up with the up rows N below the gate's; WEIGHTED: times the slot's routing weight.
        pid_m = tl.program_id(0)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < num_slots
        a_row = (slot // TOP_K) if PER_TOKEN else slot
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row.to(tl.int64)[:, None] * stride_am + ks[None, :]
        b_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if GATED:
                up = tl.load(b_ptrs + N * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_wk
        if GATED:
            acc = _silu_mul(acc, acc_up)
        if WEIGHTED:
            acc = acc * tl.load(weights_ptr + slot, mask=valid, other=0.0)[:, None]
        out = out_ptr + slot.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])

    return moe_align_kernel, moe_gemm_kernel
