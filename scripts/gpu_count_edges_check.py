"""Kernels that wait on a count in memory instead of on the kernel before's completion, on the GPU: no race.

    python scripts/gpu_count_edges_check.py [--replays 100] [--layers 48] [--out FILE]

Three such edges, each off by default until measured:
- ``moe_gemv.ROUTER_IN_GATE_UP``: one token's router taken by gate/up's first programs, the rest waiting on
  their count; the down kernel zeroes it;
- ``moe_gemv.DOWN_COUNT``: the down kernel waiting on gate/up's count of its programs; the projection before
  the layer (wqkv's place, small_linear's ``reset_count``) zeroes it;
- ``paged_attention.REDUCE_COUNT``: the split-KV reduce counts its programs, batch 1's wo
  (small_linear's ``wait_count``) waits on that count; the decode kernel zeroes it.
The MoE pair and the reduce are checked again with the waits sleeping between their reads of the count
(``launch.COUNT_WAIT_SLEEP_NS``). A missing fence, a stale cached line or a reset that comes too early
would show as a wrong or varying output, not in the interpreter (its programs run one after another). Per edge, a CUDA graph of
``--layers`` of its kernels back to back (Qwen3-30B-A3B's shapes, random bf16 weights shared by the
layers, PDL between the launches on Hopper, one count shared as a decode step's layers share it) is
replayed ``--replays`` times. Reported: every replay's output bitwise equal to the first's, the largest
difference from the same chain without the count, relative to its largest value.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from spark.engine.kernels import launch, moe_gemv, paged_attention, small_linear

SLEEP_NS = 500  # launch.COUNT_WAIT_SLEEP_NS of the last two cases


def replayed(step, replays: int) -> tuple[torch.Tensor, int]:
    """(the first replay's output, how many later replays differed from it) of ``step`` captured in a graph."""
    step()  # compiles, and allocates the counts outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    first = out.clone()
    varying = 0
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        varying += not torch.equal(out, first)
    return first, varying


def replayed_with(flags, step, replays: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(``replayed(step)`` with every ``(module, flag)`` of ``flags`` on, and ``step()``'s eager output with
    them off)."""
    without = step()
    for module, flag in flags:
        setattr(module, flag, True)
    try:
        return (*replayed(step, replays), without)
    finally:
        for module, flag in flags:
            setattr(module, flag, False)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return round((a.float() - b.float()).abs().max().item() / b.float().abs().max().item(), 5)


EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768  # Qwen3-30B-A3B's MoE block


def moe_chain(gen) -> tuple:
    """(the MoE block's weights, its input row, a projection in wqkv's place) on ``gen``'s device, random bf16,
    shared by the MoE cases (a few GB of random values: made once)."""
    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device=gen.device)).to(torch.bfloat16)

    # Small weights keep the residual stream from growing over the layers.
    weights = (1 + 0.1 * rand(HIDDEN).float()).to(torch.bfloat16), 1e-6, rand(EXPERTS, HIDDEN, scale=HIDDEN ** -0.5), \
        rand(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN ** -0.5), rand(EXPERTS, HIDDEN, INTER, scale=0.1 * INTER ** -0.5), \
        TOP_K, True
    mix = rand(HIDDEN, HIDDEN, scale=0.1 * HIDDEN ** -0.5)  # in wqkv's place: zeroes the down count after its wait
    return weights, rand(1, HIDDEN), mix


def moe_case(chain: tuple, layers: int, replays: int, flags: tuple[str, ...]) -> dict:
    weights, h0, mix = chain

    def step():
        h = h0
        count = moe_gemv.down_count(h0.device) if moe_gemv.DOWN_COUNT else None
        for _ in range(layers):
            h = small_linear.small_linear_triton(h, mix, residual=h, reset_count=count)
            h = moe_gemv.moe_one_row_triton(h, *weights, down_count=count)
        return h

    first, varying, apart = replayed_with([(moe_gemv, flag) for flag in flags], step, replays)
    # The router's count is zeroed by every down; the down count left at one layer's gate/up programs.
    down_left = (moe_gemv.down_count(h0.device).item() - moe_gemv.gate_up_programs(HIDDEN, INTER, TOP_K)
                 if "DOWN_COUNT" in flags else 0)
    return {"edge": "+".join(flag.lower() for flag in flags), "varying_replays": varying,
            "count_after": int(moe_gemv._router_counter(h0.device).item()) + int(down_left),
            "rel_err_vs_without": relative(first, apart)}


def attention_case(gen, layers: int, replays: int, context: int = 272, num_splits: int = 2) -> dict:
    page, heads, kv_heads, dim, hidden = 16, 32, 4, 128, 2048
    pages = -(-context // page)
    cache = [torch.randn(pages + 1, page, kv_heads, dim, generator=gen, device=gen.device).to(torch.bfloat16)
             for _ in range(2)]
    table = (torch.arange(pages, device=gen.device, dtype=torch.int32) + 1).view(1, pages)
    seq_lens = torch.tensor([context], device=gen.device, dtype=torch.int32)
    slots = torch.tensor([table[0, (context - 1) // page].item() * page + (context - 1) % page], device=gen.device)
    positions = torch.tensor([context - 1], device=gen.device)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device=gen.device).float() / dim))
    wo = (torch.randn(hidden, heads * dim, generator=gen, device=gen.device) * (heads * dim) ** -0.5).to(torch.bfloat16)
    qkvs = [torch.randn(1, (heads + 2 * kv_heads) * dim, generator=gen, device=gen.device).to(torch.bfloat16)
            for _ in range(layers)]
    h0 = torch.randn(1, hidden, generator=gen, device=gen.device).to(torch.bfloat16)

    def step():
        h = h0
        for qkv in qkvs:
            q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
            attended = paged_attention.paged_decode_attention_rope_triton(
                q.view(1, heads, dim), k.view(1, kv_heads, dim), v.view(1, kv_heads, dim), positions, inv_freq,
                *cache, slots, table, seq_lens, dim ** -0.5, num_splits=num_splits).view(1, heads * dim)
            h = small_linear.small_linear_triton(attended, wo, residual=h,
                                                 wait_count=paged_attention.counted_output(attended))
        return h

    first, varying, plain = replayed_with([(paged_attention, "REDUCE_COUNT")], step, replays)
    return {"edge": "reduce_count", "varying_replays": varying, "rel_err_vs_without": relative(first, plain)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_count_edges_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    chain = moe_chain(gen)
    results = [moe_case(chain, args.layers, args.replays, flags)
               for flags in (("ROUTER_IN_GATE_UP",), ("DOWN_COUNT",), ("ROUTER_IN_GATE_UP", "DOWN_COUNT"))]
    results.append(attention_case(gen, args.layers, args.replays))
    launch.COUNT_WAIT_SLEEP_NS = SLEEP_NS  # the waits sleeping between their reads of the count
    try:
        results += [moe_case(chain, args.layers, args.replays, ("ROUTER_IN_GATE_UP", "DOWN_COUNT")),
                    attention_case(gen, args.layers, args.replays)]
    finally:
        launch.COUNT_WAIT_SLEEP_NS = 0
    for r in results[-2:]:
        r["edge"] += f"+sleep{SLEEP_NS}"
    for r in results:
        print(json.dumps(r))
    ok = all(r["varying_replays"] == 0 and r.get("count_after", 0) == 0 and r["rel_err_vs_without"] < 0.02
             for r in results)
    print("count edges check:", "ok" if ok else "FAILED", torch.cuda.get_device_name())
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
