"""Where a decode step's GPU time goes: the kernels of eager decode steps, by total time.

    python benchmarks/profile_decode.py [--model dummy:llama-3.1-8b] [--batch 1 64] [--context 192]
                                        [--kv-dtype auto|fp8] [--top 8] [--graphs]

Dummy bf16 weights; each batch prefills ``--context`` tokens per sequence, then
profiles 5 eager decode steps (no CUDA graph, so every kernel is seen by name), or with
``--graphs`` 5 replays of the decode graphs a server captures (the path it really takes at
batch 1: the one-row blocks; CUPTI still names each kernel of a replay).
For each batch: kernel time per step by kernel family, and the bandwidth the
big matmuls reach (weight bytes / their time) against 4.25 TB/s. With ``--graphs``, also the
chain: each kernel's end-to-end cost in the replay (previous kernel's end to its own; under
PDL a kernel starts early, so its duration overstates what it costs) by name and grid.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import torch

BANDWIDTH = 4.25e12


def family(name: str) -> str:
    n = name.lower()
    for key, label in (("gemv", "matmul"), ("gemm", "matmul"), ("sm90", "matmul"), ("cutlass", "matmul"),
                       ("splitk", "matmul"), ("decode_kernel", "attention"), ("reduce_kernel", "attention"),
                       ("prefill", "attention"), ("rope", "rope+kv"), ("write_kv", "rope+kv"), ("rms", "norm"),
                       ("silu", "silu_mul"), ("argmax", "sampling"), ("copy", "copies"), ("index", "copies")):
        if key in n:
            return label
    return "other"


def profile(model: str, batch: int, context: int, steps: int = 5, kv_dtype: str = "auto", top: int = 8,
            graphs: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from spark.engine.engine import Engine
    from spark.core.plan import Chunk, StepPlan
    from spark.engine.sampling import SamplingParams

    engine = Engine.load(model, device="cuda", progress=False, max_model_len=context + 64, kv_dtype=kv_dtype,
                         kv_cache_bytes=2 * batch * (context + 64) * engine_kv_bytes(model))
    # Bytes a decode step reads: every weight, except the embedding table when it is not the output too.
    weight_bytes = sum(p.numel() * p.element_size() for name, p in engine.model.named_parameters()
                       if engine.config.tie_word_embeddings or not name.startswith("tok_embeddings"))
    alloc = engine.new_page_allocator()
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    ids = [("p", i) for i in range(batch)]
    for sid in ids:
        engine.add_sequence(sid, torch.randint(0, engine.vocab_size, (context,), generator=gen).tolist(), params)
        engine.step(StepPlan((Chunk(sid, context, alloc.allocate(sid, context)),)))

    def decode() -> None:
        engine.step(StepPlan(tuple(Chunk(s, 1, alloc.append(s, engine.num_tokens(s))) for s in ids)))

    if graphs:
        engine.enable_cuda_graphs(batch)
        while engine.capture_next_graph():
            pass
    decode()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decode()
        torch.cuda.synchronize()
    chain = kernel_chain(prof) if graphs else None
    per_family: dict[str, float] = collections.defaultdict(float)
    per_kernel: dict[str, float] = {}
    count = 0
    for evt in prof.key_averages():
        us = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
        if us <= 0:
            continue
        per_family[family(evt.key)] += us / steps
        per_kernel[evt.key[:60]] = us / steps
        count += evt.count
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    total = sum(per_family.values())
    matmul_us = per_family.get("matmul", 0.0)
    return {
        "model": model, "kv_dtype": kv_dtype, "graphs": graphs, "batch": batch, "context": context, "kernels_per_step": round(count / steps, 1),
        "gpu_us_per_step": round(total, 1),
        "us_per_step_by_family": {k: round(v, 1) for k, v in sorted(per_family.items(), key=lambda kv: -kv[1])},
        "matmul_bandwidth_frac": round(weight_bytes / (matmul_us * 1e-6) / BANDWIDTH, 3) if matmul_us else None,
        "floor_us": round(weight_bytes / BANDWIDTH * 1e6, 1),
        "top_kernels_us": {k: round(v, 1) for k, v in top},
        **({"chain": chain} if chain else {}),
    }


def kernel_chain(prof) -> dict:
    """Each kernel's cost inside a replayed chain: the time from the previous kernel's end to its own end
    (a PDL chain overlaps starts, so durations overstate; ends do not), and how long it started before the
    previous one ended; medians by kernel name and grid, in the order of their first appearance."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    by_label: dict[str, list] = {}
    prev_end = None
    for e in kernels:
        end = e["ts"] + e["dur"]
        grid = e.get("args", {}).get("grid")
        label = f"{e['name'][:40]} grid={grid}"
        if prev_end is not None:
            by_label.setdefault(label, []).append((end - prev_end, prev_end - e["ts"]))
        prev_end = end
    med = lambda xs: round(sorted(xs)[len(xs) // 2], 2)  # noqa: E731
    return {label: {"n": len(v), "end_to_end_us": med([a for a, _ in v]), "started_early_us": med([b for _, b in v]),
                    "total_us": round(sum(a for a, _ in v), 1)}
            for label, v in by_label.items()}


def engine_kv_bytes(model: str) -> int:
    from spark.engine.weights import resolve_model

    return resolve_model(model).config.kv_bytes_per_token(2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--kv-dtype", default="auto", help="the KV cache's dtype: auto (the model's) or fp8")
    ap.add_argument("--top", type=int, default=8, help="how many kernels to list by time")
    ap.add_argument("--graphs", action="store_true", help="profile decode graph replays, not eager steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for b in args.batch:
        rows.append(profile(args.model, b, args.context, kv_dtype=args.kv_dtype, top=args.top, graphs=args.graphs))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
