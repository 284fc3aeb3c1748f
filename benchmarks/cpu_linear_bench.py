"""The decode matmuls of the default model (SmolLM2-135M) on this CPU, in every weight format torch offers.

    python benchmarks/cpu_linear_bench.py [--threads 1 2] [--rows 1 8] [--trials 7]

Each shape is one projection of the model at one decode step of 1 or 8 rows: wqkv
960x576, wo 576x576, w13 3072x576, w2 576x1536 and the tied lm_head 49152x576. Formats:

- fp32, bf16: ``F.linear`` on dense weights;
- mkl_fp32: MKL's packed sgemm (``torch.ops.mkl._mkl_linear``);
- onednn_bf16: oneDNN's prepacked bf16 (``mkldnn._linear_pointwise``, AMX where the CPU has it);
- int8_woq: int8 weights with a scale per row, bf16 activations (``aten._weight_int8pack_mm``);
- int4_woq: 4-bit weights in groups of 32 with a scale and zero each (what a Q4_1 GGUF holds),
  bf16 activations (``aten._weight_int4pack_mm_for_cpu``);
- fbgemm_int8: int8 weights, activations quantized per call (``quantized.linear_dynamic``).

Each call takes the next of 30 copies of the weight (``--layers``), as the model's
layers do, so that weights come from memory rather than a cache the previous call
warmed. Times are microseconds per call, the fastest of ``--trials`` runs of many calls
(the machine is shared: the minimum is the least disturbed). Also the relative error of each
format against fp32 on random data of the model's scale. Prints a table; writes JSON to
benchmarks/results/cpu-linear-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import time
import warnings

import torch
import torch.nn.functional as F

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w13": (3072, 576), "w2": (576, 1536), "lm_head": (49152, 576)}
aten = torch.ops.aten


def time_us(fn, trials: int, budget_s: float = 0.05) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    fn()
    reps = max(3, int(budget_s / max(time.perf_counter() - t, 1e-7)))
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6


def formats(weights: list[torch.Tensor], m: int) -> dict:
    """name -> (x dtype, fn(x)) for ``m`` rows against each of ``weights`` ([N, K] each) in turn:
    as many as the model has layers, so that a weight comes from memory, not a warm cache."""
    per = [_formats(w, m) for w in weights]
    turn = [0]

    def cycle(fmt):
        fns = [p[fmt][1] for p in per]

        def call(x):
            turn[0] = (turn[0] + 1) % len(fns)
            return fns[turn[0]](x)
        return call
    return {fmt: (dtype, cycle(fmt)) for fmt, (dtype, _) in per[0].items()}


def _formats(w: torch.Tensor, m: int) -> dict:
    n, k = w.shape
    out = {"fp32": (torch.float32, lambda x: F.linear(x, w))}
    mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
    out["mkl_fp32"] = (torch.float32, lambda x: torch.ops.mkl._mkl_linear(x, mkl, w, None, m))
    wb = w.bfloat16()
    out["bf16"] = (torch.bfloat16, lambda x: F.linear(x, wb))
    packed = torch.ops.mkldnn._reorder_linear_weight(wb, m)
    out["onednn_bf16"] = (torch.bfloat16, lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    scale = w.abs().amax(1) / 127
    w8 = torch.round(w / scale[:, None]).to(torch.int8)
    s8 = scale.bfloat16()
    out["int8_woq"] = (torch.bfloat16, lambda x: aten._weight_int8pack_mm(x, w8, s8))
    g = w.reshape(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    q = torch.clamp(torch.round((g - lo[..., None]) / d[..., None]), 0, 15).to(torch.int32).reshape(n, k)
    w4 = aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([d.t(), (lo + 8 * d).t()], -1).contiguous().bfloat16()  # [K/32, N, 2]
    out["int4_woq"] = (torch.bfloat16, lambda x: aten._weight_int4pack_mm_for_cpu(x, w4, 32, sz))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch >= 2.13
        qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
        fb = torch.ops.quantized.linear_prepack(qw, None)
    out["fbgemm_int8"] = (torch.float32, lambda x: torch.ops.quantized.linear_dynamic(x, fb, False))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30, help="copies of each layer weight cycled through (1: cache-warm)")
    args = ap.parse_args()
    torch.manual_seed(0)
    load_before = os.getloadavg()
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for m in args.rows:
            for name, (n, k) in SHAPES.items():
                copies = 1 if name == "lm_head" else args.layers
                ws = [torch.randn(n, k) * 0.05 for _ in range(copies)]
                x = torch.randn(m, k)
                ref = F.linear(x, ws[0])
                row = {"threads": threads, "rows": m, "shape": name, "n": n, "k": k, "us": {}, "rel_err": {}}
                for fmt, (dtype, fn) in formats(ws, m).items():
                    xc = x.to(dtype)
                    with torch.inference_mode():
                        row["us"][fmt] = round(time_us(lambda: fn(xc), args.trials), 1)
                        y = _formats(ws[0], m)[fmt][1](xc).float()
                    row["rel_err"][fmt] = float(f"{((y - ref).norm() / ref.norm()).item():.2e}")
                rows.append(row)
                print(f"t={threads} m={m} {name:8s} " + " ".join(f"{f}={v}" for f, v in row["us"].items()), flush=True)
    load_after = os.getloadavg()
    fmts = list(rows[0]["us"])
    print(f"\nus per call, fastest of {args.trials} (load average before {load_before[0]:.2f}, after {load_after[0]:.2f})")
    print(f"{'thr':>3} {'rows':>4} {'shape':>8} " + " ".join(f"{f:>12}" for f in fmts))
    for r in rows:
        print(f"{r['threads']:>3} {r['rows']:>4} {r['shape']:>8} " + " ".join(f"{r['us'][f]:>12}" for f in fmts))
    print("per decode step (30 layers + lm_head), ms:")
    for threads in args.threads:
        for m in args.rows:
            sel = [r for r in rows if r["threads"] == threads and r["rows"] == m]
            step = {f: sum(r["us"][f] * (1 if r["shape"] == "lm_head" else 30) for r in sel) / 1000 for f in fmts}
            print(f"{threads:>3} {m:>4} {'step':>8} " + " ".join(f"{step[f]:>12.2f}" for f in fmts))
    print("relative error against fp32 (rows=1, threads=first): " + " ".join(
        f"{f}={max(r['rel_err'][f] for r in rows if r['rows'] == args.rows[0]):.1e}" for f in fmts))
    now = datetime.datetime.now()
    record = {
        "date": now.isoformat(timespec="seconds"), "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count(),
        "platform": platform.platform(), "loadavg_before": load_before, "loadavg_after": load_after,
        "trials": args.trials, "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"cpu-linear-{now:%Y-%m-%d}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
