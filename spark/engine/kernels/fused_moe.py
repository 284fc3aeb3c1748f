"""A mixture-of-experts feed-forward: routing, then every token's top-k experts, reference and Triton.

Each of the ``T`` tokens picks ``k`` experts; ``slot = t * k + j`` names its ``j``-th pick.
Expert ``e`` is a SwiGLU MLP: ``w2[e] @ (silu(gate) * up)`` with ``gate, up = w13[e] @ x``
(``w13`` [E, 2I, D], gate rows first; ``w2`` [E, D, I]: each expert's weights as ``nn.Linear``
would hold them, K contiguous). The output of a token is the routing-weighted sum of its picks.

The Triton path, as vLLM's fused MoE does it:

0. ``route_triton``: softmax, top-k and renormalisation in one launch;
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

For a few tokens (decode) the grouped GEMM is the wrong shape: one Qwen3-MoE token's top-8 make
eight blocks of 16 rows, 15 of each padding, and 96 programs of 64 gate/up columns (256 for
down), too few to stream the experts' weights at full bandwidth, behind an align launch. ``fused_moe_gemv_triton``
reads the experts straight from ``topk_ids`` instead, as matrix-vector products (see
``moe_path`` for when):

1. gate/up: one program per (slot, ``BLOCK_N`` of the I outputs), a pass over those gate and
   up rows of the slot's expert along the whole of D, SwiGLU in the epilogue: ``h`` [T * k, I];
2. down and combine: one program per (token, ``BLOCK_N`` of the D outputs), looping over the
   token's k picks, each pick's product rounded and weighted, the k of them summed in fp32 in
   registers. No atomics and no per-slot ``y``: the sum has one order, so the output is
   deterministic and each token's result does not depend on the others in the batch. For one
   token of small experts it loads its picks and their weight rows before waiting on gate/up
   (``gemv_config``'s ``EARLY``).

Decode's one row goes further (``moe_one_row_triton``, the MoE block's part of ``TritonOps.block_one_row``):
the router's GEMV takes the RMSNorm in its prologue, every gate/up program routes its token from
the logits itself (``route_token``: no routing launch) and normalises x on the way, and the down
kernel adds the residual: three launches, all with PDL, for the norm, router, routing, experts,
combine and residual add.

Both read the weights in the layout above (rows contiguous along K), the big-batch layout.
With the reference's roundings (gate and up rounded before the SwiGLU, each pick's product
rounded before its weight) the path is bit-exact with ``fused_moe_reference`` up to the order
of the fp32 sums.
"""

from __future__ import annotations

import functools

import torch

from spark.engine.kernels import activation, launch, small_linear

triton = None  # bound by _kernels() on first use: TRITON_INTERPRET is read when @triton.jit runs
tl = None
_silu_mul = None
_route_token = None  # route_token, the routing of one token that several kernels share: bound by _kernels()

# Slots from which the alignment is done by torch's sort (many programs) instead of the one-program kernel.
_ALIGN_IN_ONE_PROGRAM = 4096


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the softmax over experts: (weights fp32 [T, k], expert ids int64 [T, k]).

    Args:
      logits: the router's scores [T, E].
      renormalize: scale each token's k weights to sum to 1 (which equals a softmax over the
        selected logits alone: Mixtral's router).
    """
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def route_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` in one launch (one program a token): weights fp32 [T, k], expert ids int32 [T, k].

    Ties between equal probabilities go to the lower expert id (torch's topk does not promise an order)."""
    kernel = _kernels()[2]
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        kernel[(num_tokens,)](logits, weights, ids, logits.stride(0), num_experts, TOP_K=top_k,
                              K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts),
                              RENORMALIZE=renormalize)
    return weights, ids


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


SMALL_EXPERT = 1024  # an expert's intermediate size up to which one token takes ``gemv_config``'s one-warp shapes


