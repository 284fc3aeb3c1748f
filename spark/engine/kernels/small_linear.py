"""`y = pro(x) @ weight.T (+ residual)` for a few rows (decode, M <= 64): torch reference and Triton.

At batch 1-8 a linear layer is a pass over its weight: reading W is the whole cost,
so the kernel streams W once with wide loads along K, spread over enough programs
to keep every SM's loads in flight, and folds in the small ops around the matmul
that would otherwise be kernels of their own, each a launch and a round trip of
the activations through memory:

- prologue `norm_weight`: `pro(x) = RMSNorm(x) * norm_weight` (the attention or MLP norm);
- prologue `gated`: `pro(x) = silu(x[:, :I]) * x[:, I:]` (SwiGLU before the down projection);
- epilogue `residual`: `y = linear(...) + residual`;
- epilogue `gated_output`: `y = silu(x @ W_gate.T) * (x @ W_up.T)`, W = [W_gate; W_up] (the
  w13 projection with the SwiGLU after it: at batch 1 of a wide model, after the norm
  prologue (`gate_in_epilogue`), and for batches past the prologue rows).

Rounding follows the unfused ops, so either can stand in for the other, except in
the norm: the gate computes in fp32 and rounds once (as `activation.silu_and_mul_reference`),
from products rounded to x's dtype when it is an epilogue; the product accumulates in
fp32 and rounds to x's dtype before the residual is added in that dtype (as eager
`h = x + linear(...)`). The norm is folded in as `rstd * (W @ (x * norm_weight))`, `x * norm_weight`
rounded to x's dtype (the dot's operand) and the rest in fp32: the sum of squares gathers in the same pass over x as the product, and the
weight stream starts at once, where a statistics pass first would leave it waiting on
x's round trip. It skips the unfused norm's two roundings of the normalised x to x's
dtype for one, so it is closer to exact than they are (within a few bf16 ulps of
them where outputs cancel).
Every program writes its own outputs, with no atomics: results are deterministic.

From 17 to 64 rows the kernel takes no prologue: each program would recompute it for
all its rows, the gate's exp on the special function units alone costing more than
the weight stream. The gate goes to w13's epilogue instead, where each output is
computed once. There, for Llama-3.1-8B's wo, w13 and w2, the kernel still beats
cuBLAS (`benchmarks/decode_gemm_bench.py`), and the epilogue saves the gate's launch. A
weight of few outputs (wo, w2) splits K there: fp32 partials the next add-norm sums (`split_config`).
"""

import functools

import attrs
import torch
import torch.nn.functional as F

from spark.engine.kernels import activation, launch

# Bound by `_kernel()` on first use, never at import: `@triton.jit` decides between
# compiling and interpreting (TRITON_INTERPRET) when it runs, and a CPU-only install
# that only ever calls the reference may not have triton at all.
triton = None
tl = None
_silu_mul = None  # activation's SwiGLU gate, bound by `_kernel()`: the same bits as the unfused kernel
_load_weight = _activation_tile = _product = None  # the kernel's steps, bound by `_kernel()` for it to call
_wait_for_previous = None  # launch's PDL wait, bound by `_kernel()` likewise

MAX_ROWS = 64
MAX_PROLOGUE_ROWS = 16  # a norm or gate prologue up to this many rows
H200_SMS = 132  # the launch shapes were measured there: fewer programs leave SMs idle
_PLAIN, _NORM, _GATED = 0, 1, 2


