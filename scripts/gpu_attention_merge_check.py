"""Split-KV decode attention merged in the kernel (``paged_attention.FUSED_REDUCE``) on the GPU: no race.

    python scripts/gpu_attention_merge_check.py [--replays 200] [--out FILE]

The merge hangs on an atomic count of finished partitions and on one program reading the others'
partial results: a missing barrier or fence would show as a wrong or a varying output, not in the
interpreter (its programs run one after another). Here, per case (batch, partitions), a CUDA graph
of ``--layers`` decode launches back to back (PDL between them on Hopper, the counters shared, as a
decode step's layers are) is replayed ``--replays`` times. Reported: every replay's outputs bitwise
equal to the first's, the counters back at 0, and the largest difference from the torch reference
and from the reduce launch's result (``FUSED_REDUCE`` off), relative to the reference's largest value.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from spark.engine.kernels import paged_attention as pa


def case(batch: int, num_splits: int, context: int, layers: int, replays: int) -> dict:
    """One (batch, partitions) case, Qwen3-30B-A3B's heads (32 query, 4 kv, 128 dims), bf16 cache."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 100 + num_splits)
    page, kv_heads, heads, dim = 16, 4, 32, 128
    pages_per_seq = -(-context // page)
    cache_shape = (batch * pages_per_seq + 1, page, kv_heads, dim)
    k_cache = torch.randn(cache_shape, generator=gen, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(cache_shape, generator=gen, device="cuda").to(torch.bfloat16)
    tables = (torch.arange(batch * pages_per_seq, device="cuda", dtype=torch.int32) + 1).view(batch, pages_per_seq)
    seq_lens = torch.tensor([context - 7 * b for b in range(batch)], device="cuda", dtype=torch.int32)
    qs = [torch.randn(batch, heads, dim, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(layers)]
    outs = [torch.empty_like(q) for q in qs]
    scale = dim ** -0.5

    def step():
        for q, out in zip(qs, outs):
            pa.paged_decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, scale, num_splits=num_splits,
                                             out=out)

    step()  # compiles, and allocates the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    first = [o.clone() for o in outs]
    varying = 0
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        varying += sum(not torch.equal(o, f) for o, f in zip(outs, first))
    counters_clear = not pa._split_counters(qs[0].device, batch * kv_heads).any().item()
    reference = [pa.paged_decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens,
                                                     scale) for q in qs]
    pa.FUSED_REDUCE = False
    try:
        unfused = [pa.paged_decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, scale,
                                                    num_splits=num_splits) for q in qs]
    finally:
        pa.FUSED_REDUCE = True
    peak = max(r.abs().max().item() for r in reference)
    return {"batch": batch, "num_splits": num_splits, "context": context, "launches": layers * (replays + 1),
            "varying_outputs": varying, "counters_clear": counters_clear,
            "rel_err_vs_reference": round(max((f.float() - r).abs().max().item() for f, r in zip(first, reference))
                                          / peak, 5),
            "rel_err_vs_reduce_launch": round(max((f.float() - u.float()).abs().max().item()
                                                  for f, u in zip(first, unfused)) / peak, 5)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_attention_merge_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    for batch, num_splits, context in ((1, 4, 256), (1, 7, 1000), (1, 32, 4096), (3, 16, 2048), (8, 2, 300)):
        results.append(case(batch, num_splits, context, args.layers, args.replays))
        print(json.dumps(results[-1]), flush=True)
    ok = all(r["varying_outputs"] == 0 and r["counters_clear"] and r["rel_err_vs_reference"] < 0.02
             for r in results)
    print("merge check:", "ok" if ok else "FAILED")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"results": results, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
