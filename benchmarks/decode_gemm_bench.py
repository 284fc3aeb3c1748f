"""Triton GEMMs for decode batches of 17-128 rows against cuBLAS, alone and fused with the ops around them (H200).

    python benchmarks/decode_gemm_bench.py [--out FILE.json] [--budget-s 150] [--jobs 14]
    TRITON_INTERPRET=1 python benchmarks/decode_gemm_bench.py --dry   # CPU: every candidate vs a torch reference

At batch 64 a Llama-3.1-8B step's linears are still a pass over their weights (64 FLOP a weight byte; the
H200 turns compute-bound at ~185), yet cuBLAS reaches only ~81.5% of HBM bandwidth on them, and the model
runs an add+RMSNorm kernel before wqkv and w13 and a SwiGLU kernel after w13. For the four projections of a layer
at M = 64, 128 and 32 rows this times, after checking each against a float32 reference:
1. `x @ W.T` over a sweep of tilings: row tile, weight rows and K columns per step, warps, pipeline depth,
   the weight as the MMA's A operand ("T", for wgmma's 64-row minimum); then split-K on the best tilings,
   with fp32 partials and a reduce kernel ("/2r") or fp32 atomics whose last program finishes the tile ("/2a");
2. RMSNorm in the prologue with no statistics pass: the norm weight is folded into W's columns once, each
   row's sum of squares is taken from the x tiles the K loop loads anyway, and the epilogue scales the
   rows by its rsqrt ("norm"); "addnorm" also adds the residual stream in the prologue and writes the sum;
3. w13 with a SwiGLU epilogue (gate and up tiles, two dots, `silu(gate) * up` out);
4. wo and w2 with the residual add in the epilogue;
each against what it replaces: cuBLAS (`F.linear`) and the engine's norm / add+norm / silu_and_mul kernels.
Times are CUDA-graph replays rotating over weight copies larger than L2 (small_linear_bench.Bench), so the
weights stream from HBM; GB/s counts weight bytes. Kernels compile in worker processes ahead of the timing
(--jobs); --budget-s bounds the whole run, compiles included, and cuts each sweep short when spent.

What the engine took from it (2026-12-01, H200): at 64 rows the plain product beats cuBLAS on wo, w13 and
w2, and none of the fused-norm variants pays; see spark/engine/kernels/small_linear.py. That run also
failed the check on 9 fused-norm candidates (split "/2r" and some norm+SwiGLU tilings, up to 6% of the
largest output off) that pass under the interpreter: unexplained, and none of them is used.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import math
import multiprocessing
import os
import sys
import time

START = time.time()

import attrs  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from small_linear_bench import PEAK_GBPS, Bench  # noqa: E402
from spark.engine.kernels import activation, launch, norm  # noqa: E402

# Bound by `_kernels()` on first use, as in spark/engine/kernels: TRITON_INTERPRET is read when they are jitted.
triton = None
tl = None
finish_tile = None

EPS = 1e-5
SMS = 132
SMEM_BYTES = 227 * 1024
LAYERS = 32
# (projection, K, N, variants); w13's rows are gate 0..14335 then up 14336..28671.
SHAPES = [
    ("wqkv", 4096, 6144, ("plain", "norm", "addnorm")),
    ("wo", 4096, 4096, ("plain", "residual")),
    ("w13", 4096, 28672, ("plain", "swiglu", "norm+swiglu", "addnorm+swiglu")),
    ("w2", 14336, 4096, ("plain", "residual")),
]
# --dry: the same variants on a hidden size of 64, N off the block sizes (96), 5 rows (one part-filled row
# tile) and 20 (two tiles).
DRY_SHAPES = [(p, 64, n, v) for (p, _, _, v), n in zip(SHAPES, (96, 64, 128, 64))]
MS, DRY_MS = (64, 128, 32), (20, 5)  # the batch this is for first, should the budget run out


@attrs.frozen
class Variant:
    """What a kernel does around `x @ W.T`: `add` the residual stream to x first (and write the sum),
    `norm` (RMSNorm) the rows, `gated` SwiGLU over gate/up halves, add a `residual` to the output."""

    add: bool = False
    norm: bool = False
    gated: bool = False
    residual: bool = False


VARIANTS = {
    "plain": Variant(), "norm": Variant(norm=True), "addnorm": Variant(add=True, norm=True),
    "swiglu": Variant(gated=True), "norm+swiglu": Variant(norm=True, gated=True),
    "addnorm+swiglu": Variant(add=True, norm=True, gated=True), "residual": Variant(residual=True),
}


@attrs.frozen
class Cfg:
    """One launch's tiling: rows x weight rows x K per step, warps, pipeline depth, the weight as the
    MMA's A operand (`swap_ab`), and split-K: programs per tile along K and how they combine."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = False
    split_k: int = 1
    split_mode: str = "none"  # "reduce": fp32 partials + a reduce kernel; "atomic": fp32 atomics, last program finishes

    def __str__(self) -> str:
        s = f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}" + "T" * self.swap_ab
        return s + (f"/{self.split_k}{self.split_mode[0]}" if self.split_k > 1 else "")

    def smem(self, variant: Variant = None) -> int:
        """Shared memory for `num_stages` x and weight tiles (a second x tile with add, a second weight tile
        gated): what Triton 3.6 allocates for the plain kernel on sm_90, an upper bound for the others."""
        v = variant or Variant()
        return self.num_stages * (self.block_m * (1 + v.add) + self.block_n * (1 + v.gated)) * self.block_k * 2


