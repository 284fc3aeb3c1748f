"""The few-token path of a mixture-of-experts layer: every slot's expert read straight from ``topk_ids``.

Shapes and names as fused_moe.py's: ``T`` tokens, ``k`` picks each, slot ``t * k + j``; ``w13``
[E, 2I, D] (gate rows first), ``w2`` [E, D, I].

For a few tokens (decode) the grouped GEMM is the wrong shape: one Qwen3-MoE token's top-8 make
eight blocks of 16 rows, 15 of each padding, and 96 programs of 64 gate/up columns (256 for
down), too few to stream the experts' weights at full bandwidth, behind an align launch. ``fused_moe_gemv_triton``
reads the experts straight from ``topk_ids`` instead, as matrix-vector products (see
``fused_moe.moe_path`` for when):

1. gate/up: one program per (slot, ``BLOCK_N`` of the I outputs), a pass over those gate and
   up rows of the slot's expert along the whole of D, SwiGLU in the epilogue: ``h`` [T * k, I];
2. down and combine: one program per (token, ``BLOCK_N`` of the D outputs), looping over the
   token's k picks, each pick's product rounded and weighted, the k of them summed in fp32 in
   registers. No atomics and no per-slot ``y``: the sum has one order, so the output is
   deterministic and each token's result does not depend on the others in the batch.

Decode's one row goes further (``moe_one_row_triton``, the MoE block's part of ``TritonOps.block_one_row``):
the router's GEMV takes the RMSNorm in its prologue, every gate/up program routes its token from
the logits itself (moe_routing.py's ``route_token``: no routing launch) and normalises x on the way, and the
down kernel adds the residual: three launches, all with PDL, for the norm, router, routing, experts,
combine and residual add.

Both read the weights in fused_moe.py's layout (rows contiguous along K), the big-batch layout.
With the reference's roundings (gate and up rounded before the SwiGLU, each pick's product
rounded before its weight) the path is bit-exact with ``fused_moe.fused_moe_reference`` up to the
order of the fp32 sums.
"""

from __future__ import annotations

import functools

import torch

from spark.engine.kernels import activation, launch, moe_routing, small_linear

triton = None  # bound by _kernels() on first use: TRITON_INTERPRET is read when @triton.jit runs
tl = None
_silu_mul = None
# moe_routing's route_token, bound by _kernels() as a module global: Triton looks a jit function's
# names up in the module that defines it, here for the kernels below.
_route_token = None
_wait_for_previous = None  # launch's PDL wait, bound by _kernels() likewise


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
    a program on one warp too (2048 programs). Inside Qwen3-30B-A3B's graphed batch-1 step on an H100
    (decode_ablation.py): gate/up on 1 warp 5.6 us a layer faster than on 2; down in 2 rows on 1
    warp 3.4 faster than 4 rows on 4, and 1 row on 4 warps 1.5 faster still. On an H200 (2026-12-06,
    the picks' reductions inside a warp, with no barrier between one pick's loads and the next's):
    down's 1 row on 1 warp 448.4 tok/s against 429.4 on 4 warps (2.1 us a layer; 442.3 against 420.5
    under a 40960-key table); on an H100 368.8 against 360.7. Several tokens, and larger experts,
    keep 2 warps for gate/up and 4 output rows a program for down (1024 programs of 224 KB for one
    Mixtral token); the one-token shapes were not measured there.

    The down kernel loading its picks and their whole rows of I before its wait on gate/up (routing the
    token again from the logits) was slower in that step on an H100, 6.4 us a layer in two runs (310.4
    tok/s against 343.4; 4985353, removed after): 2048 programs of 4 warps holding their rows across the
    wait crowd gate/up's programs off the SMs.
    """
    np2 = small_linear.triton_next_power_of_2
    if inter <= SMALL_EXPERT and num_tokens == 1:
        return dict(gate_up=dict(BLOCK_N=4, BLOCK_K=min(2048, np2(hidden)), num_warps=1),
                    down=dict(BLOCK_N=1, BLOCK_K=np2(inter), num_warps=1))
    return dict(gate_up=dict(BLOCK_N=4, BLOCK_K=min(2048, np2(hidden)), num_warps=2),
                down=dict(BLOCK_N=4, BLOCK_K=min(1024, np2(inter)), num_warps=4))


def fused_moe_gemv_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """``fused_moe.fused_moe_reference`` for a few tokens: two GEMV launches, no alignment (see the
    module's docstring).

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
    gate_up_kernel, down_kernel = _kernels()
    cfg = config or gemv_config(hidden, inter, num_tokens)
    up, down = cfg["gate_up"], cfg["down"]
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    route = logits is not None
    gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, up["BLOCK_N"]))](
        x, w13, ids, h, logits if route else x, weights, x if norm_weight is None else norm_weight, eps,
        x.stride(0), w13.stride(0), w13.stride(1), logits.stride(0) if route else 0, num_experts,
        I=inter, D=hidden, EVEN_K=hidden % up["BLOCK_K"] == 0, NORM=norm_weight is not None, TOP_K=top_k,
        ROUTE=route, RENORMALIZE=renormalize, K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(num_experts), **up, **launch.pdl(gate_up_kernel, x))
    down_kernel[(num_tokens, triton.cdiv(hidden, down["BLOCK_N"]))](
        h, w2, ids, weights, x if residual is None else residual, out, w2.stride(0), w2.stride(1),
        0 if residual is None else residual.stride(0), out.stride(0),
        D=hidden, I=inter, TOP_K=top_k, EVEN_K=inter % down["BLOCK_K"] == 0, HAS_RESIDUAL=residual is not None,
        **down, **launch.pdl(down_kernel, x))
    return out