def gemv_config(hidden: int, inter: int, num_tokens: int = 1) -> dict:
    """Launch shapes of the two GEMV kernels for ``num_tokens`` tokens of an expert of [2I, D] and
    [D, I] weights (bf16).

    Gate/up: 4 gate and 4 up rows a program over runs of up to 2048 columns, the small-row kernel's
    fastest shape for a dense w13 with its gate epilogue at one row (small_linear.tiling); Qwen3-MoE's
    one token: 8 x 192 programs of 32 KB. Down: the whole of I in steps of up to 1024 columns
    (Qwen3-MoE's 768 in one masked step, every pick's load independent of the others'). No split
    of K for the down projection: its programs already outnumber an H100's SMs at one token.

    One token of small experts (I <= ``SMALL_EXPERT``; Qwen3-MoE's 2048 x 768, 3 MB each): gate/up on
    one warp a program, so that an SM holds more programs' loads in flight, and down one output row
    a program on 4 warps (2048 programs). Inside Qwen3-30B-A3B's graphed batch-1 step on an H100
    (decode_ablation.py): gate/up on 1 warp 5.6 us a layer faster than on 2; down in 2 rows on 1
    warp 3.4 faster than 4 rows on 4, and 1 row on 4 warps 1.5 faster still. Several tokens, and larger experts,
    keep 2 warps for gate/up and 4 output rows a program for down (1024 programs of 224 KB for one
    Mixtral token); the one-token shapes were not measured there.

    ``EARLY`` (down, one token of small experts; off): the picks and their whole rows of I load before
    the wait on gate/up, while it streams its own weights. Slower in that step on an H100: 310.4 tok/s
    against 343.4 without (decode_ablation's ``down:1x1024w4late`` against ``early_down``, 6.5 us a
    layer): 2048 programs of 4 warps, each routing the token again and holding its rows across the
    wait, crowd gate/up's programs off the SMs.
    """
    np2 = small_linear.triton_next_power_of_2
    if inter <= SMALL_EXPERT and num_tokens == 1:
        return dict(gate_up=dict(BLOCK_N=4, BLOCK_K=min(2048, np2(hidden)), num_warps=1),
                    down=dict(BLOCK_N=1, BLOCK_K=np2(inter), num_warps=4))
    return dict(gate_up=dict(BLOCK_N=4, BLOCK_K=min(2048, np2(hidden)), num_warps=2),
                down=dict(BLOCK_N=4, BLOCK_K=min(1024, np2(inter)), num_warps=4))


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


def fused_moe_gemv_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """``fused_moe_reference`` for a few tokens: two GEMV launches, no alignment (see the module's docstring).

    Allocates only ``h`` [T * k, I] and the output, never synchronises: CUDA-graph capturable.

    Args:
      x, w13, w2, topk_weights, topk_ids: as ``fused_moe_reference``; every id in 0..E-1.
      config: launch shapes as ``gemv_config`` gives them (its default).
    """
    num_tokens, k = topk_ids.shape
    weights = topk_weights.reshape(-1).float()
    return _launch_gemvs(x, w13, w2, k, topk_ids.reshape(-1), weights, config=config)


