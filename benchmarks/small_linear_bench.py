"""The fused small-M linear (spark/engine/kernels/small_linear.py) against cuBLAS, on an H200.

    python benchmarks/small_linear_bench.py [--out DIR] [--budget-s 130] [--grace-s 25]
    TRITON_INTERPRET=1 python benchmarks/small_linear_bench.py --dry   # CPU smoke run, tiny shapes

For the decode projections of Llama-3.1-8B and SmolLM2-135M at M = 1, 2, 4 and 8 rows (bf16):
1. correctness vs the reference, every prologue, with and without residual, bf16 and fp32;
2. a sweep of launch configs, on the plain product and on the fused one;
3. each projection with its fused prologue/epilogue against the unfused kernels it
   replaces (rms_norm + cuBLAS, silu_and_mul + cuBLAS), and the per-layer sums.
Every time is a CUDA-graph replay of >= 24 calls that rotate over weight copies
together larger than L2, so the weight comes from HBM as in a real decode step;
the median of 10 replays, divided by the calls. GB/s counts weight bytes only.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import graph_time_us  # noqa: E402
from spark.engine.kernels import activation, norm  # noqa: E402
from spark.engine.kernels import small_linear as sl  # noqa: E402

PEAK_GBPS = 4250.0
EPS = 1e-5
# (model, projection, K, N, fused ops); the K of a gated projection is its output of silu_and_mul.
SHAPES = [
    ("llama8b", "wqkv", 4096, 6144, "norm"),
    ("llama8b", "wo", 4096, 4096, "residual"),
    ("llama8b", "w13", 4096, 28672, "norm"),
    ("llama8b", "w2", 14336, 4096, "gated+residual"),
    ("llama8b", "lm_head", 4096, 128256, "norm"),
    ("smollm135m", "wqkv", 576, 960, "norm"),
    ("smollm135m", "wo", 576, 576, "residual"),
    ("smollm135m", "w13", 576, 3072, "norm"),
    ("smollm135m", "w2", 1536, 576, "gated+residual"),
    ("smollm135m", "lm_head", 576, 49152, "norm"),
]
LAYERS = {"llama8b": 32, "smollm135m": 30}
C = sl.Config


def sweep_configs(m: int) -> list[sl.Config]:
    """Candidates per row count, chosen from a wider sweep (FMA path at 8 rows: 2-9x slower than the dot path)."""
    if m == 1:
        return [C(8, 512), C(4, 1024), C(4, 2048, defer_reduce=False), C(8, 1024, defer_reduce=False), C(32, 256, 4, 4, True)]
    if m == 2:
        return [C(8, 512), C(4, 1024, defer_reduce=False), C(4, 2048, defer_reduce=False), C(32, 256, 4, 4, True)]
    if m == 4:
        return [C(4, 512), C(4, 1024, defer_reduce=False), C(32, 256, 4, 4, True), C(32, 256, 2, 4, True)]
    return [C(32, 256, 4, 4, True), C(16, 128, 4, 6, True), C(32, 128, 2, 5, True), C(16, 256, 2, 4, True)]


def short(cfg: sl.Config) -> str:
    """`d32x256w4s4`: tensor-core path, block_n x block_k, warps, stages; `r`: FMA path, `s` per-step reduce."""
    if cfg.use_dot:
        return f"d{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}"
    return f"r{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}" + ("" if cfg.defer_reduce else "s")


class Bench:
    def __init__(self, device: str, budget_s: float):
        self.device, self.cuda = device, device == "cuda"
        self.deadline = time.time() + budget_s
        self.gen = torch.Generator(device=device).manual_seed(0)

    def randn(self, *shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, device=self.device, generator=self.gen) * scale).to(dtype)

    def weights(self, n: int, k: int) -> list[torch.Tensor]:
        """Copies of one random weight whose bytes together exceed L2 (60 MB) four times over."""
        copies = 1 if not self.cuda else max(1, min(400, -(-(256 << 20) // (n * k * 2))))
        w = self.randn(n, k, scale=k**-0.5)
        return [w] + [w.clone() for _ in range(copies - 1)]

    def time_us(self, call, copies: int) -> float:
        """Median time of one `call(i)` (i: the weight copy) replayed in a CUDA graph, in us."""
        call(0)  # compiles outside the capture
        if not self.cuda:
            t = time.perf_counter()
            call(0)
            return (time.perf_counter() - t) * 1e6
        calls = copies * max(1, -(-24 // copies))
        return graph_time_us([functools.partial(call, i % copies) for i in range(calls)], reps=10)


def fused_kwargs(b: Bench, ops: str, m: int, n: int, k: int, dtype=torch.bfloat16) -> dict:
    return {
        "norm_weight": (torch.rand(k, device=b.device, generator=b.gen) + 0.5).to(dtype) if "norm" in ops else None,
        "gated": "gated" in ops,
        "residual": b.randn(m, n, dtype=dtype) if "residual" in ops else None,
        "eps": EPS,
    }


def unfused(x, w, kw):
    """What the model runs today in place of the fused kernel: a norm or gate kernel, then cuBLAS.

    No residual add: today it rides in the next add+RMSNorm kernel, which costs about what
    a plain RMSNorm does, so the fused epilogue saves nothing there and is not credited.
    """
    if kw["norm_weight"] is not None:
        x = norm.rms_norm_triton(x, kw["norm_weight"], EPS)
    if kw["gated"]:
        x = activation.silu_and_mul_triton(x)
    return F.linear(x, w)


def max_diff(y, ref) -> tuple[float, int]:
    """Max abs difference, and max ulp distance when bf16."""
    diff = (y.float() - ref.float()).abs().max().item()
    ulps = (y.view(torch.int16).int() - ref.view(torch.int16).int()).abs().max().item() if y.dtype == torch.bfloat16 else -1
    return diff, ulps


def check(b: Bench, rows: list) -> None:
    """Every prologue, with and without residual, through the default configs of both paths;
    fp32 on a subset (the dot path must not round to tf32)."""
    n, k = (1000, 1000) if b.cuda else (40, 72)  # off every block size
    for dtype in (torch.bfloat16, torch.float32):
        for ops in ("plain", "norm", "gated", "residual", "norm+residual", "gated+residual"):
            for m in (1, 3, 8):
                if dtype == torch.float32 and (m == 3 or ops not in ("plain", "norm+residual", "gated+residual")):
                    continue
                kw = fused_kwargs(b, ops, m, n, k, dtype)
                x = b.randn(m, 2 * k if kw["gated"] else k, dtype=dtype)
                w = b.randn(n, k, dtype=dtype, scale=k**-0.5)
                ref = sl.small_linear_reference(x, w, **kw)
                out = torch.full_like(ref, float("nan"))
                cfg = sl.default_config(m, n, k, norm=kw["norm_weight"] is not None, gated=kw["gated"])
                try:
                    out.copy_(sl.small_linear_triton(x, w, **kw))
                except Exception as e:
                    print(f"  check {dtype} {ops} m={m} {short(cfg)}: {type(e).__name__} {str(e)[:120]}")
                d, u = max_diff(out, ref)
                rows.append({"kind": "check", "dtype": str(dtype), "ops": ops, "m": m, "cfg": short(cfg),
                             "max_abs": d, "max_ulps": u, "nan": bool(out.isnan().any())})
    checks = [r for r in rows if r["kind"] == "check"]
    bad = [r for r in checks if r["nan"] or r["max_abs"] > (1e-3 if "float32" in r["dtype"] else 0.1)]
    worst_bf16 = max(r["max_ulps"] for r in checks)
    worst_fp32 = max(r["max_abs"] for r in checks if "float32" in r["dtype"])
    print(f"check: {len(checks)} cases, bad {len(bad)}, worst bf16 ulps {worst_bf16}, worst fp32 abs {worst_fp32:.2e}")
    for r in bad[:10]:
        print("  BAD", r)


def bench_shape(b: Bench, rows: list, model, proj, k, n, ops, m) -> None:
    ws = b.weights(n, k)
    gbps = lambda us: n * k * 2 / us / 1e3  # noqa: E731
    r = {"kind": "shape", "model": model, "proj": proj, "m": m, "k": k, "n": n, "ops": ops, "copies": len(ws)}
    x = b.randn(m, k)
    kw = fused_kwargs(b, ops, m, n, k)
    xf = b.randn(m, 2 * k if kw["gated"] else k)
    ref, ref_fused = sl.small_linear_reference(x, ws[0]), sl.small_linear_reference(xf, ws[0], **kw)
    r["cublas_us"] = b.time_us(lambda i: F.linear(x, ws[i]), len(ws))
    r["cublas_diff"] = max_diff(F.linear(x, ws[0]), ref)[0]
    r["unfused_us"] = b.time_us(lambda i: unfused(xf, ws[i], kw), len(ws))
    r["max_diff"] = 0.0
    for variant, xv, kwv, refv in (("plain", x, {}, ref), ("fused", xf, kw, ref_fused)):
        default = sl.default_config(m, n, k, norm=kwv.get("norm_weight") is not None, gated=kwv.get("gated", False))
        candidates = [default] + [c for c in sweep_configs(m) if c != default]
        r[f"{variant}_default_cfg"], best = short(default), None
        for cfg in candidates:
            if cfg != default and time.time() > b.deadline:
                break
            try:
                r["max_diff"] = max(r["max_diff"], max_diff(sl.small_linear_triton(xv, ws[0], config=cfg, **kwv), refv)[0])
                us = b.time_us(lambda i: sl.small_linear_triton(xv, ws[i], config=cfg, **kwv), len(ws))
            except Exception as e:  # e.g. out of shared memory: note it and go on
                print(f"  {model} {proj} m={m} {variant} {short(cfg)}: {type(e).__name__} {str(e)[:100]}")
                continue
            rows.append({"kind": "sweep", "model": model, "proj": proj, "m": m, "variant": variant, "cfg": short(cfg), "us": us})
            if cfg == default:
                r[f"{variant}_default_us"] = us
            if best is None or us < best[0]:
                best = (us, cfg)
        r[f"{variant}_best_us"], r[f"{variant}_best_cfg"] = best[0], short(best[1])
    r["cublas_gbps"], r["plain_best_gbps"] = gbps(r["cublas_us"]), gbps(r["plain_best_us"])
    sweep = " ".join(f"{q['variant'][0]}:{q['cfg']}={q['us']:.1f}" for q in rows if q["kind"] == "sweep" and q["model"] == model and q["proj"] == proj and q["m"] == m)
    print(f"{model} {proj} m={m}: cublas {r['cublas_us']:.1f} unfused {r['unfused_us']:.1f} | {sweep}")
    rows.append(r)
    del ws
    if b.cuda:
        torch.cuda.empty_cache()


def summary(rows: list) -> None:
    shapes = [r for r in rows if r["kind"] == "shape"]
    print(f"\n{'model':10s} {'proj':7s} m | {'cuBLAS':>6s} {'%pk':>3s} | {'plain':>6s} {'%pk':>3s} {'best':>6s} {'%pk':>3s} | "
          f"{'unfusd':>6s} {'fused':>6s} {'best':>6s} | {'maxdiff':>7s} | default plain, fused / best plain / best fused cfg")
    pct = lambda r, us: 100 * r["n"] * r["k"] * 2 / us / 1e3 / PEAK_GBPS  # noqa: E731
    for r in shapes:
        print(f"{r['model']:10s} {r['proj']:7s} {r['m']} | {r['cublas_us']:6.1f} {pct(r, r['cublas_us']):3.0f} | "
              f"{r['plain_default_us']:6.1f} {pct(r, r['plain_default_us']):3.0f} {r['plain_best_us']:6.1f} {pct(r, r['plain_best_us']):3.0f} | "
              f"{r['unfused_us']:6.1f} {r['fused_default_us']:6.1f} {r['fused_best_us']:6.1f} | {r['max_diff']:7.1e} | "
              f"{r['plain_default_cfg']}, {r['fused_default_cfg']} / {r['plain_best_cfg']} / {r['fused_best_cfg']}")
    for model, layers in LAYERS.items():
        for m in (1, 2, 4, 8):
            per = [r for r in shapes if r["model"] == model and r["m"] == m and r["proj"] != "lm_head"]
            if len(per) == 4:
                unf = sum(r["unfused_us"] for r in per)
                fd, fb = sum(r["fused_default_us"] for r in per), sum(r["fused_best_us"] for r in per)
                print(f"{model} m={m}: a layer's 4 projections with their norms/gate: today {unf:.1f} us, fused {fd:.1f} us "
                      f"(best configs {fb:.1f}); x{layers} layers: {layers * (unf - fd) / 1e3:+.2f} ms/step saved")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--budget-s", type=float, default=130.0, help="only default configs after this long")
    p.add_argument("--grace-s", type=float, default=25.0, help="then skip whole shapes after this much more")
    p.add_argument("--dry", action="store_true", help="CPU smoke run on tiny shapes (set TRITON_INTERPRET=1)")
    args = p.parse_args()
    device = "cpu" if args.dry else "cuda"
    b = Bench(device, args.budget_s)
    shapes = [(mo, pr, 64, 48 if pr != "lm_head" else 80, ops) for mo, pr, _, _, ops in SHAPES[4:6]] if args.dry else SHAPES
    rows: list = [{"kind": "env", "torch": torch.__version__, "device": torch.cuda.get_device_name() if b.cuda else "cpu"}]
    t0 = time.time()
    check(b, rows)
    print(f"check done at {time.time() - t0:.0f}s")
    try:
        for m in (1, 8, 4, 2):
            for model, proj, k, n, ops in shapes:
                if time.time() > b.deadline + args.grace_s:
                    print(f"out of time: {model} {proj} m={m} skipped")
                    continue
                try:
                    bench_shape(b, rows, model, proj, k, n, ops, m)
                except Exception as e:  # one broken shape must not cost the others' numbers
                    print(f"{model} {proj} m={m}: {type(e).__name__} {str(e)[:200]}")
            print(f"m={m} done at {time.time() - t0:.0f}s")
    finally:
        with open(os.path.join(args.out, "small_linear_bench.json"), "w") as f:
            json.dump(rows, f, indent=1)
        summary(rows)


if __name__ == "__main__":
    main()
