"""The MoE router taken inside gate/up's launch (``moe_gemv.ROUTER_IN_GATE_UP``) on the GPU: no race.

    python scripts/gpu_routed_gate_up_check.py [--replays 100] [--layers 48] [--out FILE]

Gate/up's programs wait on an atomic count of the router's finished programs and then read the logits
those wrote: a missing fence, a stale cached line or a reset that comes too early would show as a wrong
or varying output, not in the interpreter (its programs run one after another). Here a CUDA graph of
``--layers`` one-row MoE sublayers back to back (Qwen3-30B-A3B's shapes, random bf16 weights shared by
the layers, each layer's output the next one's input, PDL between the launches on Hopper, one count
shared as a decode step's layers share it) is replayed ``--replays`` times. Reported: every replay's
output bitwise equal to the first's, the count back at 0, and the largest difference from the same
chain with the router's own launch, relative to its largest value.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from spark.engine.kernels import moe_gemv


def chain(h, layers, *weights):
    for _ in range(layers):
        h = moe_gemv.moe_one_row_triton(h, *weights)
    return h


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_routed_gate_up_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, top_k, hidden, inter = 128, 8, 2048, 768

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(torch.bfloat16)

    # Small weights keep the residual stream from growing over the layers.
    weights = (1 + 0.1 * rand(hidden).float()).to(torch.bfloat16), 1e-6, rand(experts, hidden, scale=hidden ** -0.5), \
        rand(experts, 2 * inter, hidden, scale=hidden ** -0.5), rand(experts, hidden, inter, scale=0.1 * inter ** -0.5), \
        top_k, True
    h = rand(1, hidden)
    moe_gemv.ROUTER_IN_GATE_UP = False
    apart = chain(h, args.layers, *weights)
    moe_gemv.ROUTER_IN_GATE_UP = True
    chain(h, args.layers, *weights)  # compiles, and allocates the count outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(h, args.layers, *weights)
    graph.replay()
    torch.cuda.synchronize()
    first = out.clone()
    varying = 0
    for _ in range(args.replays):
        graph.replay()
        torch.cuda.synchronize()
        varying += not torch.equal(out, first)
    count = int(moe_gemv._router_counter(h.device).item())
    rel = (first.float() - apart.float()).abs().max().item() / apart.float().abs().max().item()
    result = {"device": torch.cuda.get_device_name(), "layers": args.layers, "replays": args.replays,
              "varying_replays": varying, "count_after": count, "rel_err_vs_router_launch": round(rel, 5)}
    ok = varying == 0 and count == 0 and rel < 0.02
    print(json.dumps(result))
    print("routed gate/up check:", "ok" if ok else "FAILED")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**result, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