def _launch_gemvs(x, w13, w2, top_k, ids, weights, *, logits=None, renormalize=False, norm_weight=None, eps=0.0,
                  residual=None, config=None) -> torch.Tensor:
    """The gate/up and down GEMVs (``ids``, ``weights`` [T * k]: read, or written from ``logits`` [T, E])."""
    num_tokens = x.shape[0]
    num_experts, inter2, hidden = w13.shape
    inter = inter2 // 2
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    gate_up_kernel, down_kernel = _kernels()[3:5]
    cfg = config or gemv_config(hidden, inter, num_tokens)
    up, down = cfg["gate_up"], cfg["down"]
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    route = logits is not None
    routing = dict(TOP_K=top_k, ROUTE=route, RENORMALIZE=renormalize, K_PAD=triton.next_power_of_2(top_k),
                   E_PAD=triton.next_power_of_2(num_experts))
    gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, up["BLOCK_N"]))](
        x, w13, ids, h, logits if route else x, weights, x if norm_weight is None else norm_weight, eps,
        x.stride(0), w13.stride(0), w13.stride(1), logits.stride(0) if route else 0, num_experts,
        I=inter, D=hidden, EVEN_K=hidden % up["BLOCK_K"] == 0, NORM=norm_weight is not None, **routing, **up,
        **launch.pdl(gate_up_kernel, x))
    down = {"EARLY": False, **down}
    assert not down["EARLY"] or down["BLOCK_K"] >= inter, "the early down loads the whole of I in one step"
    down_kernel[(num_tokens, triton.cdiv(hidden, down["BLOCK_N"]))](
        h, w2, ids, weights, logits if route else x, x if residual is None else residual, out, w2.stride(0),
        w2.stride(1), logits.stride(0) if route else 0, 0 if residual is None else residual.stride(0),
        out.stride(0), num_experts, D=hidden, I=inter, EVEN_K=inter % down["BLOCK_K"] == 0,
        HAS_RESIDUAL=residual is not None, **routing, **down, **launch.pdl(down_kernel, x))
    return out


# The router's launch shape in the one-row layer: 2 of its E rows a program, each row whole in one
# step (64 programs of 8 KB for Qwen3-MoE's 128 x 2048), loaded before the wait on the kernel before
# (``small_linear.Config.early_tile``): the weight's whole stream in flight under that kernel's tail.
# Not yet measured against small_linear's default for the shape (8 rows x 1024 columns, 16 programs).
ROUTER_CONFIG = dict(block_n=2, block_k=2048, num_warps=2, defer_reduce=False, early_tile=True)


def router_config(num_experts: int, hidden: int):
    """``ROUTER_CONFIG`` as a ``small_linear.Config`` for a [num_experts, hidden] router."""
    cfg = dict(ROUTER_CONFIG, block_k=min(ROUTER_CONFIG["block_k"], small_linear.triton_next_power_of_2(hidden)))
    return small_linear.Config(**cfg)