def plain_sweep(m: int, dry: bool) -> list[Cfg]:
    """Every tiling of the grid below that fits in shared memory, nearest its first one first: a sweep
    cut short by the budget has then measured one step in every direction before any two."""
    if dry:
        return [Cfg(16, bn, bk, swap_ab=s) for bn in (16, 64) for bk in (16, 32) for s in (False, True)]
    bms = [m] if m <= 64 else [128, 64]
    grid = [Cfg(bm, bn, bk, w, s) for bm in bms for bn in (64, 32, 128) for bk in (128, 64, 256)
            for w in (4, 8) for s in (4, 3, 5)]
    # Weight rows as the A operand: a wgmma takes 64 rows a warp group, more than 32 token rows give.
    grid += [Cfg(bm, bn, bk, 4, s, swap_ab=True) for bm in bms for bn in (64, 128) for bk in (128, 256) for s in (4, 3)]
    center = grid[0]
    fields = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "swap_ab")
    distance = lambda c: sum(getattr(c, f) != getattr(center, f) for f in fields)  # noqa: E731
    return sorted((c for c in grid if c.smem() <= SMEM_BYTES), key=distance)


def round2_candidates(case: Case, ranked: list[Cfg], dry: bool) -> list[tuple[str, Cfg]]:
    """After the plain sweep: each fused variant on the two best tilings it fits in (first: the per-layer
    sums need them), split-K on the two best plain tilings where they leave SMs idle, then each fused
    variant on its best tiling split in two."""

    def splits(cfg: Cfg) -> list[Cfg]:
        tiles = -(-case.m // cfg.block_m) * -(-case.n // cfg.block_n)  # w13 has 224 or more
        if (case.proj == "w13" or tiles >= 2 * SMS) and not dry:
            return []
        return [attrs.evolve(cfg, split_k=s, split_mode=mode) for s in (2, 4) for mode in ("atomic", "reduce")
                if case.k % (s * cfg.block_k) == 0]

    fits = {v: [c for c in ranked if c.smem(VARIANTS[v]) <= SMEM_BYTES][:2] for v in case.variants[1:]}
    out = [(v, c) for v in fits for c in fits[v]]
    out += [("plain", c) for cfg in ranked[:2] for c in splits(cfg)]
    out += [(v, c) for v in fits if fits[v] for c in splits(fits[v][0])[:2]]
    return out


# ---------------------------------------------------------------------------------------------- kernels


@functools.cache
def _kernels():
    """Import triton and jit the kernels at first launch (TRITON_INTERPRET is read then). `finish_tile`,
    called from both kernels, is bound as a module global: Triton looks jitted callees up there."""
    global triton, tl, finish_tile
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401 (tl.extra.cuda, for PDL)

    @triton.jit
    def finish_tile(acc, up, rstd, res_ptrs, out_ptrs, mask,
                    NORM: tl.constexpr, GATED: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """fp32 sums -> output, rounding where the unfused ops do: the GEMM output (gate and up) to x's
        dtype, SwiGLU in fp32 rounded once, the residual added to the rounded product."""
        dtype = out_ptrs.dtype.element_ty
        if NORM:  # x's rms, computed beside the product, scales each row of it: sum_k (x_k / rms) w_k
            acc = acc * rstd
            up = up * rstd
        y = acc
        if GATED:
            gate = acc.to(dtype).to(tl.float32)
            y = gate / (1.0 + tl.exp(-gate)) * up.to(dtype).to(tl.float32)
        y = y.to(dtype)
        if HAS_RESIDUAL:
            r = tl.load(res_ptrs, mask=mask, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(out_ptrs, y, mask=mask)

    @triton.jit
    def decode_gemm_kernel(
        x_ptr, x2_ptr, w_ptr, res_ptr, out_ptr, h_ptr, part_ptr, ssq_ptr, count_ptr,
        M, N, stride_xm, stride_wn, up_offset, eps,
        part_split_stride, part_up_stride, ssq_split_stride, ssq_tile_stride,
        K_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_MODE: tl.constexpr,
        ADD: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:  # x, the residuals and (atomic split-K) the workspace come from earlier kernels
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        dtype = out_ptr.dtype.element_ty
        # Row tiles vary fastest, so the programs sharing a weight tile run together and it leaves HBM once.
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        ks = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
        # Spare rows and columns of edge tiles re-read row M - 1 and weight row N - 1: no load is masked.
        x_rows = tl.minimum(rows, M - 1).to(tl.int64) * stride_xm
        x_ptrs = x_ptr + x_rows[:, None] + ks[None, :]
        w_ptrs = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_wn + ks[None, :]
        if ADD:
            x2_ptrs = x2_ptr + x_rows[:, None] + ks[None, :]
            h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * (K_SPLIT * SPLIT_K) + ks[None, :]
            h_mask = row_ok[:, None] & (pid_n == 0)  # one column of programs writes the new residual stream
        if GATED:
            u_ptrs = w_ptrs + up_offset  # the up row of each gate row
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros_like(acc)
        ssq = tl.zeros([BLOCK_M], tl.float32)
        for _ in range(K_SPLIT // BLOCK_K):
            a = tl.load(x_ptrs)
            if ADD:  # rounded to x's dtype as eager `h = x + residual` is, before the norm sees it
                a = (a.to(tl.float32) + tl.load(x2_ptrs).to(tl.float32)).to(dtype)
                tl.store(h_ptrs, a, mask=h_mask)
                x2_ptrs += BLOCK_K
                h_ptrs += BLOCK_K
            if NORM:  # the norm's statistics from the tile already loaded: no pass of its own over x
                af = a.to(tl.float32)
                ssq += tl.sum(af * af, axis=1)
            w = tl.load(w_ptrs)
            if SWAP_AB:
                acc = tl.dot(w, tl.trans(a), acc)
            else:
                acc = tl.dot(a, tl.trans(w), acc)
            if GATED:
                u = tl.load(u_ptrs)
                if SWAP_AB:
                    up = tl.dot(u, tl.trans(a), up)
                else:
                    up = tl.dot(a, tl.trans(u), up)
                u_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SWAP_AB:
            acc = tl.trans(acc)
            up = tl.trans(up)

        out_off = rows.to(tl.int64)[:, None] * N + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if SPLIT_K == 1:
            rstd = tl.rsqrt(ssq / K_SPLIT + eps)[:, None]
            finish_tile(acc, up, rstd, res_ptr + out_off, out_ptr + out_off, mask, NORM, GATED, HAS_RESIDUAL)
        else:
            # Partial sums [split][gate, up][M, N]; sums of squares per split (reduce) or per tile column (atomic).
            part_ptrs = part_ptr + pid_k * part_split_stride + out_off
            ssq_ptrs = ssq_ptr + pid_k * ssq_split_stride + pid_n * ssq_tile_stride + rows
            if SPLIT_MODE == 1:
                tl.store(part_ptrs, acc, mask=mask)
                if GATED:
                    tl.store(part_ptrs + part_up_stride, up, mask=mask)
                if NORM:
                    tl.store(ssq_ptrs, ssq, mask=row_ok & (pid_n == 0))
            else:
                tl.atomic_add(part_ptrs, acc, mask=mask, sem="relaxed")
                if GATED:
                    tl.atomic_add(part_ptrs + part_up_stride, up, mask=mask, sem="relaxed")
                if NORM:
                    tl.atomic_add(ssq_ptrs, ssq, mask=row_ok, sem="relaxed")
                # Every thread's adds are done before the tile's counter is released; the program that
                # brings it to SPLIT_K acquires all of them, reads the sums where the atomics went (adding
                # 0: the interpreter has no float exchange) and leaves zeros for the next call. One
                # launch, no memset, no reduce kernel.
                tl.debug_barrier()
                tile = pid_m * tl.num_programs(1) + pid_n
                last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
                tl.debug_barrier()
                # (Masked lanes of an atomic return garbage: zeroed, so that no program's unused
                # epilogue overflows in exp.)
                acc = tl.where(mask & last, tl.atomic_add(part_ptrs, 0.0, mask=mask & last, sem="relaxed"), 0.0)
                tl.store(part_ptrs, 0.0, mask=mask & last)
                if GATED:
                    up = tl.atomic_add(part_ptrs + part_up_stride, 0.0, mask=mask & last, sem="relaxed")
                    up = tl.where(mask & last, up, 0.0)
                    tl.store(part_ptrs + part_up_stride, 0.0, mask=mask & last)
                if NORM:
                    ssq = tl.where(row_ok & last, tl.atomic_add(ssq_ptrs, 0.0, mask=row_ok & last, sem="relaxed"), 0.0)
                    tl.store(ssq_ptrs, 0.0, mask=row_ok & last)
                rstd = tl.rsqrt(ssq / (K_SPLIT * SPLIT_K) + eps)[:, None]
                finish_tile(acc, up, rstd, res_ptr + out_off, out_ptr + out_off, mask & last, NORM, GATED, HAS_RESIDUAL)
                tl.store(count_ptr + tile, 0, mask=last)

    @triton.jit
    def split_reduce_kernel(
        part_ptr, ssq_ptr, res_ptr, out_ptr, M, N, eps, part_split_stride, part_up_stride,
        K_TOTAL: tl.constexpr, SPLIT_K: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        off = row.to(tl.int64) * N + cols
        acc = tl.zeros([BLOCK], tl.float32)
        up = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(part_ptr + s * part_split_stride + off, mask=ok, other=0.0)
            if GATED:
                up += tl.load(part_ptr + s * part_split_stride + part_up_stride + off, mask=ok, other=0.0)
        rstd = 1.0
        if NORM:
            ssq = tl.load(ssq_ptr + row)
            for s in tl.static_range(1, SPLIT_K):
                ssq += tl.load(ssq_ptr + s * M + row)
            rstd = tl.rsqrt(ssq / K_TOTAL + eps)
        finish_tile(acc, up, rstd, res_ptr + off, out_ptr + off, ok, NORM, GATED, HAS_RESIDUAL)

    return decode_gemm_kernel, split_reduce_kernel


_ZEROED: dict = {}


def _zeroed(role: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A workspace of zeros that the atomic split-K kernel leaves zeroed after every call, so that it is
    allocated (outside any graph capture: the correctness call comes first) and cleared only once."""
    buf = _ZEROED.get((role, dtype, str(device)))
    if buf is None or buf.numel() < numel:
        buf = _ZEROED[(role, dtype, str(device))] = torch.zeros(max(numel, 1 << 16), dtype=dtype, device=device)
    return buf[:numel]


def decode_gemm(x, w, cfg: Cfg, *, x2=None, residual=None, norm=False, gated=False, eps=EPS, warmup=False):
    """`x @ w.T` with the variant's prologue and epilogue, in one launch (two with split_mode "reduce").

    Args:
      x: `[M, K]`, contiguous along K.
      w: `[N, K]` (`[2N, K]` gate rows then up rows when `gated`), x's dtype; with `norm`, the norm weight
        already folded into its columns (`fold_norm`).
      cfg: the tiling; K must be a multiple of `split_k * block_k`.
      x2: `[M, K]`, added to x first (the residual stream); implies `norm`.
      residual: `[M, N]` contiguous, added to the output.
      norm: scale each output row by `rsqrt(mean(x^2) + eps)`.
      gated: output `silu(x @ gate.T) * (x @ up.T)`.
      warmup: compile only (Triton's `warmup`), for the worker processes.

    Returns:
      `y [M, N]` in x's dtype, or `(y, x + x2)` when x2 is given.
    """
    gemm, reduce = _kernels()
    m, k = x.shape
    n = w.shape[0] // 2 if gated else w.shape[0]
    split, add = cfg.split_k, x2 is not None
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1 and k % (split * cfg.block_k) == 0
    assert not add or (x2.shape == x.shape and x2.stride() == x.stride())
    assert residual is None or (residual.shape == (m, n) and residual.is_contiguous())
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    h = torch.empty(m, k, dtype=x.dtype, device=x.device) if add else out
    m_tiles, n_tiles = -(-m // cfg.block_m), -(-n // cfg.block_n)
    groups = 2 if gated else 1
    part, ssq, count, part_split, ssq_split, ssq_tile = out, out, out, 0, 0, 0  # unused unless split
    if cfg.split_mode == "reduce":
        part = torch.empty(split * groups * m * n, dtype=torch.float32, device=x.device)
        ssq = torch.empty(split * m, dtype=torch.float32, device=x.device)
        part_split, ssq_split = groups * m * n, m
    elif cfg.split_mode == "atomic":
        part = _zeroed("part", groups * m * n, torch.float32, x.device)
        ssq = _zeroed("ssq", n_tiles * m, torch.float32, x.device)
        count = _zeroed("count", m_tiles * n_tiles, torch.int32, x.device)
        ssq_tile = m
    res = out if residual is None else residual

    def launch_kernel(kernel, grid, *args, **kwargs):
        if warmup:
            kernel.warmup(*args, grid=grid, **kwargs)
        else:
            kernel[grid](*args, **kwargs)

    launch_kernel(
        gemm, (m_tiles, n_tiles, split),
        x, x2 if add else x, w, res, out, h, part, ssq, count,
        m, n, x.stride(0), w.stride(0), n * w.stride(0), eps, part_split, m * n, ssq_split, ssq_tile,
        K_SPLIT=k // split, SPLIT_K=split, SPLIT_MODE={"none": 0, "reduce": 1, "atomic": 2}[cfg.split_mode],
        ADD=add, NORM=norm or add, GATED=gated, HAS_RESIDUAL=residual is not None, SWAP_AB=cfg.swap_ab,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch.pdl(gemm, x),
    )
    if cfg.split_mode == "reduce":
        launch_kernel(
            reduce, (m, -(-n // 1024)), part, ssq, res, out, m, n, eps, part_split, m * n,
            K_TOTAL=k, SPLIT_K=split, NORM=norm or add, GATED=gated, HAS_RESIDUAL=residual is not None,
            BLOCK=1024, num_warps=4, **launch.pdl(reduce, x),
        )
    return (out, h) if add else out


def interpret_bf16_as_gpu() -> None:
    """Under --dry: make Triton 3.6's interpreter treat bf16 as a GPU does, with the kernel
    tests' patches (tests/engine/kernels/conftest.py): bf16 `tl.dot` operands as numbers, not
    their raw bits, and fp32 -> bf16 casts rounded to nearest, not truncated."""
    from triton.runtime import interpreter

    from tests.engine.kernels.conftest import dot_of_values, rounding_cast

    interpreter.InterpreterBuilder.create_dot = dot_of_values
    interpreter.InterpreterBuilder.cast_impl = rounding_cast(interpreter.InterpreterBuilder.cast_impl)


def fold_norm(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`W * g` column-wise, done once at load time: then `(x / rms) * g @ W.T = (x @ (W * g).T) / rms`."""
    return (w.float() * g.float()[None, :]).to(w.dtype)


# ---------------------------------------------------------------------------------------------- the run


@attrs.define(eq=False)
class Case:
    """One projection at one batch size: its weight copies, inputs and what has been measured on it."""

    proj: str
    k: int
    n: int
    m: int
    variants: tuple
    ws: list  # weight copies that together exceed L2
    folded: torch.Tensor | None  # ws[0] with the norm weight folded in
    inp: dict  # x; a and b (a sublayer output, the residual stream); g (norm weight); res (output residual)
    sweep: list = attrs.Factory(list)
    round2: list = attrs.Factory(list)
    baseline: dict = attrs.Factory(dict)  # variant -> us of cuBLAS + the unfused kernels it replaces
    best: dict = attrs.Factory(dict)  # variant -> (us, cfg)
    ranked: list = attrs.Factory(list)  # plain configs, fastest first
    refs: dict = attrs.Factory(dict)  # variant -> float32 reference output

    @property
    def name(self) -> str:
        return f"{self.proj} m={self.m}"

    def weight_bytes(self) -> int:
        return self.n * self.k * 2


def call(case: Case, variant: str, cfg: Cfg, w: torch.Tensor):
    v, inp = VARIANTS[variant], case.inp
    return decode_gemm(inp["a"] if v.add else inp["x"], w, cfg, x2=inp["b"] if v.add else None,
                       residual=inp["res"] if v.residual else None, norm=v.norm, gated=v.gated)


def unfused(case: Case, variant: str, w: torch.Tensor):
    """What the model runs today: the engine's norm / add+norm kernel, cuBLAS, its silu_and_mul kernel.
    The residual add stands alone here; in the model it rides in the next add+norm kernel (see summary)."""
    v, inp = VARIANTS[variant], case.inp
    if v.add:
        x, _ = norm.add_rms_norm_triton(inp["a"], inp["b"], inp["g"], EPS)
    else:
        x = norm.rms_norm_triton(inp["x"], inp["g"], EPS) if v.norm else inp["x"]
    y = F.linear(x, w)
    if v.gated:
        y = activation.silu_and_mul_triton(y)
    return y + inp["res"] if v.residual else y


def reference(case: Case, variant: str) -> torch.Tensor:
    """float32 reference from the bf16 inputs and the unfolded weight."""
    v, inp = VARIANTS[variant], case.inp
    x = (inp["a"].float() + inp["b"].float()).to(inp["a"].dtype).float() if v.add else inp["x"].float()
    if v.norm:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * inp["g"].float()
    y = x @ case.ws[0].float().T
    if v.gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y + inp["res"].float() if v.residual else y


class Precompiler:
    """Compiles the sweep's kernels in worker processes, into Triton's on-disk cache, ahead of the timing.

    A config takes 0.2-2 s of one CPU core to compile (sm_90, Triton 3.6) and tens of ms of the GPU to
    time, so in one process the sweep would be mostly compiling. Workers only compile (`warmup`), never launch: the
    GPU times undisturbed, and the timing process finds each kernel in the cache at its first launch.
    Without workers (--jobs 0, or a pool that breaks) kernels compile at first launch.
    """

    def __init__(self, jobs: int, dry: bool):
        self.dry, self.futures, self.pool, self.errors = dry, {}, None, 0
        try:  # spawned, not forked: a child must not inherit the parent's CUDA state
            if jobs > 0:
                self.pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
        except Exception as e:
            print(f"no compile workers ({type(e).__name__}: {e}); compiling at first launch")

    def submit(self, case: Case, variant: str, cfg: Cfg, deadline: float) -> None:
        key = (variant, cfg, case.k)  # M and N are runtime arguments, all multiples of 16
        if self.pool is not None and key not in self.futures:
            try:
                self.futures[key] = self.pool.submit(
                    _compile_job, variant, case.m, case.n, case.k, attrs.astuple(cfg), deadline, self.dry)
            except Exception as e:  # a broken pool
                self.broken(e)

    def wait(self, case: Case, variant: str, cfg: Cfg, deadline: float) -> bool:
        """Whether to go on with this kernel: compiled by a worker, or to compile at its first launch
        (no worker took it, or its worker failed: the launch then shows whether the kernel is at fault)."""
        future = self.futures.get((variant, cfg, case.k))
        if future is None or self.pool is None:
            return True
        try:
            error = future.result(timeout=max(0.0, deadline - time.time()))
        except concurrent.futures.TimeoutError:
            return False
        except Exception as e:
            self.broken(e)
            return True
        if error is not None:
            self.errors += 1
            if self.errors <= 3:
                print(f"  compile worker: {variant} {cfg}: {error}; compiling it here")
        return error != SKIPPED

    def ready(self, timeout: float) -> None:
        """Wait for the first kernel out of the workers: their start-up (torch, CUDA) must not eat
        the first case's share of the budget."""
        if self.futures and self.pool is not None:
            concurrent.futures.wait([next(iter(self.futures.values()))], timeout=timeout)

    def broken(self, e: Exception) -> None:
        print(f"compile workers failed ({type(e).__name__}: {e}); compiling at first launch from now on")
        self.close()
        self.pool = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


SKIPPED = "not compiled within the budget"


def _compile_job(variant: str, m: int, n: int, k: int, cfg_fields: tuple, deadline: float, dry: bool) -> str | None:
    """In a worker: compile one kernel (the interpreter has nothing to compile: under --dry it runs it,
    which tests the pool). Returns None, or why it did not compile."""
    if time.time() > deadline:
        return SKIPPED
    v, cfg = VARIANTS[variant], Cfg(*cfg_fields)
    dev = "cpu" if dry else "cuda"
    new = functools.partial(torch.zeros if dry else torch.empty, dtype=torch.bfloat16, device=dev)
    try:
        decode_gemm(new(m, k), new(n, k), cfg, x2=new(m, k) if v.add else None,
                    residual=new(m, n // 2 if v.gated else n) if v.residual else None,
                    norm=v.norm, gated=v.gated, warmup=not dry)
    except Exception as e:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160] if str(e).strip() else ''}"
    return None


class Runner:
    """Times what it is given, after checking it, and keeps every row for the JSON file."""

    def __init__(self, bench: Bench, pre: Precompiler):
        self.b, self.pre = bench, pre
        self.rows: list = []
        self.failures: list = []
        self.slow_first_launches = 0

    def check(self, case: Case, variant: str, label: str, out) -> dict:
        """Cosine and max abs error against the float32 reference; loud when cosine < 0.9999 (or the
        error passes 2% of the largest output, or the written residual stream is not x + x2 exactly)."""
        if variant not in case.refs:
            case.refs[variant] = reference(case, variant)
        ref = case.refs[variant]
        y, h = out if isinstance(out, tuple) else (out, None)
        y = y.float()
        cos = F.cosine_similarity(y.flatten(), ref.flatten(), dim=0).item()
        err = (y - ref).abs().max().item()
        h_err = 0.0
        if h is not None:  # the new residual stream, written by the add prologue: exactly the bf16 sum
            h_err = (h - (case.inp["a"].float() + case.inp["b"].float()).to(h.dtype)).abs().max().item()
        # Cosine misses a wrong scale (e.g. a mean over part of K), the error relative to the largest output does not.
        rel = err / ref.abs().max().item()
        ok = math.isfinite(err) and cos >= 0.9999 and rel < 0.02 and h_err == 0.0
        if not ok:
            print(f"FAIL {case.name} {variant} {label}: cosine {cos:.6f}, max abs {err:.3g} ({rel:.2%} of the largest), "
                  f"residual-stream error {h_err:.3g}")
            self.failures.append(f"{case.name} {variant} {label}")
        row = {"kind": "check", "proj": case.proj, "m": case.m, "variant": variant, "cfg": label,
               "cos": cos, "max_abs": err, "rel_err": rel, "h_err": h_err, "ok": ok}
        self.rows.append(row)
        return row

    def baselines(self, case: Case) -> None:
        """cuBLAS alone and each variant's unfused chain, checked like the candidates."""
        for variant in case.variants:
            if variant == "plain":
                fn = lambda i: F.linear(case.inp["x"], case.ws[i])  # noqa: E731
            else:
                fn = lambda i, v=variant: unfused(case, v, case.ws[i])  # noqa: E731
            checked = self.check(case, variant, "cuBLAS" if variant == "plain" else "unfused", fn(0))
            us = self.b.time_us(fn, len(case.ws))
            case.baseline[variant] = us
            self.rows.append({"kind": "baseline", "proj": case.proj, "m": case.m, "k": case.k, "n": case.n,
                              "variant": variant, "us": us, "gbps": case.weight_bytes() / us / 1e3})
            print(f"  {case.name:10s} {variant:14s} {'cuBLAS' if variant == 'plain' else 'unfused':22s} {us:8.2f} us "
                  f"{100 * case.weight_bytes() / us / 1e3 / PEAK_GBPS:5.1f}% of peak (weights), "
                  f"cos {checked['cos']:.6f}, max abs {checked['max_abs']:.2g}")

    def candidate(self, case: Case, variant: str, cfg: Cfg, deadline: float) -> float | None:
        """Check, time, check again (the atomic split-K must have left its workspace clean); us or None."""
        if not self.pre.wait(case, variant, cfg, deadline):
            return None
        v = VARIANTS[variant]
        w0 = case.folded if v.norm else case.ws[0]
        try:
            t = time.time()
            out = call(case, variant, cfg, w0)
            if time.time() - t > 0.5 and self.pre.pool is not None:
                self.slow_first_launches += 1
            checked = self.check(case, variant, str(cfg), out)
            if not checked["ok"]:
                return None
            us = self.b.time_us(lambda i: call(case, variant, cfg, case.ws[i]), len(case.ws))
            if not self.check(case, variant, str(cfg) + " after timing", call(case, variant, cfg, w0))["ok"]:
                return None
        except Exception as e:  # e.g. out of shared memory: note it and go on
            print(f"  {case.name} {variant} {cfg}: {type(e).__name__} {str(e).strip()[:120]}")
            return None
        gbps = case.weight_bytes() / us / 1e3
        row = {"kind": "candidate", "proj": case.proj, "m": case.m, "k": case.k, "n": case.n, "variant": variant,
               "cfg": str(cfg), "us": us, "gbps": gbps, "pct_peak": 100 * gbps / PEAK_GBPS,
               "x_vs_cublas": case.baseline["plain"] / us, "x_vs_unfused": case.baseline[variant] / us}
        self.rows.append(row)
        if variant not in case.best or us < case.best[variant][0]:
            case.best[variant] = (us, cfg)
        vs = f"x{row['x_vs_cublas']:.3f} vs cuBLAS"
        if variant != "plain":
            vs += f", x{row['x_vs_unfused']:.3f} vs unfused"
        print(f"  {case.name:10s} {variant:14s} {str(cfg):22s} {us:8.2f} us {gbps:6.0f} GB/s {row['pct_peak']:5.1f}%  {vs}"
              f"  (cos {checked['cos']:.6f}, max abs {checked['max_abs']:.2g})")
        return us


def summary(cases: list[Case], rows: list) -> None:
    print(f"\n{'proj':5s} {'M':>3s} | {'cuBLAS':>7s} {'%pk':>4s} | {'Triton':>7s} {'%pk':>4s} {'x':>5s} {'cfg':22s} | "
          "fused variant: unfused -> fused us (x, cfg)")
    for c in cases:
        if "plain" not in c.baseline:
            continue
        pct = lambda us: 100 * c.weight_bytes() / us / 1e3 / PEAK_GBPS  # noqa: E731
        cu = c.baseline["plain"]
        line = f"{c.proj:5s} {c.m:3d} | {cu:7.2f} {pct(cu):4.1f} | "
        if "plain" in c.best:
            us, cfg = c.best["plain"]
            line += f"{us:7.2f} {pct(us):4.1f} {cu / us:5.3f} {str(cfg):22s} |"
        else:
            line += f"{'-':>7s} {'':4s} {'':5s} {'':22s} |"
        for v, (us, cfg) in c.best.items():
            rows.append({"kind": "best", "proj": c.proj, "m": c.m, "variant": v, "cfg": str(cfg), "us": us,
                         "baseline_us": c.baseline[v], "cublas_us": cu, "pct_peak": pct(us)})
        for v in c.variants[1:]:
            if v in c.best:
                us, cfg = c.best[v]
                line += f" {v} {c.baseline[v]:.1f} -> {us:.1f} (x{c.baseline[v] / us:.2f} {cfg})"
        print(line)

    # Per layer. Between w2 and the next wqkv, and between wo and w13, the residual add happens once:
    # today in the add+norm kernel; fused either in the first GEMM's epilogue (then a plain norm
    # prologue in the second) or in the second's prologue (then the first is plain).
    for m in sorted({c.m for c in cases}):
        by = {c.proj: c for c in cases if c.m == m}
        best = lambda proj, v: by[proj].best.get(v, (math.inf, None))[0]  # noqa: E731
        measured = all(v in c.baseline for c in by.values() for v in c.variants)
        if len(by) < 4 or not measured or any(math.isinf(best(p, "plain")) for p in by):
            print(f"m={m}: not every projection measured, no per-layer sum")
            continue
        base = lambda proj, v: by[proj].baseline[v]  # noqa: E731
        today = base("wqkv", "addnorm") + base("wo", "plain") + base("w13", "addnorm+swiglu") + base("w2", "plain")
        # cuBLAS swapped for the best plain Triton GEMM, the norm and gate kernels kept.
        drop_in = today + sum(best(p, "plain") - base(p, "plain") for p in by)
        epilogue = [best("w2", "residual") + best("wqkv", "norm"), best("wo", "residual") + best("w13", "norm+swiglu")]
        prologue = [best("w2", "plain") + best("wqkv", "addnorm"), best("wo", "plain") + best("w13", "addnorm+swiglu")]
        mixed = sum(min(e, p) for e, p in zip(epilogue, prologue))
        layer = {"kind": "layer", "m": m, "today_us": today, "triton_plain_us": drop_in,
                 "residual_epilogues_us": sum(epilogue), "add_prologues_us": sum(prologue), "best_fused_us": mixed}
        rows.append(layer)
        print(f"m={m}, one layer's 4 projections with their norms and gate, us (x{LAYERS} layers, ms/step):")
        for name, key in (("cuBLAS + unfused kernels (today)", "today_us"),
                          ("Triton GEMMs, kernels unfused", "triton_plain_us"),
                          ("fused, residual in epilogues", "residual_epilogues_us"),
                          ("fused, add+norm in prologues", "add_prologues_us"),
                          ("fused, best per boundary", "best_fused_us")):
            us = layer[key]
            if math.isfinite(us):
                print(f"  {name:34s} {us:8.2f}  ({LAYERS * us / 1e3:6.3f} ms)  x{today / us:.3f}")
            else:
                print(f"  {name:34s} not measured")


def make_cases(b: Bench, dry: bool) -> list[Case]:
    cases, per_proj = [], {}
    for m in DRY_MS if dry else MS:
        for proj, k, n, variants in DRY_SHAPES if dry else SHAPES:
            if proj not in per_proj:
                ws, g = b.weights(n, k), (torch.rand(k, device=b.device, generator=b.gen) + 0.5).to(torch.bfloat16)
                per_proj[proj] = (ws, g, fold_norm(ws[0], g) if any(VARIANTS[v].norm for v in variants) else None)
            ws, g, folded = per_proj[proj]
            out_n = n // 2 if proj == "w13" else n
            inp = {"x": b.randn(m, k), "a": b.randn(m, k, scale=0.5), "b": b.randn(m, k), "g": g, "res": b.randn(m, out_n)}
            case = Case(proj, k, n, m, variants, ws, folded, inp)
            case.sweep = plain_sweep(m, dry)
            cases.append(case)
    return cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "decode_gemm_bench.json"))
    p.add_argument("--budget-s", type=float, default=150.0, help="the whole run, compiles included")
    p.add_argument("--jobs", type=int, default=None, help="compile worker processes (default: CPUs - 2; 0 under --dry)")
    p.add_argument("--dry", action="store_true", help="CPU smoke run on tiny shapes (set TRITON_INTERPRET=1)")
    args = p.parse_args()
    if args.dry and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    jobs = args.jobs if args.jobs is not None else 0 if args.dry else min(16, max(1, (os.cpu_count() or 4) - 2))
    if args.dry:
        interpret_bf16_as_gpu()
    b = Bench("cpu" if args.dry else "cuda", args.budget_s)
    end_round1, end_round2 = START + 0.55 * args.budget_s, START + 0.93 * args.budget_s
    cases = make_cases(b, args.dry)
    pre = Precompiler(jobs, args.dry)
    run = Runner(b, pre)
    run.rows.append({"kind": "env", "torch": torch.__version__, "jobs": jobs, "budget_s": args.budget_s,
                     "device": torch.cuda.get_device_name() if b.cuda else "cpu"})
    try:
        for case in cases:  # in the order they will be timed
            for cfg in case.sweep:
                pre.submit(case, "plain", cfg, end_round1)
        for case in cases:  # the GPU works while the workers compile
            run.baselines(case)
        print(f"baselines done at {time.time() - START:.0f}s")
        pre.ready(timeout=0.25 * args.budget_s)
        print(f"compile workers ready at {time.time() - START:.0f}s")

        def slices(end: float, sizes: list[int]) -> list[float]:
            """Each case's deadline: its share of the time left, by its number of candidates, double for
            the batch this is about (MS[0]); time a case leaves unused carries over to the next."""
            sizes = [n * (2 if c.m == MS[0] else 1) for n, c in zip(sizes, cases)]
            t, total = time.time(), max(1, sum(sizes))
            return [t + (end - t) * sum(sizes[: i + 1]) / total for i in range(len(sizes))]

        for case, deadline in zip(cases, slices(end_round1, [len(c.sweep) for c in cases])):
            timed = []
            for cfg in case.sweep:
                if time.time() > deadline:
                    break
                us = run.candidate(case, "plain", cfg, deadline)
                if us is not None:
                    timed.append((us, cfg))
            case.ranked = [cfg for _, cfg in sorted(timed, key=lambda t: t[0])]
            case.round2 = round2_candidates(case, case.ranked, args.dry)
            for variant, cfg in case.round2:
                pre.submit(case, variant, cfg, end_round2)
            print(f"{case.name}: {len(timed)} of {len(case.sweep)} tilings timed by {time.time() - START:.0f}s")
        for case, deadline in zip(cases, slices(end_round2, [len(c.round2) for c in cases])):
            for variant, cfg in case.round2:
                if time.time() > deadline:
                    print(f"{case.name}: out of time, the rest of its fused/split candidates skipped")
                    break
                run.candidate(case, variant, cfg, deadline)
        print(f"candidates done at {time.time() - START:.0f}s")
    finally:
        pre.close()
        summary(cases, run.rows)
        if run.slow_first_launches:
            print(f"note: {run.slow_first_launches} first launches took > 0.5 s: the workers' cache was missed")
        with open(args.out, "w") as f:
            json.dump(run.rows, f, indent=1)
        print(f"wrote {args.out}; {time.time() - START:.0f}s in all")
        if args.dry:
            print("--dry: the times above are the CPU interpreter's and mean nothing; the checks are the test")
    checks = [r for r in run.rows if r["kind"] == "check"]
    if run.failures:
        sys.exit(f"{len(run.failures)} of {len(checks)} checks FAILED: " + "; ".join(run.failures[:10]))
    print(f"all {len(checks)} checks passed (cosine >= 0.9999 against float32)")


if __name__ == "__main__":
    main()
