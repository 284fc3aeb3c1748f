"""Tensor-parallel decode: one GPU against two, and a model one GPU cannot hold, against its roofline.

    python benchmarks/tp_decode.py              # 2 GPUs: dummy llama-3.1-8b at world size 1 and 2, dummy 70B at 2
    python benchmarks/tp_decode.py --device cpu --preset tiny-llama --big-preset tiny-llama --quick  # a check

Dummy (random, never zero) bf16 weights of real shapes; 128-token random prompts, 128 new
tokens, greedy, no EOS stop; decode steps only are timed (CUDA events on rank 0; prefill
excluded), CUDA graphs on, after a warm-up run, median of 3. Each case runs in a fresh
process (its GPU memory freed after it), which is rank 0: it spawns the other ranks and
leads them as ``spark serve --world-size N`` does (``spark.engine.ranks``).

The speedup of world size 2 over 1 is reported per batch (issue 26 asks 1.6x at batch 1,
1.7x at batch 64). The roofline of a step at world size N: the bytes each rank must read
(its 1/N of the weights, the embedding rows aside, and of the KV cache read and written)
over this machine's measured copy rate, or its 1/N of the FLOPs over 783 TFLOP/s if
larger; the all-reduces cost nothing in it. Progress on stderr; JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch
from offline_decode import copy_bandwidth, decode_once, git_commit, write_results  # a sibling: benchmarks/ is the script's directory

BANDWIDTH = 4.25e12  # bytes/s, device-to-device copy on one H200 (PERF.md); a GPU run measures its own
MATMUL = 783e12  # bf16 FLOP/s on one H200 (PERF.md)


def log(msg: str) -> None:
    print(f"[tp_decode {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def roofline(config, world_size: int, batch: int, context: float, dtype_bytes: int, bandwidth: float) -> dict:
    """The best tokens/s of a decode step of ``batch`` rows at ``context`` tokens, split over ``world_size`` ranks."""
    c = config
    per_layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    weights = c.num_layers * per_layer + c.vocab_size * c.hidden_size  # the head (tied or not); embedding rows aside
    kv = c.kv_bytes_per_token(dtype_bytes) * batch * (context + 1)
    step_bytes = (weights * dtype_bytes + kv) / world_size
    step_flops = (2 * weights * batch + 4 * batch * context * c.q_size * c.num_layers) / world_size
    step_s = max(step_bytes / bandwidth, step_flops / MATMUL)
    return {"roofline_tok_s": batch / step_s, "bound": "bytes" if step_bytes / bandwidth >= step_flops / MATMUL else
            "flops", "rank_gb_per_step": step_bytes / 1e9}


def run_case(preset: str, world_size: int, args, results) -> None:
    """Rank 0 of one case (a process of its own): start the other ranks, load, decode each batch, report."""
    from spark.engine import ranks
    from spark.engine.engine import Engine

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.prompt + args.new + 16
    load = dict(device=args.device, dtype=dtype, progress=False, max_model_len=max_len,
                kv_cache_tokens=max(batches) * (max_len + 16))
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or world_size) // world_size))
    elif args.measure_copy:  # here, not in the parent: a CUDA context there would hold memory the 70B needs
        results.put({"info": True, "device": torch.cuda.get_device_name(), "bandwidth": copy_bandwidth()})
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    followers = None
    if world_size > 1:
        followers = ranks.start_followers(world_size, args.device, cpu_threads=torch.get_num_threads())
        os.environ.update(followers.env)
        engine = ranks.lead(f"dummy:{preset}", world_size=world_size, **load)
    else:
        engine = Engine.load(f"dummy:{preset}", **load)
    log(f"{preset} at world size {world_size}: loaded in {time.perf_counter() - t0:.1f}s")
    try:
        if device.type == "cuda" and not args.no_graphs:
            t1 = time.perf_counter()
            engine.enable_cuda_graphs(max(batches))
            while engine.capture_next_graph():
                pass
            log(f"CUDA graphs up to batch {max(batches)} in {time.perf_counter() - t1:.1f}s")
        for batch in batches:
            runs = [decode_once(engine, batch, args.prompt, args.new, seed=rep) for rep in range(args.reps + 1)][1:]
            tok_s = statistics.median(r[0] for r in runs)
            step_ms = statistics.median(r[1] for r in runs)
            log(f"{preset} world size {world_size} batch {batch}: {tok_s:.1f} tok/s, step {step_ms:.2f} ms "
                f"(runs {[round(r[0], 1) for r in runs]})")
            results.put({"preset": preset, "world_size": world_size, "batch": batch, "tok_s": round(tok_s, 1),
                         "step_ms": round(step_ms, 3), "tok_s_runs": [round(r[0], 1) for r in runs]})
    finally:
        engine.close()  # a leader closes its followers
        if followers is not None:
            followers.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.1-8b", help="run at world size 1 and 2")
    ap.add_argument("--big-preset", default="llama-3.1-70b", help="run at world size 2 only ('none': skip)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one rep, 16 new tokens")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.reps, args.new = 1, 16
    from spark.engine.weights.dummy import PRESETS

    cuda = args.device.startswith("cuda")
    if cuda and torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"{args.world_size} GPUs needed, {torch.cuda.device_count()} visible")
    doc = {"bench": "tp_decode", "device": "cpu", "gpus": torch.cuda.device_count() if cuda else 0,
           "date": datetime.date.today().isoformat(), "commit": git_commit(),
           "command": " ".join(["python"] + sys.argv), "prompt": args.prompt, "new": args.new,
           "matmul_assumed": MATMUL, "bandwidth": BANDWIDTH, "results": []}
    args.measure_copy = cuda  # by the first case's process
    cases = [(args.preset, 1), (args.preset, args.world_size)]
    if args.big_preset != "none":
        cases.append((args.big_preset, args.world_size))
    ctx = mp.get_context("spawn")
    for preset, world_size in cases:
        results = ctx.Queue()
        case = ctx.Process(target=run_case, args=(preset, world_size, args, results))  # not a daemon: it spawns ranks
        case.start()
        rows = []
        while case.is_alive() or not results.empty():
            try:
                row = results.get(timeout=1.0)
            except Exception:  # queue.Empty
                continue
            if row.pop("info", False):
                doc.update(row)
                args.measure_copy = False
                log(f"{doc['device']}: device-to-device copy {doc['bandwidth'] / 1e12:.3f} TB/s (the roofline's)")
            else:
                rows.append(row)
        bandwidth = doc["bandwidth"]
        if case.exitcode != 0:
            log(f"{preset} at world size {world_size} failed (exit {case.exitcode})")
            doc["results"].append({"preset": preset, "world_size": world_size, "error": f"exit {case.exitcode}"})
        dtype_bytes = 2 if cuda else 4
        for row in rows:
            roof = roofline(PRESETS[preset], world_size, row["batch"], args.prompt + args.new / 2, dtype_bytes,
                            bandwidth)
            row.update({k: round(v, 3) if isinstance(v, float) else v for k, v in roof.items()})
            row["roofline_frac"] = round(row["tok_s"] / roof["roofline_tok_s"], 3)
            doc["results"].append(row)
        _write(args, doc)
    single = {r["batch"]: r["tok_s"] for r in doc["results"] if r.get("preset") == args.preset
              and r["world_size"] == 1 and "tok_s" in r}
    doc["speedup"] = {str(r["batch"]): round(r["tok_s"] / single[r["batch"]], 3) for r in doc["results"]
                      if r.get("preset") == args.preset and r["world_size"] == args.world_size and "tok_s" in r
                      and r["batch"] in single}
    path = _write(args, doc)
    print(f"\n{doc['device']}: {args.prompt}-token prompts, {args.new} new tokens; roofline at "
          f"{bandwidth / 1e12:.2f} TB/s per GPU")
    print(f"{'preset':>14} {'ranks':>5} {'batch':>5} {'tok/s':>9} {'step ms':>8} {'roof tok/s':>10} {'frac':>6}")
    for r in doc["results"]:
        if "tok_s" in r:
            print(f"{r['preset']:>14} {r['world_size']:>5} {r['batch']:>5} {r['tok_s']:>9} {r['step_ms']:>8} "
                  f"{r['roofline_tok_s']:>10.1f} {r['roofline_frac']:>6}")
    print(f"speedup of {args.world_size} ranks over 1 ({args.preset}), by batch: {doc['speedup']}")
    print(f"results: {path}")
    return 0


def _write(args, doc: dict) -> str:
    return write_results(doc, f"tp-decode-{args.preset}", args.out)


if __name__ == "__main__":
    sys.exit(main())