def moe_one_row_reference(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, router: torch.Tensor,
                          w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """The residual stream after an MoE sublayer: ``h + experts(RMSNorm(h) * norm_weight)`` (torch reference).

    The norm is small_linear's prologue (``small_linear_reference`` with ``norm_weight``: the operand
    ``h * norm_weight`` rounded to h's dtype, the rstd applied to the fp32 products) for the router and
    for each pick's gate/up; the rest rounds as ``fused_moe_reference``.

    Args:
      h: the residual stream [T, D]; norm_weight: [D]; router: [E, D]; w13, w2, top_k, renormalize: as
        ``SparseMoe``'s.

    Returns:
      [T, D] in h's dtype.
    """
    num_tokens = h.shape[0]
    logits = small_linear.small_linear_reference(h, router, norm_weight=norm_weight, eps=eps)
    weights, ids = route(logits, top_k, renormalize)
    total = torch.zeros(num_tokens, h.shape[1], dtype=torch.float32, device=h.device)
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            gated = small_linear.small_linear_reference(h[t:t + 1], w13[e], norm_weight=norm_weight, eps=eps,
                                                        gated_output=True)
            y = small_linear.small_linear_reference(gated, w2[e])
            total[t] += (y.float() * weights[t, j]).to(h.dtype).float()[0]
    return total.to(h.dtype) + h


def moe_one_row_triton(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, router: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool,
                       config: dict | None = None) -> torch.Tensor:
    """``moe_one_row_reference`` in three launches, for the tokens of the GEMV path (decode's one row):

    1. the router: small_linear's kernel, the norm in its prologue: logits [T, E];
    2. gate/up (``moe_gemv_gate_up_kernel``): every program routes its token from the logits, the
       norm in its prologue; the first output block's programs store the ids and weights;
    3. down (``moe_gemv_down_kernel``): the weighted combine and the residual add in its epilogue.

    Where the unfused layer launches the add-norm, the router's GEMV, the routing, the two GEMVs and
    the next norm's residual add. All three take PDL on Hopper. Graph-capturable, no host sync.

    Args:
      as ``moe_one_row_reference``'s; config: the GEMVs' launch shapes (``gemv_config``'s default).
    """
    num_tokens = h.shape[0]
    logits = small_linear.small_linear_triton(h, router, norm_weight=norm_weight, eps=eps,
                                              config=router_config(*router.shape))
    ids = torch.empty(num_tokens * top_k, dtype=torch.int32, device=h.device)
    weights = torch.empty(num_tokens * top_k, dtype=torch.float32, device=h.device)
    return _launch_gemvs(h, w13, w2, top_k, ids, weights, logits=logits, renormalize=renormalize,
                         norm_weight=norm_weight, eps=eps, residual=h, config=config)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``fused_moe_reference`` by the GEMVs for a few tokens, else by the aligned grouped GEMMs
    (``moe_path``; see the module's docstring)."""
    if moe_path(topk_ids.shape[0], topk_ids.shape[1], w13.shape[0]) == "gemv":
        return fused_moe_gemv_triton(x, w13, w2, topk_weights, topk_ids)
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
    """(align kernel, grouped GEMM kernel, route kernel, GEMV gate/up kernel, GEMV down kernel),
    JIT-ed at first use."""
    global triton, tl, _silu_mul, _route_token
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401 (tl.extra.cuda, for PDL)

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

    @triton.jit
    def route_token(logits_row, num_experts, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                    RENORMALIZE: tl.constexpr):
        """One token's (weights fp32 [K_PAD], expert ids int32 [K_PAD]) from its logits: softmax over the
        experts in fp32, then k rounds of argmax (the lowest id among ties), renormalised if asked."""
        experts = tl.arange(0, E_PAD)
        logits = tl.load(logits_row + experts, mask=experts < num_experts, other=float("-inf")).to(tl.float32)
        p = tl.exp(logits - tl.max(logits, axis=0))
        p = p / tl.sum(p, axis=0)
        picks = tl.arange(0, K_PAD)
        top_w = tl.zeros([K_PAD], dtype=tl.float32)
        top_i = tl.zeros([K_PAD], dtype=tl.int32)
        left = tl.where(experts < num_experts, p, -1.0)
        for j in tl.static_range(TOP_K):
            best = tl.max(left, axis=0)
            at = tl.min(tl.where(left == best, experts, E_PAD), axis=0)  # the lowest id among ties
            # A NaN row (a padded row of a replayed graph attends to nothing) matches no expert:
            # it takes expert 0, so that no id ever points outside the weights.
            at = tl.where(at < num_experts, at, 0)
            top_w = tl.where(picks == j, best, top_w)
            top_i = tl.where(picks == j, at, top_i)
            left = tl.where(experts == at, -1.0, left)
        if RENORMALIZE:
            top_w = top_w / tl.sum(tl.where(picks < TOP_K, top_w, 0.0), axis=0)
        return top_w, top_i

    _route_token = route_token

    @triton.jit
    def moe_route_kernel(logits_ptr, weights_ptr, ids_ptr, stride_t, num_experts, TOP_K: tl.constexpr,
                         K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
        # One token a program.
        t = tl.program_id(0).to(tl.int64)
        top_w, top_i = _route_token(logits_ptr + t * stride_t, num_experts, TOP_K, K_PAD, E_PAD, RENORMALIZE)
        picks = tl.arange(0, K_PAD)
        tl.store(weights_ptr + t * TOP_K + picks, top_w, mask=picks < TOP_K)
        tl.store(ids_ptr + t * TOP_K + picks, top_i, mask=picks < TOP_K)

    @triton.jit
    def moe_gemv_gate_up_kernel(x_ptr, w13_ptr, ids_ptr, h_ptr, logits_ptr, weights_ptr, norm_w_ptr, eps,
                                stride_xt, stride_we, stride_wn, stride_lt, num_experts,
                                I: tl.constexpr, D: tl.constexpr, TOP_K: tl.constexpr, EVEN_K: tl.constexpr,
                                ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr, K_PAD: tl.constexpr,
                                E_PAD: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # h[slot, n] = silu(gate_n . x) * (up_n . x) for BLOCK_N of the I outputs of the slot's expert.
        # ROUTE: the expert comes from the token's router logits (``route_token``, recomputed by
        # every program: a few reductions over E, in place of a launch), and the programs of the
        # first output block store each slot's id and weight for the down kernel.
        # NORM: x is the residual stream, RMSNorm(x) * norm_w taken on the way (small_linear's
        # prologue: rstd applied to the fp32 products).
        slot = tl.program_id(0)
        token = (slot // TOP_K).to(tl.int64)
        if PDL:  # x, the logits or the ids come from the kernels before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if ROUTE:
            top_w, top_i = _route_token(logits_ptr + token * stride_lt, num_experts, TOP_K, K_PAD, E_PAD, RENORMALIZE)
            picks = tl.arange(0, K_PAD)
            mine = picks == slot % TOP_K
            expert = tl.sum(tl.where(mine, top_i, 0), axis=0).to(tl.int64)
            first = tl.program_id(1) == 0
            tl.store(ids_ptr + slot + picks * 0, top_i, mask=mine & first)
            tl.store(weights_ptr + slot + picks * 0, top_w, mask=mine & first)
        else:
            expert = tl.load(ids_ptr + slot).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        # The last program's spare outputs re-read row I - 1 instead of masking: the weight
        # loads, the whole cost, stay unmasked along N.
        gate_rows = w13_ptr + expert * stride_we + tl.minimum(cols, I - 1).to(tl.int64)[:, None] * stride_wn
        up_rows = gate_rows + I * stride_wn
        x_row = x_ptr + token * stride_xt
        ks = tl.arange(0, BLOCK_K)
        acc_gate = tl.zeros([BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_N], tl.float32)
        sum_sq = tl.zeros([BLOCK_K], tl.float32)  # the norm's per-lane sums of squares
        dtype = h_ptr.dtype.element_ty
        for k0 in range(0, D, BLOCK_K):
            k = k0 + ks
            if EVEN_K:
                a = tl.load(x_row + k).to(tl.float32)
                g = tl.load(gate_rows + k[None, :])
                u = tl.load(up_rows + k[None, :])
            else:
                k_ok = k < D
                a = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
                g = tl.load(gate_rows + k[None, :], mask=k_ok[None, :], other=0.0)
                u = tl.load(up_rows + k[None, :], mask=k_ok[None, :], other=0.0)
            if NORM:  # the operand x * norm_w in x's dtype, as small_linear's
                sum_sq += a * a
                a = (a * tl.load(norm_w_ptr + k, mask=k < D, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
            acc_gate += tl.sum(g.to(tl.float32) * a[None, :], axis=1)
            acc_up += tl.sum(u.to(tl.float32) * a[None, :], axis=1)
        if NORM:
            rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / D + eps)
            acc_gate = acc_gate * rstd
            acc_up = acc_up * rstd
        # Gate and up rounded as the unfused projection's output is, the gate in fp32, rounded once.
        h = _silu_mul(acc_gate.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32))
        tl.store(h_ptr + slot.to(tl.int64) * I + cols, h.to(dtype), mask=cols < I)

    @triton.jit
    def moe_gemv_down_kernel(h_ptr, w2_ptr, ids_ptr, weights_ptr, logits_ptr, residual_ptr, out_ptr, stride_we,
                             stride_wn, stride_lt, stride_rt, stride_ot, num_experts, D: tl.constexpr, I: tl.constexpr,
                             TOP_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                             ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr, K_PAD: tl.constexpr,
                             E_PAD: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out[t, n] = sum over the token's picks j of weight_j * (w2[e_j, n] . h[t * k + j]): BLOCK_N
        # of the D outputs of one token, the combine in registers; HAS_RESIDUAL: plus residual[t, n]
        # (the residual stream's add, in x's dtype as eager ``h + moe(x)``).
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_offsets = tl.minimum(cols, D - 1).to(tl.int64)[:, None] * stride_wn
        ks = tl.arange(0, BLOCK_K)
        dtype = out_ptr.dtype.element_ty
        if EARLY:
            # The picks, their weights' rows and the residual load before the wait on gate/up, while it
            # streams its own weights: none is its output. The routing is ``route_token`` on the router's logits (ROUTE),
            # or the ids given, both written before gate/up launched: gate/up's programs each wait on
            # the kernel before them before they let this one launch. The whole of I in one step
            # (BLOCK_K >= I): each pick's rows are held in registers across the wait.
            picks = tl.arange(0, K_PAD)
            pick_ok = picks < TOP_K
            if ROUTE:
                top_w, top_i = _route_token(logits_ptr + token * stride_lt, num_experts, TOP_K, K_PAD, E_PAD,
                                            RENORMALIZE)
            else:
                top_i = tl.load(ids_ptr + token * TOP_K + picks, mask=pick_ok, other=0)
                top_w = tl.load(weights_ptr + token * TOP_K + picks, mask=pick_ok, other=0.0)
            k_ok = ks < I
            w = tl.load(w2_ptr + top_i.to(tl.int64)[:, None, None] * stride_we + row_offsets[None, :, :]
                        + ks[None, None, :], mask=pick_ok[:, None, None] & k_ok[None, None, :], other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(residual_ptr + token * stride_rt + cols, mask=cols < D, other=0.0)
        if PDL:  # h (and, unless EARLY, the ids and weights) come from the kernels before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if EARLY:
            a = tl.load(h_ptr + (token * TOP_K + picks)[:, None] * I + ks[None, :],
                        mask=pick_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc = tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)  # [K_PAD, BLOCK_N]
            # The reference's roundings, as below; padded picks weigh 0.
            weighted = acc.to(dtype).to(tl.float32) * top_w[:, None]
            total = tl.sum(weighted.to(dtype).to(tl.float32), axis=0)
        else:
            total = tl.zeros([BLOCK_N], tl.float32)
            # Unrolled over the picks: their expert ids load up front and their weight streams are
            # independent, so the compiler may put several picks' loads in flight at once.
            for j in tl.static_range(TOP_K):
                slot = token * TOP_K + j
                expert = tl.load(ids_ptr + slot).to(tl.int64)
                rows = w2_ptr + expert * stride_we + row_offsets
                h_row = h_ptr + slot * I
                acc = tl.zeros([BLOCK_N], tl.float32)
                for k0 in range(0, I, BLOCK_K):
                    k = k0 + ks
                    if EVEN_K:
                        a = tl.load(h_row + k).to(tl.float32)
                        w = tl.load(rows + k[None, :])
                    else:
                        k_ok = k < I
                        a = tl.load(h_row + k, mask=k_ok, other=0.0).to(tl.float32)
                        w = tl.load(rows + k[None, :], mask=k_ok[None, :], other=0.0)
                    acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
                # The reference's roundings: the product, then the weighted product, in x's dtype.
                weighted = acc.to(dtype).to(tl.float32) * tl.load(weights_ptr + slot)
                total += weighted.to(dtype).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(residual_ptr + token * stride_rt + cols, mask=cols < D, other=0.0)
        y = total.to(dtype)
        if HAS_RESIDUAL:
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(out_ptr + token * stride_ot + cols, y, mask=cols < D)

    return moe_align_kernel, moe_gemm_kernel, moe_route_kernel, moe_gemv_gate_up_kernel, moe_gemv_down_kernel
