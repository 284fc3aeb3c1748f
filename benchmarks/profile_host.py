"""Where an eager step's host time goes: cProfile of ``engine.launch`` on a GPU (issue 24).

    python benchmarks/profile_host.py [--model dummy:llama-3.1-8b] [--rows 32] [--prefill 0,128] [--steps 8]

An eager step (any step with a prompt chunk in it; decodes without CUDA graphs) launches each
layer's kernels from Python; on the GPU the device runs behind the host, so a step whose
``launch`` takes as long as the whole step is the host's. For each ``--prefill`` (0: decode rows
alone, graphs off), ``--steps`` steps of ``--rows`` decoding sequences (plus a fresh prompt chunk)
are profiled after two warm-up steps; prints the functions by own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from offline_decode import prefilled, sync
from step_cost import mixed_steps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prefill", default="0,128")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=28)
    args = ap.parse_args()
    from spark.engine.engine import Engine
    from spark.engine.sampling import SamplingParams

    engine = Engine.load(args.model, device=args.device, progress=False, max_model_len=args.context + 1024)
    alloc = engine.new_page_allocator()
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    ids = prefilled(engine, alloc, args.rows, args.context, params, gen, tag=("rows",))
    for prefill in (int(x) for x in args.prefill.split(",")):
        profile = cProfile.Profile()
        launch_s = []
        for step, plan in enumerate(mixed_steps(engine, alloc, ids, prefill, args.steps + 2, gen)):
            sync(engine.device)
            if step >= 2:
                profile.enable()
            t0 = time.perf_counter()
            engine.launch(plan)
            launch_s.append(time.perf_counter() - t0)
            if step >= 2:
                profile.disable()
            engine.collect()
        print(f"== rows {args.rows}, prefill {prefill}: launch ms per step "
              f"{[round(1e3 * s, 1) for s in launch_s[2:]]}", flush=True)
        for key in ("tottime", "cumtime"):
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(key).print_stats(args.top)
            print("\n".join(line[:160] for line in text.getvalue().splitlines()[6:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
