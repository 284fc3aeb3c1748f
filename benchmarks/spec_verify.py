"""What a speculative verify step costs against a plain decode step, and the rate it gives (issue 22).

    python benchmarks/spec_verify.py [--model dummy:llama-3.1-8b] [--batches 1,8,64] [--ks 1-8]
                                     [--prompt 512] [--steps 32] [--verify-rows 64] [--compare-eager]
                                     [--out FILE]

Dummy weights cannot accept drafts, so acceptance is modelled: per batch, the plain decode step
(CUDA graphs, launched two deep as the server does: ``offline_decode.decode_once``) and, per draft
length k, the verify step (``1 + k`` tokens a sequence, every position sampled; synchronous, since
its draft needs the last token on the host), each the median of ``--steps`` steps after a warm-up.
A verify step of up to ``--verify-rows`` tokens in all replays a verify graph (its chunks as
one-token decode rows, ``spark/engine/verify.py``); a larger one, or any without graphs (the CPU),
runs eagerly as varlen chunks. Each entry's ``path`` says which; ``--compare-eager`` also times the
eager varlen step of every entry (``eager_verify_ms``), the path verify steps took before the graphs.
With each draft token accepted with probability a (independently, stopping at the first miss), a
verify step emits E(k) = (1 - a^(k+1)) / (1 - a) tokens a sequence, so speculation runs at
E(k) * t_decode / t_verify(k) of the plain rate. Reported for a = 0.8 (the issue's 4 of 5) and for
the acceptance the CPU code-edit workload measured (``--cpu-acceptance``, 0.77). The n-gram draft's
own host cost (a dictionary walk per sequence, microseconds) is not in these steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from offline_decode import decode_once, prefilled, sync


def expected_tokens(k: int, accept: float) -> float:
    """Tokens a verify step emits per sequence: the accepted prefix of k drafts, plus the model's own one."""
    return float(k + 1) if accept >= 1.0 else (1.0 - accept ** (k + 1)) / (1.0 - accept)


def verify_ms(engine, batch: int, prompt: int, k: int, steps: int, seed: int) -> float:
    """Median ms of a verify step of ``batch`` sequences at ``prompt`` tokens of context, drafts of ``k``."""
    from spark.core.plan import Chunk, StepPlan
    from spark.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=10 * steps * (k + 1) + 8, ignore_eos=True)
    gen = torch.Generator().manual_seed(seed)
    alloc = engine.new_page_allocator()
    ids = prefilled(engine, alloc, batch, prompt, params, gen, tag=("verify", seed))
    vocab = engine.config.vocab_size
    times = []
    try:
        for step in range(steps + 3):  # three warm-up steps
            chunks = []
            for sid in ids:
                known = engine.num_tokens(sid)
                draft = tuple(torch.randint(0, vocab, (k,), generator=gen).tolist())
                chunks.append(Chunk(sid, 1 + k, alloc.append(sid, known + k), draft=draft))
            sync(engine.device)
            t0 = time.perf_counter()
            engine.step(StepPlan(tuple(chunks)))  # collect() reads the tokens back: the step is done
            if step >= 3:
                times.append(time.perf_counter() - t0)
    finally:
        for sid in ids:
            engine.remove_sequence(sid)
    return 1e3 * statistics.median(times)


def verify_path(engine, rows: int) -> str:
    """How a verify step of ``rows`` tokens runs: "graph" (rows of a captured verify graph), "eager rows"
    (decode rows, no graph of that size captured) or "eager varlen" (verify chunks, as without graphs)."""
    if rows > engine.verify_rows:
        return "eager varlen"
    return "graph" if engine.graphs is not None and engine.graphs.bucket_for(rows, verify=True) else "eager rows"


def parse_ks(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(x) for x in text.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--ks", default="1-8")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--cpu-acceptance", type=float, default=0.77)
    ap.add_argument("--verify-rows", type=int, default=64, help="the largest verify graph, in rows (at most "
                    "spark.engine.verify.MAX_ROWS; 0: none)")
    ap.add_argument("--compare-eager", action="store_true", help="also time each verify step eager, as varlen chunks")
    ap.add_argument("--out", default="spec-verify.json")
    args = ap.parse_args()
    from spark.engine.engine import Engine

    batches, ks = [int(b) for b in args.batches.split(",")], parse_ks(args.ks)
    engine = Engine.load(args.model, device=args.device, progress=False, max_model_len=args.prompt + 1024)
    graphs = engine.enable_cuda_graphs(max(batches), verify_rows=args.verify_rows)
    if graphs:
        while engine.capture_next_graph():
            pass
    report: dict = {"bench": "spec_verify", "model": args.model, "device": torch.cuda.get_device_name()
                    if args.device == "cuda" else "cpu", "prompt": args.prompt, "graphs": graphs,
                    "verify_rows": engine.verify_rows, "rows": []}
    for batch in batches:
        decode_once(engine, batch, args.prompt, 16, seed=1)  # warm-up
        decode_ms = statistics.median(decode_once(engine, batch, args.prompt, args.steps, seed=2 + r)[1]
                                      for r in range(3))
        row = {"batch": batch, "decode_ms": round(decode_ms, 3), "verify": []}
        for k in ks:
            ms = verify_ms(engine, batch, args.prompt, k, args.steps, seed=100 * batch + k)
            entry = {"k": k, "path": verify_path(engine, batch * (1 + k)), "verify_ms": round(ms, 3),
                     "cost_ratio": round(ms / decode_ms, 3)}
            if args.compare_eager:
                rows, engine.verify_rows = engine.verify_rows, 0  # verify chunks as varlen chunks, eagerly
                try:
                    entry["eager_verify_ms"] = round(verify_ms(engine, batch, args.prompt, k, args.steps,
                                                               seed=100 * batch + k), 3)
                finally:
                    engine.verify_rows = rows
            for name, accept in (("a0.8", 0.8), (f"a{args.cpu_acceptance}", args.cpu_acceptance)):
                entry[f"speedup_{name}"] = round(expected_tokens(k, accept) * decode_ms / ms, 3)
            row["verify"].append(entry)
            eager = f"  (eager varlen {entry['eager_verify_ms']:7.3f} ms)" if args.compare_eager else ""
            print(f"batch {batch:3d} k {k}: decode {decode_ms:7.3f} ms  verify {ms:7.3f} ms on {entry['path']}"
                  f" ({entry['cost_ratio']:.2f}x)  speedup at a=0.8 {entry['speedup_a0.8']:.2f}x{eager}", flush=True)
        best = max(row["verify"], key=lambda e: e["speedup_a0.8"])
        row["best_k_a0.8"], row["best_speedup_a0.8"] = best["k"], best["speedup_a0.8"]
        report["rows"].append(row)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({r["batch"]: (r["best_k_a0.8"], r["best_speedup_a0.8"]) for r in report["rows"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