@attrs.frozen
class Config:
    """How one launch tiles the problem.

    Attributes:
      block_n: weight rows (outputs) per program; the grid is `cdiv(N, block_n)` programs.
      block_k: columns loaded per step along K, contiguous in the weight's rows.
      num_warps: warps per program.
      num_stages: software-pipelining depth of the K loop.
      use_dot: tensor-core `tl.dot` with the rows padded to 16, instead of a multiply
        and a reduction over K in registers.
      defer_reduce: without `use_dot`, keep per-lane partial sums `[M, block_n, block_k]`
        and reduce them across K once after the loop, instead of after every step.
      early_tile: load the first weight tile before waiting on the previous kernel (PDL on
        Hopper): it is no earlier kernel's output, and its round trip overlaps the previous
        kernel's tail. It pays for small weights, whose kernels are mostly latency; for
        long weight streams it costs, the early programs' loads slowing the kernel still
        draining (8B batch 1 on an H200: 235.6 tok/s with it, 239.9 without).
      split_k: partitions of K, each its own program (`small_linear_split_k_triton`
        only): the grid is `cdiv(N, block_n) * split_k` programs, each writing an fp32
        partial product that the consumer sums.
      flat_row: a launch of one row takes its product (without tensor cores) in the weight
        tile's own layout, `x` broadcast over the tile's rows. The `[rows, outputs, K]`
        product otherwise moves the whole tile through shared memory into a layout of its
        own, barriers between (sm_90 SASS), which a short stream pays on its critical path;
        but that move also has ptxas issue every load of the tile before the first multiply,
        where the flat product's loads go out a few at a time between the multiplies, and a
        long stream then has fewer bytes in flight. So small weights only (`default_config`):
        graphed batch-1 steps on an H100 (decode_ablation.py), SmolLM2-135M 2048 tok/s against
        1871, Qwen3-30B-A3B and Llama-3.1-8B tied; every one-row launch flat, Llama-3.1-8B
        172.7 against 186.3 (results 2026-12-06-h100-flat-row-4f04f4c.json).
      trigger_first: let the next kernel launch before this one's wait on the kernel before returns
        (PDL's trigger ahead of the wait), so that its programs are resident, and their launch
        paid, while this kernel still waits: the MoE router's launch (``moe_gemv.ROUTER_CONFIG``),
        a short kernel between two long streams.
    """

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = False
    defer_reduce: bool = True
    early_tile: bool = False
    split_k: int = 1
    flat_row: bool = False
    trigger_first: bool = False


# One-row weights below this size take the short-stream launch shapes of `tiling` (Llama-3.1-8B's
# smallest, wo, is 33.5 MB; Qwen3-30B-A3B's attention weights 17-21 MB).
SMALL_WEIGHT_BYTES = 24 << 20

# Weights up to this size load their first tile early (`Config.early_tile`): SmolLM2's
# are at most 3.5 MB, Llama-3.1-8B's at least 33.5 MB.
EARLY_TILE_MAX_BYTES = 8 << 20


def default_config(m: int, n: int, k: int, *, norm: bool = False, gated: bool = False,
                   gated_output: bool = False) -> Config:
    """`tiling(...)`, with the first weight tile loaded early for a small weight (not
    with a gated output, whose two tiles a step the early path does not load), and one
    row of a small weight in the flat product (`Config.flat_row`)."""
    cfg = tiling(m, n, k, norm=norm, gated=gated, gated_output=gated_output)
    if n * k * 2 > EARLY_TILE_MAX_BYTES:
        return cfg
    return attrs.evolve(cfg, early_tile=not gated_output, flat_row=True)


