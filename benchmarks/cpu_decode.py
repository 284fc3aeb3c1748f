"""CPU decode speed of the default model (SmolLM2-135M), one command.

    python benchmarks/cpu_decode.py [--batches 1 8] [--threads 1 2] [--busy 0 1] [--weight-format int4]
        [--prompt-tokens 64] [--new-tokens 64] [--repeats 3]

Per weight format, torch thread count, busy-core setting and batch size: greedy, prompts
of 64 tokens, 64 new tokens, after a warm-up; the prefill step and the decode steps are
timed apart and the median of the repeats is kept. Decode tokens/s counts every
sequence's token of a decode step. ``--busy 1`` runs the measurement beside one
process spinning on a core (started here, stopped after), as when a server shares its
machine. Run it on an otherwise idle machine: with more runnable threads than cores,
torch's OpenMP threads wait on each other and small decode steps slow down many times.
Prints a table; writes JSON to benchmarks/results/cpu-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import time

import torch
from busy_core import busy_core

from spark.engine.engine import Engine
from spark.core.plan import Chunk, StepPlan
from spark.engine.sampling import SamplingParams

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TEXT = (
    "A river starts as rain on the hills, gathers in streams, and runs down through woods and fields to the sea. "
    "Along the way it turns mills, feeds farms and carries boats, and towns grow up where it can be crossed. "
)


def make_prompts(engine: Engine, batch: int, length: int) -> list[list[int]]:
    """``batch`` different prompts of exactly ``length`` tokens (slices of one long text)."""
    ids = engine.tokenizer.encode(TEXT * (2 + (length + 5 * batch) // 40))
    return [ids[5 * i : 5 * i + length] for i in range(batch)]


def run_once(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, int]:
    """Prefill all prompts in one step, then decode to ``new_tokens`` each.

    Returns:
      (prefill seconds, decode seconds, decode steps).
    """
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    allocator = engine.new_page_allocator()
    for i, p in enumerate(prompts):
        engine.add_sequence(i, p, params)
    running = list(range(len(prompts)))

    def step(sizes: dict[int, int]) -> None:
        chunks = []
        for sid, n in sizes.items():
            done = engine.num_tokens(sid) - engine.num_uncomputed(sid) + n
            table = allocator.append(sid, done) if allocator.has(sid) else allocator.allocate(sid, done)
            chunks.append(Chunk(sid, n, table))
        for out in engine.step(StepPlan(tuple(chunks))):
            if out.finish_reason is not None:
                running.remove(out.seq_id)
                allocator.free(out.seq_id)

    t0 = time.perf_counter()
    step({sid: len(prompts[sid]) for sid in running})
    t1 = time.perf_counter()
    steps = 0
    while running:
        step({sid: 1 for sid in running})
        steps += 1
    return t1 - t0, time.perf_counter() - t1, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch CPU threads")
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1], choices=[0, 1],
                    help="0: as the machine is; 1: beside a process spinning on one core")
    ap.add_argument("--weight-format", default=None, help="Engine.load's weight_format (default: the CPU's)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    engine = Engine.load("default", device="cpu", weight_format=args.weight_format,
                         kv_cache_tokens=8192, progress=False)
    load_s = time.perf_counter() - t0
    fmt = engine.model.layers[0].feed_forward.w13.__class__.__name__
    rows = []
    for busy in args.busy:
        with busy_core(bool(busy)):
            for threads in args.threads:
                torch.set_num_threads(threads)
                for batch in args.batches:
                    prompts = make_prompts(engine, batch, args.prompt_tokens)
                    run_once(engine, prompts, 8)  # warm-up: first-call allocations, oneDNN primitive caches
                    runs = [run_once(engine, prompts, args.new_tokens) for _ in range(args.repeats)]
                    prefill_s = statistics.median(r[0] for r in runs)
                    decode_s = statistics.median(r[1] for r in runs)
                    steps = runs[0][2]
                    rows.append({
                        "busy_core": bool(busy), "threads": threads, "batch": batch,
                        "decode_tok_s": round(batch * steps / decode_s, 1),
                        "ms_per_decode_step": round(1000 * decode_s / steps, 2),
                        "prefill_tok_s": round(batch * args.prompt_tokens / prefill_s, 1),
                        "decode_s_runs": [round(r[1], 3) for r in runs],
                    })
                    print(rows[-1], flush=True)
    load_after = os.getloadavg()

    print(f"\nSmolLM2-135M on the CPU ({os.cpu_count()} cores), {engine.dtype} activations, linears {fmt}; "
          f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, median of {args.repeats}")
    print(f"{'busy':>4} {'threads':>7} {'batch':>5} {'decode tok/s':>13} {'ms/step':>8} {'prefill tok/s':>14}")
    for r in rows:
        print(f"{int(r['busy_core']):>4} {r['threads']:>7} {r['batch']:>5} {r['decode_tok_s']:>13} "
              f"{r['ms_per_decode_step']:>8} {r['prefill_tok_s']:>14}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")

    now = datetime.datetime.now()
    record = {
        "date": now.isoformat(timespec="seconds"),
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "weight_format": args.weight_format or "default", "linears": fmt, "dtype": str(engine.dtype),
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "machine": {
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "loadavg_before": load_before, "loadavg_after": load_after,
        },
        "load_s": round(load_s, 2),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"cpu-{now:%Y-%m-%d}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
