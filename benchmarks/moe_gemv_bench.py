"""One MoE layer at decode sizes: the GEMV path against the grouped GEMMs, as a fraction of copy bandwidth.

    python benchmarks/moe_gemv_bench.py                  # Qwen3-MoE and Mixtral shapes, 1/2/4/8 tokens
    python benchmarks/moe_gemv_bench.py --sweep          # and a sweep of the GEMV tiles at 1 token

At 1 token it also times the one-row sublayer (``moe_one_row_triton``: the router, then the GEMVs
routing from its logits, the norm and residual add folded in; ``one_row_us``).

One layer's experts of the preset's shapes (random bf16, never zero); each timed call routes
its tokens to a fresh random top-k (distinct experts within a token), and the calls rotate over
24 such routings, so that the weights come from HBM, not from L2. Times are CUDA-graph replays
(gpu_timing.graph_time_us). The bytes a call must read are its distinct experts' w13 and w2
(the activations are noise beside them); ``frac`` is those bytes per second over this GPU's
measured device-to-device copy rate. The sweep varies one kernel's tile at a time, the other at
its default (moe_gemv.gemv_config), and prints the fastest of each.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's spark
from gpu_timing import graph_time_us  # noqa: E402  (a sibling: benchmarks/ is the script's directory)
from offline_decode import copy_bandwidth, git_commit, write_results  # noqa: E402

from spark.engine.kernels import fused_moe, moe_gemv, moe_routing, small_linear  # noqa: E402
from spark.engine.weights.dummy import PRESETS  # noqa: E402

CALLS = 24  # routings per graph: 24 x 8 experts of Qwen3-MoE's 128 read ~1.8 GB, far past L2


def layer(preset: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(w13 [E, 2I, D], w2 [E, D, I], top-k) of the preset's shapes, random bf16 on the GPU."""
    c = PRESETS[preset]
    e, d, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
    w13 = (torch.randn(e, 2 * i, d, generator=gen, device="cuda") * d**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, d, i, generator=gen, device="cuda") * i**-0.5).to(torch.bfloat16)
    return w13, w2, c.num_experts_per_tok


def routings(tokens: int, k: int, experts: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``CALLS`` random (weights fp32 [T, k], ids int32 [T, k]), as ``route_triton`` gives them."""
    out = []
    for _ in range(CALLS):
        logits = torch.randn(tokens, experts, generator=gen, device="cuda")
        weights, ids = moe_routing.route(logits, k, renormalize=True)
        out.append((weights, ids.to(torch.int32)))
    return out


def time_path(fn, x, w13, w2, routes, **kwargs) -> float:
    return graph_time_us([lambda r=r: fn(x, w13, w2, r[0], r[1], **kwargs) for r in routes])


def sweep_configs(hidden: int, inter: int):
    """(kernel, config) pairs: each kernel's tiles varied, the other kernel at its default; at most
    128 weight elements a thread per step (more spills)."""
    default = moe_gemv.gemv_config(hidden, inter)
    np2 = small_linear.triton_next_power_of_2
    for n, kk, w in itertools.product((2, 4, 8, 16), (512, 1024, 2048), (2, 4, 8)):
        if kk <= np2(hidden) and 2 * n * kk <= 128 * 32 * w:
            yield "gate_up", {**default, "gate_up": dict(BLOCK_N=n, BLOCK_K=kk, num_warps=w)}
    for n, kk, w in itertools.product((2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8)):
        if kk <= max(256, np2(inter)) and n * kk <= 128 * 32 * w:
            yield "down", {**default, "down": dict(BLOCK_N=n, BLOCK_K=kk, num_warps=w)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--sweep", action="store_true", help="also sweep the GEMV tiles at 1 token")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    copy = copy_bandwidth()
    doc = {"bench": "moe_gemv", "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "commit": git_commit(), "command": " ".join(["python"] + sys.argv), "copy_tb_s": round(copy / 1e12, 3),
           "results": [], "sweep": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    both_paths = {"gemv": moe_gemv.fused_moe_gemv_triton, "grouped": fused_moe.fused_moe_grouped_triton}
    for preset in args.presets.split(","):
        w13, w2, k = layer(preset, gen)
        experts, inter2, hidden = w13.shape
        expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
            routes = routings(tokens, k, experts, gen)
            distinct = sum(int(ids.unique().numel()) for _, ids in routes) / len(routes)
            nbytes = distinct * expert_bytes
            row = {"preset": preset, "tokens": tokens, "path": fused_moe.moe_path(tokens, k, experts),
                   "distinct_experts": distinct, "bytes": int(nbytes)}
            for name, fn in both_paths.items():
                us = time_path(fn, x, w13, w2, routes)
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_frac"] = round(nbytes / (us * 1e-6) / copy, 3)
            if tokens == 1:
                # The one-row sublayer (decode's batch 1): router, gate/up routing from its logits, down
                # with the residual add; its norm on the way. One fresh token a call (its own experts).
                router = torch.randn(experts, hidden, generator=gen, device="cuda") * 4 * hidden**-0.5
                router = router.to(torch.bfloat16)
                norm_weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
                hs = [torch.randn(1, hidden, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(CALLS)]
                us = graph_time_us([lambda h=h: moe_gemv.moe_one_row_triton(h, norm_weight, 1e-6, router, w13, w2,
                                                                            k, True) for h in hs])
                row["one_row_us"] = round(us, 2)
                row["one_row_frac"] = round((nbytes + router.numel() * 2) / (us * 1e-6) / copy, 3)
            doc["results"].append(row)
            print(row, flush=True)
            if args.sweep and tokens == 1:
                best = {}
                for kernel, cfg in sweep_configs(hidden, inter2 // 2):
                    us = time_path(moe_gemv.fused_moe_gemv_triton, x, w13, w2, routes, config=cfg)
                    entry = {"preset": preset, "kernel": kernel, **cfg[kernel], "us": round(us, 2),
                             "frac": round(nbytes / (us * 1e-6) / copy, 3)}
                    doc["sweep"].append(entry)
                    if kernel not in best or us < best[kernel]["us"]:
                        best[kernel] = entry
                for entry in best.values():
                    print("fastest", entry, flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    path = write_results(doc, "moe-gemv", args.out)
    print(f"\ncopy {doc['copy_tb_s']} TB/s; frac = distinct experts' bytes / time / copy rate")
    print(f"{'preset':>14} {'tokens':>6} {'path':>8} {'experts':>7} {'gemv us':>8} {'frac':>6} {'grouped us':>10} {'frac':>6}")
    for r in doc["results"]:
        print(f"{r['preset']:>14} {r['tokens']:>6} {r['path']:>8} {r['distinct_experts']:>7.1f} {r['gemv_us']:>8} "
              f"{r['gemv_frac']:>6} {r['grouped_us']:>10} {r['grouped_frac']:>6}")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