def tiling(m: int, n: int, k: int, *, norm: bool = False, gated: bool = False,
           gated_output: bool = False) -> Config:
    """The launch shape for `m` rows of a `[n, k]` bf16 weight with the given prologue,
    the fastest of a sweep on an H200 (benchmarks/small_linear_bench.py) for Llama-3.1-8B
    and SmolLM2-135M shapes.

    One or two rows: multiply and reduce in registers, a few weight rows per program and
    long runs along K, so that thousands of programs each keep 16-byte loads in flight.
    At one row with K >= 2048 the launch shapes are the fastest of a sweep inside the
    graphed decode step (benchmarks/decode_ablation.py, Llama-3.1-8B, us a layer saved
    against the earlier shapes, each alone, on an H200 where those ran at 229 tok/s: w13
    8x2048 on 2 warps 4.5, wo 8x2048 3.0, w2 8x2048 on 8 warps 2.9, wqkv 8x1024 on 2 warps
    1.6; all together 0.3% on one where they ran at 244): runs of 2048 columns put twice
    the bytes of 1024 in flight per load.
    More rows: the tensor cores, whose weight loads Triton pipelines through shared
    memory; the FMA path would spend more time on arithmetic than on loads. The dot path
    pays for prologues (each warp recomputes the whole padded 16-row tile), so a gated
    prologue stays on the FMA path up to 4 rows.
    """
    wide = n >= 16384  # vocabulary projections, Llama's w13: many programs already
    small = Config(8, 512)
    long_runs = Config(4, 2048, defer_reduce=False)
    dot = Config(32, 256, num_warps=4, num_stages=4, use_dot=True)
    wide_dot = Config(32, 128, num_warps=2, num_stages=5, use_dot=True)
    if gated_output and m == 1:  # w13 with the norm before and the gate after it, at batch 1
        # 4 gate and 4 up rows a program, runs of 2048 columns on 2 warps: inside the graphed
        # 8B step on an H200, 1.9 us a layer faster than 8 of each, 2.3-6 faster than the
        # other shapes tried (decode_ablation.py w13g:*).
        return Config(4, 2048, defer_reduce=False, num_warps=2)
    if gated_output:  # two weight tiles a step (gate and up): half the outputs per program
        return Config(64, 128, num_stages=4, use_dot=True)
    if m > MAX_PROLOGUE_ROWS:
        # 64 rows on an H200: 64x32 output tiles over K steps of 256, or 64x128 over 128
        # for a wide weight: Llama-3.1-8B's wo 11.6 us (cuBLAS 12.2), w2 33.2 (35.2),
        # w13 60.4 (61.2).
        return Config(128, 128, num_stages=4, use_dot=True) if wide else dot
    if k >= 2048:
        if m == 1 and n * k * 2 < SMALL_WEIGHT_BYTES and not gated:
            # A weight of a few tens of MB (an MoE model's attention: Qwen3-30B-A3B's wqkv 21 MB, wo
            # 17 MB) is too short a stream for 8-row programs to fill an SM's loads: more programs of
            # fewer rows on one or two warps, inside that model's graphed batch-1 step on an H100
            # (decode_ablation.py wqkv:4x1024w1, wo:2x4096w2; 1.45 us a layer each).
            return Config(4, 1024, defer_reduce=False, num_warps=1) if norm else \
                Config(2, 4096, defer_reduce=False, num_warps=2)
        if m == 1:
            if norm:  # w13 (wide) and wqkv
                return Config(8, 2048 if wide else 1024, defer_reduce=False, num_warps=2)
            if gated:  # w2
                return Config(8, 2048, defer_reduce=False, num_warps=8)
            return long_runs if n * k * 2 >= 96 << 20 else Config(8, 2048, defer_reduce=False)
        if m == 2 and (norm or gated):
            return long_runs if norm else small
        if m <= 4:
            return Config(4, 512) if gated else dot
        return wide_dot if wide or gated else dot
    # SmolLM-sized K: a row in one or two steps.
    block_k = triton_next_power_of_2(k)
    if m == 1:
        return Config(8 if wide else 4, block_k, defer_reduce=block_k <= 1024 and not wide)
    if m == 2 and not wide:
        return Config(4, block_k, defer_reduce=False)
    if m <= 4 and not wide and n < 2048:
        return Config(4, 512) if k > 1024 else Config(4, min(block_k, 1024), defer_reduce=False)
    if m <= 4:
        return dot
    if wide:
        return wide_dot
    return Config(16, 128, num_warps=4, num_stages=6, use_dot=True) if -(-n // 32) < H200_SMS else dot


def split_config(m: int, n: int, k: int) -> Config | None:
    """The split-K launch shape for a plain product of `m` rows (33-64) with an `[n, k]`
    weight, or None where the unsplit kernel is the faster.

    A weight of fewer than 132 64-output tiles (an H200's SMs) splits K in two, in tiles
    of 64 outputs over K steps of 256: inside the graphed 8B decode step at 64 rows (wo
    and w2, N = 4096), 2.5 us a layer faster than the unsplit 32-output tiles (on one
    H200, decode_ablation.py split_*); 4 partitions of 64-output tiles, or 2 of 32, were
    slower than none.
    """
    split = Config(64, 256, num_stages=3, use_dot=True, split_k=2)
    if not (MAX_PROLOGUE_ROWS * 2 < m <= MAX_ROWS) or -(-n // split.block_n) >= H200_SMS:
        return None
    return split if k % (split.split_k * split.block_k) == 0 else None


def gate_in_epilogue(m: int, k: int) -> bool:
    """Whether one row's SwiGLU gate goes in w13's epilogue (`k` its input width, the model's
    hidden size), not in w2's prologue, where every one of w2's programs computes all of it
    again. Llama-3.1-8B (k 4096): 1,024 programs x 14,336 exps a step moved out of w2, the
    step 0.8% faster on an H200 (decode_ablation.py gate_in_w2); SmolLM2 (k 576): 144 x 1,536,
    and the prologue is 7% faster there, where the step is a chain of short kernels."""
    return m == 1 and k >= 2048


def beats_cublas(m: int, k: int, dtype: torch.dtype) -> bool:
    """Whether the plain product of `m` rows (past the prologue rows) with a half-precision
    weight `k` wide is faster here than in cuBLAS on an H200: measured at 64 rows for
    Llama-3.1-8B's wo, w13 and w2. Its wqkv was 5% slower alone, and in 64x128 tiles in
    the decode chain no faster (+0.6 and -0.6 us a layer on two H200s), so
    `llama.Attention` keeps cuBLAS for it. SmolLM2's K was not measured."""
    return MAX_PROLOGUE_ROWS * 2 < m <= MAX_ROWS and k >= 2048 and dtype in (torch.bfloat16, torch.float16)


def triton_next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` without importing triton (the reference path needs none)."""
    return 1 << (n - 1).bit_length()


def small_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    gated_output: bool = False,
) -> torch.Tensor:
    """`pro(x) @ weight.T (+ residual)` (torch reference).

    Args:
      x: `[M, K]`, or `[M, 2K]` when `gated` (gate columns first).
      weight: `[N, K]`, an `nn.Linear` weight, x's dtype.
      norm_weight: `[K]`; when given, `pro(x) = rms_norm(x) * norm_weight`, here in fp32
        with the rstd applied to the product (as the kernel; `norm.rms_norm_reference`
        would round the normalised x twice to x's dtype).
      eps: added to the mean square before the rsqrt.
      gated: `pro(x) = silu(x[:, :K]) * x[:, K:]`, computed in fp32 and rounded once.
      residual: `[M, N]`, x's dtype, added to the rounded product.
      gated_output: `y = silu_and_mul(x @ weight.T)`, `[M, N / 2]` (the gate's rows first).

    Returns:
      `[M, N]` in x's dtype; the product accumulates in fp32 and is rounded once.
    """
    assert norm_weight is None or not gated, "one prologue at a time"
    if norm_weight is not None:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        scaled = (xf * norm_weight.float()).to(x.dtype)
        y = (F.linear(scaled.float(), weight.float()) * rstd).to(x.dtype)
    else:
        if gated:
            x = activation.silu_and_mul_reference(x)
        y = F.linear(x.float(), weight.float()).to(x.dtype)
    if gated_output:
        y = activation.silu_and_mul_reference(y)
    return y if residual is None else y + residual


def small_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    gated_output: bool = False,
    config: Config | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`pro(x) @ weight.T (+ residual)` in one kernel (Triton); arguments as `small_linear_reference`.

    Allocates only its `[M, N]` output, never synchronises: CUDA-graph capturable
    once the shape has been compiled by an earlier call.

    Args:
      x: `[M, K]` (`[M, 2K]` when `gated`), M <= 64 (16 with a prologue), rows may be strided.
      weight: `[N, K]`, x's dtype, contiguous along K.
      norm_weight, eps, gated, residual, gated_output: see `small_linear_reference`.
      config: launch shape; `default_config(M, N, K, norm=..., gated=...)` when None; a
        tensor-core (`use_dot`) one with `gated_output`.
      out_dtype: the output's dtype, x's when None; the values are x's dtype's all the same (a
        head's fp32 logits come out as the projection and a cast would give them, one launch less).

    Returns:
      `[M, N]` contiguous (`[M, N / 2]` with `gated_output`), in `out_dtype`.
    """
    assert norm_weight is None or not gated, "one prologue at a time"
    assert x.dim() == 2 and weight.dim() == 2 and weight.dtype == x.dtype
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    assert m <= MAX_ROWS, f"{m} rows: this kernel is for decode batches of at most {MAX_ROWS}"
    assert m <= MAX_PROLOGUE_ROWS or (norm_weight is None and not gated), f"{m} rows: no prologue past {MAX_PROLOGUE_ROWS}"
    assert x.shape[1] == (2 * k if gated else k)
    assert weight.stride(1) == 1, "weight rows must be contiguous along K"
    if gated_output:
        assert residual is None and n % 2 == 0
        n //= 2  # outputs: one per (gate, up) pair of weight rows
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if norm_weight is not None:
        assert norm_weight.shape == (k,) and norm_weight.stride(0) == 1
    if residual is not None:
        assert residual.shape == (m, n) and residual.dtype == x.dtype and residual.stride(1) == 1
    cfg = config or default_config(m, n, k, norm=norm_weight is not None, gated=gated, gated_output=gated_output)
    assert cfg.use_dot or not cfg.defer_reduce or not gated_output, "the gated epilogue reduces every step"
    assert not (cfg.early_tile and gated_output), "the early tile is the gate's alone"
    assert cfg.split_k == 1, "a split K writes partials: small_linear_split_k_triton"
    prologue = _NORM if norm_weight is not None else _GATED if gated else _PLAIN
    _launch(x, weight, out, cfg, prologue=prologue, norm_weight=norm_weight, eps=eps, residual=residual,
            gated_output=gated_output)
    return out


def small_linear_split_k_reference(x: torch.Tensor, weight: torch.Tensor, split_k: int) -> torch.Tensor:
    """The fp32 partial products of `x @ weight.T` over `split_k` equal runs of K (torch reference).

    Args:
      x: `[M, K]`.
      weight: `[N, K]`, x's dtype.
      split_k: partitions of K; K must be a multiple.

    Returns:
      `[split_k, M, N]` fp32; their sum is the product before its rounding.
    """
    k = weight.shape[1]
    assert k % split_k == 0
    xs = x.float().reshape(x.shape[0], split_k, k // split_k).transpose(0, 1)  # [S, M, K/S]
    ws = weight.float().reshape(weight.shape[0], split_k, k // split_k).transpose(0, 1)  # [S, N, K/S]
    return torch.bmm(xs, ws.transpose(1, 2))


def small_linear_split_k_triton(x: torch.Tensor, weight: torch.Tensor, config: Config) -> torch.Tensor:
    """`small_linear_split_k_reference` in one kernel (Triton), `config.split_k` partitions.

    At 33-64 rows a plain projection of a weight with few outputs (Llama-3.1-8B's wo and
    w2, N = 4096) gets few programs: in 32-output tiles 128 programs on an H200's 132 SMs,
    each streaming its whole run of K, and every program also re-reads the whole
    activation tile from L2 (16-output tiles, twice the programs, were slower). Splitting
    K keeps wide tiles and gives the GPU enough programs. The consumer, the residual add
    before the next norm (`norm.add_rms_norm_triton`), sums the partials: no extra launch.

    Args:
      x: `[M, K]` bf16/fp16 (fp32 on the CPU), M <= 64, rows may be strided.
      weight: `[N, K]`, x's dtype, contiguous along K.
      config: launch shape; `config.split_k` divides K into runs that are whole `block_k` steps.

    Returns:
      `[split_k, M, N]` fp32 partials, contiguous.
    """
    assert x.dim() == 2 and weight.dim() == 2 and weight.dtype == x.dtype and weight.stride(1) == 1
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    assert m <= MAX_ROWS and x.shape[1] == k and not config.early_tile
    assert k % (config.split_k * config.block_k) == 0, "each partition is whole block_k steps"
    out = torch.empty(config.split_k, m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    _launch(x, weight, out, config, partials=True)
    return out


def _launch(x, weight, out, cfg: Config, *, prologue=_PLAIN, norm_weight=None, eps=0.0, residual=None,
            gated_output=False, partials=False) -> None:
    """One launch of the kernel into `out` (`[M, N]`, or `[split_k, M, N]` fp32 `partials`)."""
    m, n, k = x.shape[0], out.shape[-1], weight.shape[1]
    kernel = _kernel()
    block_m = max(16, triton_next_power_of_2(m)) if cfg.use_dot else triton_next_power_of_2(m)
    # Without a norm or a residual the kernel never touches those pointers; x fills them.
    kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x, weight, x if norm_weight is None else norm_weight, x if residual is None else residual, out,
        m, n, x.stride(0), x.stride(1), weight.stride(0), 0 if residual is None else residual.stride(0), eps,
        K=k, PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, GATED_OUTPUT=gated_output,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, USE_DOT=cfg.use_dot, DEFER_REDUCE=cfg.defer_reduce,
        # A float32 dot would default to tf32 on the tensor cores; keep it exact.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", EARLY_TILE=cfg.early_tile,
        SPLIT_K=cfg.split_k, PARTIALS=partials, FLAT_ROW=cfg.flat_row and m == 1 and not cfg.use_dot,
        TRIGGER_FIRST=cfg.trigger_first,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch.pdl(kernel, x),
    )


@functools.cache
def _kernel():
    """Import triton and JIT the kernel: done at first launch so that TRITON_INTERPRET,
    read by `@triton.jit`, is whatever the caller (e.g. a test module) set by then."""
    global triton, tl, _silu_mul, _wait_for_previous
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401 (tl.extra.cuda, for PDL)

    _silu_mul = activation.jit_silu_mul()
    _wait_for_previous = launch.jit_wait_for_previous()

    @triton.jit
    def load_weight(w_rows, k, K: tl.constexpr, EVEN_K: tl.constexpr):
        """A `[BN, BK]` weight tile at columns `k`; unmasked (16-byte loads) when BLOCK_K divides K."""
        if EVEN_K:
            w = tl.load(w_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
        return w

    @triton.jit
    def activation_tile(x_rows, k, row_ok, sum_sq, norm_w_ptr, stride_xk, dtype, K: tl.constexpr, PROLOGUE: tl.constexpr):
        """`pro(x)` at columns `k`, in x's dtype, and the norm's sums of squares with these columns added."""
        x_mask = row_ok[:, None] & (k < K)[None, :]
        # Prologue in fp32 (the interpreter mishandles bf16 arithmetic). Masked lanes load 0 and give 0.
        if PROLOGUE == 2:
            gate = tl.load(x_rows + k[None, :] * stride_xk, mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + (k + K)[None, :] * stride_xk, mask=x_mask, other=0.0).to(tl.float32)
            a = _silu_mul(gate, up).to(dtype)
        else:
            a = tl.load(x_rows + k[None, :] * stride_xk, mask=x_mask, other=0.0)
            if PROLOGUE == 1:
                # RMSNorm(x) * g = rstd * (x * g): the sum of squares gathers along the same
                # pass and rstd scales the fp32 product at the end, so the weight stream
                # starts at once instead of after a statistics pass over x.
                xf = a.to(tl.float32)
                sum_sq += xf * xf
                g = tl.load(norm_w_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                a = (xf * g[None, :]).to(dtype)  # the dot's operand type, on both paths
        return a, sum_sq

    @triton.jit
    def product(acc, a, w, USE_DOT: tl.constexpr, DEFER_REDUCE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                FLAT_ROW: tl.constexpr):
        """`acc` plus the tile product `a @ w.T` (per lane along K with DEFER_REDUCE)."""
        # One return: Triton generates the code after a return in a constexpr branch too.
        if USE_DOT:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        elif FLAT_ROW:
            # One row: `a` [1, BK] broadcast over the weight tile [BN, BK], in the layout the tile
            # loads in (`Config.flat_row`).
            if DEFER_REDUCE:
                acc += a.to(tl.float32) * w.to(tl.float32)  # [BN, BK]
            else:
                acc += tl.sum(a.to(tl.float32) * w.to(tl.float32), axis=1)[None, :]
        elif DEFER_REDUCE:
            acc += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BM, BN, BK]
        else:
            acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        return acc

    global _load_weight, _activation_tile, _product
    _load_weight, _activation_tile, _product = load_weight, activation_tile, product

    @triton.jit
    def small_linear_kernel(
        x_ptr, w_ptr, norm_w_ptr, residual_ptr, out_ptr,
        M, N, stride_xm, stride_xk, stride_wn, stride_rm, eps,
        # K is a compile-time constant: a model has a handful of them, the K loop gets a
        # static trip count (pipelined, and a plain `range` the interpreter can run).
        K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED_OUTPUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, DEFER_REDUCE: tl.constexpr,
        DOT_PRECISION: tl.constexpr, EARLY_TILE: tl.constexpr, SPLIT_K: tl.constexpr, PARTIALS: tl.constexpr, PDL: tl.constexpr,
        FLAT_ROW: tl.constexpr, TRIGGER_FIRST: tl.constexpr,
    ):
        dtype = x_ptr.dtype.element_ty  # the operands' (the output's too, unless split: fp32 partials)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        # The last program's spare outputs re-read weight row N - 1 instead of masking:
        # the weight loads, the whole cost, stay unmasked and 16 bytes wide.
        w_rows = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_wn  # [BN, 1]
        # This program's run of K: all of it, or partition program_id(1) of SPLIT_K.
        K_PART: tl.constexpr = K // SPLIT_K
        ks = tl.program_id(1) * K_PART + tl.arange(0, BLOCK_K)
        if EARLY_TILE:
            # The weights are no earlier kernel's output: the first tile loads before the
            # wait, in flight while the previous kernel drains (see `Config.early_tile`).
            w_first = _load_weight(w_rows, ks, K, EVEN_K)
        if PDL:  # x and the residual come from earlier kernels
            _wait_for_previous(TRIGGER_FIRST)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
        # With a gated output the up rows follow the N gate rows: output j is silu(gate j) * up j.
        w_up_rows = w_rows + N * stride_wn
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if PROLOGUE == 1:
            sum_sq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)  # the norm's per-lane sums of squares
        else:
            sum_sq = tl.zeros([1, 1], tl.float32)  # unused
        if USE_DOT or not DEFER_REDUCE:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        elif FLAT_ROW:
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        else:
            # Per-lane partial sums, reduced across K once after the loop: the loop body
            # is loads and FMAs only, no shuffles or shared-memory round trips per step.
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        if EARLY_TILE:  # the first step, on the early tile
            a, sum_sq = _activation_tile(x_rows, ks, row_ok, sum_sq, norm_w_ptr, stride_xk, dtype, K, PROLOGUE)
            acc = _product(acc, a, w_first, USE_DOT, DEFER_REDUCE, DOT_PRECISION, FLAT_ROW)
        for k0 in range(BLOCK_K if EARLY_TILE else 0, K_PART, BLOCK_K):
            k = k0 + ks
            a, sum_sq = _activation_tile(x_rows, k, row_ok, sum_sq, norm_w_ptr, stride_xk, dtype, K, PROLOGUE)
            acc = _product(acc, a, _load_weight(w_rows, k, K, EVEN_K), USE_DOT, DEFER_REDUCE, DOT_PRECISION, FLAT_ROW)
            if GATED_OUTPUT:
                acc_up = _product(acc_up, a, _load_weight(w_up_rows, k, K, EVEN_K), USE_DOT, DEFER_REDUCE, DOT_PRECISION, FLAT_ROW)
        if not USE_DOT and DEFER_REDUCE:
            if FLAT_ROW:
                acc = tl.sum(acc, axis=1)[None, :]
            else:
                acc = tl.sum(acc, axis=2)
        if PROLOGUE == 1:
            rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / K + eps)[:, None]
            acc = acc * rstd
            acc_up = acc_up * rstd  # zeros unless GATED_OUTPUT

        if PARTIALS:  # fp32 partials [SPLIT_K, M, N]: no prologue, gate or residual here
            part = out_ptr + tl.program_id(1).to(tl.int64) * M * N
            tl.store(part + rows.to(tl.int64)[:, None] * N + cols[None, :], acc,
                     mask=row_ok[:, None] & col_ok[None, :])
        else:
            if GATED_OUTPUT:  # both products rounded as the unfused projection's output is
                gate = acc.to(dtype).to(tl.float32)
                y = _silu_mul(gate, acc_up.to(dtype).to(tl.float32)).to(dtype)
            else:
                y = acc.to(dtype)
            out_mask = row_ok[:, None] & col_ok[None, :]
            if HAS_RESIDUAL:
                r = tl.load(residual_ptr + rows.to(tl.int64)[:, None] * stride_rm + cols[None, :], mask=out_mask, other=0.0)
                y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=out_mask)

    return small_linear_kernel
