"""Decode with a bf16 KV cache against an fp8 one (issue 22), beside each case's byte roofline.

    python benchmarks/kv_dtype_decode.py [--model dummy:llama-3.1-8b] [--quick] [--device cuda] [--out FILE]
    python benchmarks/kv_dtype_decode.py --device cpu --model dummy:tiny-llama --quick   # a smoke run

Dummy (random) weights; two engines loaded side by side, one per KV dtype ("auto": the model's
bf16; "fp8": e4m3 with scales), CUDA graphs captured on a GPU. Cases: batch 32 at 4k context and
batch 1 at 32k (random prompts of that length, then ``--new`` greedy tokens, no EOS stop). Each
case times the decode steps only (``offline_decode.decode_once``: CUDA events, launched two steps
deep as the server does), one warm-up run per engine, then ``--reps`` runs alternating between the
two engines; the median is reported, with the spread. The roofline of a step is the bytes it must
read (the weights once, and every sequence's K/V at the run's mean context, in the cache's dtype)
over 4.25 TB/s (../shared/PERF.md). Prints a table last; writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch

from offline_decode import BANDWIDTH, decode_once, git_commit, write_results  # run as a script: benchmarks/ is on sys.path

CASES = [(32, 4096), (1, 32768)]  # (batch, context)
QUICK_CPU_CASES = [(4, 192), (1, 512)]
KV_DTYPES = ("auto", "fp8")


def step_bytes(engine, num_params: int, batch: int, context: float) -> float:
    """Bytes a decode step must read at ``context`` keys per sequence: the weights, then K and V."""
    weight_bytes = num_params * next(engine.model.parameters()).element_size()
    kv_token = engine.config.kv_bytes_per_token(engine.kv_cache.storage.element_size())
    return weight_bytes + batch * context * kv_token


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="one timed run, 16 new tokens (on the CPU: small contexts)")
    ap.add_argument("--new", type=int, default=128, help="decode steps per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--fp8-block-n", type=int, default=None,
                    help="keys per step of the decode kernel over an fp8 cache (A/B of decode_plan.FP8_BLOCK_N)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from spark.engine.engine import Engine
    from spark.engine.kernels import decode_plan

    if args.fp8_block_n:  # before any launch asks decode_config (cached)
        decode_plan.FP8_BLOCK_N = args.fp8_block_n
        decode_plan.decode_config.cache_clear()

    cuda = args.device == "cuda"
    cases = CASES if cuda or not args.quick else QUICK_CPU_CASES
    new, reps = (16, 1) if args.quick else (args.new, args.reps)
    longest = max(context for _, context in cases) + new + 32
    tokens = max(batch * (context + new + 32) for batch, context in cases)
    engines = {}
    for kv in KV_DTYPES:
        t0 = time.perf_counter()
        engine = Engine.load(args.model, device=args.device, progress=False, max_model_len=longest,
                             kv_cache_tokens=tokens, kv_dtype=kv, dtype=torch.bfloat16 if cuda else None)
        if cuda and not args.no_graphs:
            engine.enable_cuda_graphs(max(batch for batch, _ in cases))
            engine.graphs.capture_all()
        engines[kv] = engine
        print(f"{kv}: {engine.kv_cache.storage.dtype} cache of {engine.num_pages} pages, loaded in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    num_params = sum(p.numel() for p in engines["auto"].model.parameters())

    results = []
    for batch, context in cases:
        prompt = context - new // 2  # the mean context over the run is the case's
        rates = {kv: [] for kv in KV_DTYPES}
        for rep in range(reps + 1):  # run 0 warms up
            for kv, engine in engines.items():
                tok_s, _ = decode_once(engine, batch, prompt, new, seed=7919 * batch + rep)
                if rep:
                    rates[kv].append(tok_s)
        row = {"batch": batch, "context": context, "new": new}
        for kv, engine in engines.items():
            roof = batch * BANDWIDTH / step_bytes(engine, num_params, batch, prompt + new / 2)
            median = statistics.median(rates[kv])
            row[kv] = {"tok_s": round(median, 1), "runs": [round(r, 1) for r in rates[kv]],
                       "roofline_tok_s": round(roof, 1), "roofline_frac": round(median / roof, 3)}
        row["fp8_speedup"] = round(row["fp8"]["tok_s"] / row["auto"]["tok_s"], 3)
        row["roofline_speedup"] = round(row["fp8"]["roofline_tok_s"] / row["auto"]["roofline_tok_s"], 3)
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    device = torch.cuda.get_device_name() if cuda else "cpu"
    doc = {"bench": "kv_dtype_decode", "device": device, "date": datetime.date.today().isoformat(),
           "commit": git_commit(), "command": " ".join(["python"] + sys.argv), "model": args.model,
           "fp8_block_n": decode_plan.FP8_BLOCK_N,
           "bandwidth_tb_s": BANDWIDTH / 1e12, "graphs": cuda and not args.no_graphs, "results": results}
    out = write_results(doc, "kv-dtype-decode", args.out)
    print(f"{'batch':>5} {'context':>7} {'kv':>4} {'tok/s':>9} {'roofline':>9} {'frac':>6} {'speedup':>8}")
    for r in results:
        for kv in KV_DTYPES:
            speedup = f"{r['fp8_speedup']:.3f}" if kv == "fp8" else ""
            print(f"{r['batch']:>5} {r['context']:>7} {kv:>4} {r[kv]['tok_s']:>9} {r[kv]['roofline_tok_s']:>9} "
                  f"{r[kv]['roofline_frac']:>6} {speedup:>8}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
