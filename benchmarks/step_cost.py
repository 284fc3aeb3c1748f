"""What a serving step costs by its shape: decode rows alone (CUDA graph) against decode rows plus a
prompt chunk (a mixed step: piecewise graphs, or eager), host time and whole time (issue 24's SLAI budgets).

    python benchmarks/step_cost.py [--model dummy:llama-3.1-8b] [--rows 32,128,256] [--prefill 0,16,128,512,2048]
                                   [--context 512] [--steps 12] [--no-piecewise] [--out FILE]

Per decode batch: ``--rows`` sequences prefilled to ``--context`` tokens, then synchronous steps
(``engine.step``: launch, sample, read back) of those rows decoding, alone or beside a new
sequence's first ``P`` prompt tokens; and the same decode rows with the graphs switched off
(eager). Each mixed step is timed twice: through the piecewise graphs (``piecewise`` true, the
default engine's path on a GPU) and eager (``--no-piecewise``: eager only). Each figure is the median of ``--steps`` steps after two warm-up steps: ``ms`` the whole
step, ``launch_ms`` the host's part until ``launch`` returned (the device still running).
A mixed step whose ``ms`` far exceeds the graph decode plus the prompt's compute is the host's
cost of an eager step, which SLAI pays on every step that carries prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from offline_decode import prefilled, sync


def mixed_steps(engine, alloc, ids, prefill: int, steps: int, gen):
    """Yield ``steps`` plans: ``ids`` decoding one token each, beside the first ``prefill`` prompt tokens
    of a fresh sequence (none when 0), which goes once the caller has collected its step (at the next
    iteration)."""
    from spark.core.plan import Chunk, StepPlan
    from spark.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for step in range(steps):
        chunks = [Chunk(sid, 1, alloc.append(sid, engine.num_tokens(sid))) for sid in ids]
        fresh = ("fresh", prefill, step)
        if prefill:
            prompt = torch.randint(0, engine.config.vocab_size, (prefill + 8,), generator=gen).tolist()
            engine.add_sequence(fresh, prompt, params)
            chunks.append(Chunk(fresh, prefill, alloc.allocate(fresh, prefill)))
        yield StepPlan(tuple(chunks))
        if prefill:
            engine.remove_sequence(fresh)
            alloc.free(fresh)


def timed_steps(engine, alloc, ids, prefill: int, steps: int, gen) -> tuple[float, float]:
    """(median ms of a step, median ms until launch returned) of ``ids`` decoding beside ``prefill``
    prompt tokens of a fresh sequence each step (none when 0)."""
    whole, host = [], []
    for step, plan in enumerate(mixed_steps(engine, alloc, ids, prefill, steps + 2, gen)):
        sync(engine.device)
        t0 = time.perf_counter()
        engine.launch(plan)
        t1 = time.perf_counter()
        engine.collect()
        t2 = time.perf_counter()
        if step >= 2:
            whole.append(1e3 * (t2 - t0))
            host.append(1e3 * (t1 - t0))
    return round(statistics.median(whole), 3), round(statistics.median(host), 3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="32,128,256")
    ap.add_argument("--prefill", default="0,16,128,512,2048")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--no-piecewise", action="store_true", help="time mixed steps eager only")
    ap.add_argument("--out", default="step-cost.json")
    args = ap.parse_args()
    from spark.engine.engine import Engine
    from spark.engine.sampling import SamplingParams

    rows_list = [int(x) for x in args.rows.split(",")]
    prefills = [int(x) for x in args.prefill.split(",")]
    engine = Engine.load(args.model, device=args.device, progress=False,
                         max_model_len=max(args.context + (args.steps + 2) * (len(prefills) + 1) + 16, max(prefills) + 16))
    cuda = engine.device.type == "cuda"
    capture = {}
    if cuda:
        engine.enable_cuda_graphs(max(rows_list), max_step_tokens=max(rows_list) + max(prefills))
        while engine.graphs.capture_next():
            pass
        if args.no_piecewise:
            engine.piecewise = None
        elif engine.piecewise is not None:  # its capture's time and memory, the decode graphs' apart
            torch.cuda.synchronize()
            before, free, t0 = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0], time.perf_counter()
            engine.piecewise.capture_all()
            torch.cuda.synchronize()
            capture = {"piecewise_buckets": engine.piecewise.buckets,
                       "piecewise_capture_s": round(time.perf_counter() - t0, 2),
                       "piecewise_pool_mib": round((torch.cuda.memory_reserved() - before) / 2**20),
                       "piecewise_device_mib": round((free - torch.cuda.mem_get_info()[0]) / 2**20),  # graphs too
                       "piecewise_static_mib": round(sum(b.numel() * b.element_size() for b in (
                           engine.piecewise.input_ids, engine.piecewise.residual, engine.piecewise.qkv,
                           engine.piecewise.attn, engine.piecewise.hidden)) / 2**20)}
            print(json.dumps(capture), file=sys.stderr, flush=True)
    pieces = engine.piecewise
    gen = torch.Generator().manual_seed(0)
    out = []
    for rows in rows_list:
        alloc = engine.new_page_allocator()
        params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
        ids = prefilled(engine, alloc, rows, args.context, params, gen, tag=("rows", rows))
        for prefill in prefills:
            for piecewise in ((False,) if pieces is None or not prefill else (True, False)):
                engine.piecewise = pieces if piecewise else None
                ms, launch_ms = timed_steps(engine, alloc, ids, prefill, args.steps, gen)
                out.append({"rows": rows, "prefill": prefill, "graph": cuda and prefill == 0, "piecewise": piecewise,
                            "ms": ms, "launch_ms": launch_ms})
                print(json.dumps(out[-1]), file=sys.stderr, flush=True)
            engine.piecewise = pieces
        graphs, engine.graphs = engine.graphs, None
        ms, launch_ms = timed_steps(engine, alloc, ids, 0, args.steps, gen)
        engine.graphs = graphs
        out.append({"rows": rows, "prefill": 0, "graph": False, "piecewise": False, "ms": ms, "launch_ms": launch_ms})
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
        for sid in ids:
            engine.remove_sequence(sid)
    doc = {"bench": "step_cost", "model": args.model, "context": args.context,
           "device": torch.cuda.get_device_name() if cuda else "cpu", **capture, "rows": out}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{'rows':>5} {'prefill':>7} {'graph':>5} {'piecewise':>9} {'ms':>8} {'launch_ms':>9}")
    for r in out:
        print(f"{r['rows']:>5} {r['prefill']:>7} {str(r['graph']):>5} {str(r['piecewise']):>9} {r['ms']:>8} "
              f"{r['launch_ms']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