# The router's launch shape in the one-row layer: 4 of its E rows a program, each row whole in one
# step (32 programs of 16 KB for Qwen3-MoE's 128 x 2048), loaded before the wait on the kernel before
# (``small_linear.Config.early_tile``): the weight's whole stream in flight under that kernel's tail;
# the flat one-row product (``small_linear.Config.flat_row``). 4 rows against 2 on an H200: 452.9 tok/s
# against 448.4 (Qwen3-30B-A3B batch 1, decode_ablation.py); on an H100 it did not win (2f08a28's sweep).
# Not yet measured against small_linear's default for the shape (8 rows x 1024 columns, 16 programs).
# Its trigger comes first (``Config.trigger_first``): gate/up's programs launch while the router waits
# on wo. On an H100, 371.2 tok/s against 369.1 with it after the wait (decode_ablation last:router,
# results 2026-12-06-h100-argmax-triggers-4ece645.json).
ROUTER_CONFIG = dict(block_n=4, block_k=2048, num_warps=2, defer_reduce=False, early_tile=True, flat_row=True,
                     trigger_first=True)


def router_config(num_experts: int, hidden: int):
    """``ROUTER_CONFIG`` as a ``small_linear.Config`` for a [num_experts, hidden] router."""
    cfg = dict(ROUTER_CONFIG, block_k=min(ROUTER_CONFIG["block_k"], small_linear.triton_next_power_of_2(hidden)))
    return small_linear.Config(**cfg)


def moe_one_row_reference(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, router: torch.Tensor,
                          w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """The residual stream after an MoE sublayer: ``h + experts(RMSNorm(h) * norm_weight)`` (torch reference).

    The norm is small_linear's prologue (``small_linear_reference`` with ``norm_weight``: the operand
    ``h * norm_weight`` rounded to h's dtype, the rstd applied to the fp32 products) for the router and
    for each pick's gate/up; the rest rounds as ``fused_moe.fused_moe_reference``.

    Args:
      h: the residual stream [T, D]; norm_weight: [D]; router: [E, D]; w13, w2, top_k, renormalize: as
        ``SparseMoe``'s.

    Returns:
      [T, D] in h's dtype.
    """
    num_tokens = h.shape[0]
    logits = small_linear.small_linear_reference(h, router, norm_weight=norm_weight, eps=eps)
    weights, ids = moe_routing.route(logits, top_k, renormalize)
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


@functools.cache
def _kernels():
    """(GEMV gate/up kernel, GEMV down kernel), JIT-ed at first use."""
    global triton, tl, _silu_mul, _route_token, _wait_for_previous
    import triton
    import triton.language as tl

    _silu_mul = activation.jit_silu_mul()
    _route_token = moe_routing.jit_route_token()
    _wait_for_previous = launch.jit_wait_for_previous()

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
            _wait_for_previous(False)
        if ROUTE:
            top_w, top_i, expert = _route_token(logits_ptr + token * stride_lt, num_experts, slot % TOP_K, TOP_K,
                                                K_PAD, E_PAD, RENORMALIZE)
            expert = expert.to(tl.int64)
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
        if ROUTE:
            # The slot's id and weight for the down kernel, stored last: stores ahead of the weight loads
            # would hold them back behind the softmax that only the weight needs.
            picks = tl.arange(0, K_PAD)
            mine = (picks == slot % TOP_K) & (tl.program_id(1) == 0)
            tl.store(ids_ptr + slot + picks * 0, top_i, mask=mine)
            tl.store(weights_ptr + slot + picks * 0, top_w, mask=mine)

    @triton.jit
    def moe_gemv_down_kernel(h_ptr, w2_ptr, ids_ptr, weights_ptr, residual_ptr, out_ptr, stride_we, stride_wn,
                             stride_rt, stride_ot, D: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                             EVEN_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out[t, n] = sum over the token's picks j of weight_j * (w2[e_j, n] . h[t * k + j]): BLOCK_N
        # of the D outputs of one token, the combine in registers; HAS_RESIDUAL: plus residual[t, n]
        # (the residual stream's add, in x's dtype as eager ``h + moe(x)``).
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_offsets = tl.minimum(cols, D - 1).to(tl.int64)[:, None] * stride_wn
        ks = tl.arange(0, BLOCK_K)
        dtype = out_ptr.dtype.element_ty
        total = tl.zeros([BLOCK_N], tl.float32)
        if PDL:  # h, the ids and weights come from the kernels before
            _wait_for_previous(False)
        # Unrolled over the picks. On several warps each pick's reduction crosses them (a barrier)
        # and keeps the next pick's loads behind it (sm_90 PTX); one warp (one token's shape,
        # gemv_config) reduces inside the warp, with no barrier. Every pick's row loaded at once, one
        # [8, 1, 1024] tile a program on 4 warps, was slower: Qwen3-30B-A3B batch 1 on an H100,
        # 350.2 tok/s against 360.8 (results 2026-12-06-h100-route-pick-3e462c4.json); so was a
        # software pipeline (pick j + 1's row loaded while pick j reduces) at its best shape on an
        # H200, 446.3 against 448.7 for this loop on one warp (2026-12-06-h200-moe.json).
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
        y = total.to(dtype)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + token * stride_rt + cols, mask=cols < D, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(out_ptr + token * stride_ot + cols, y, mask=cols < D)


    return moe_gemv_gate_up_kernel, moe_gemv_down_kernel
