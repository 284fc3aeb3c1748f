"""On a GPU: a graphed decode's greedy tokens against the eager engine's, and against another tree's.

    python scripts/gpu_graph_tokens_check.py --out B.json [--against A.json] [PRESET ...]
                                                            (default: qwen3-30b-a3b llama-3.1-8b)

The graphs' tokens come from their ring (the argmax launch writes each row's token there), and each
graphed step starts with the unpacking of the staged inputs and the embedding lookup, all under PDL;
the eager engine samples outside any graph. Dummy (random) weights, random prompts, greedy, batches 1
and 4. At batch 1 graphed and eager tokens are the same kernels' and must agree. At batch 4 they
need not: a graph's split-KV partitions follow its block table's width, an eager step's the batch's
longest context, so the attention sums in another order, and random weights' near ties then flip a
token now and then. ``--against`` (another tree's ``--out``) compares every case's tokens, graphed
and eager, with that tree's: a change that should not move a token must match it exactly.
Prints one line a case; exits 1 when batch 1 disagrees or ``--against`` finds a difference.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from spark.engine.engine import Engine
from spark.engine.offline import generate
from spark.engine.sampling import SamplingParams


def tokens(engine, prompts, new: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    return [[o.token_id for o in outs] for outs in generate(engine, prompts, params)]


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    """'equal', or where the first sequence that differs first differs."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"sequence {i} from token {next(j for j, (p, q) in enumerate(zip(x, y)) if p != q)}"
    return "equal"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="*", default=["qwen3-30b-a3b", "llama-3.1-8b"])
    parser.add_argument("--out", help="a JSON file for every case's eager and graphed tokens")
    parser.add_argument("--against", help="another tree's --out file, whose tokens these must equal")
    args = parser.parse_args()
    other = json.load(open(args.against)) if args.against else None
    failed, cases = 0, {}
    for preset in args.presets:
        engine = Engine.load(f"dummy:{preset}", device="cuda", progress=False, max_model_len=512,
                             kv_cache_bytes=2 << 30)
        gen = torch.Generator().manual_seed(0)
        vocab = engine.config.vocab_size
        for batch in (1, 4):
            prompts = [torch.randint(0, vocab, (48 + 7 * i,), generator=gen).tolist() for i in range(batch)]
            engine.graphs = engine.piecewise = None  # eager
            eager = tokens(engine, prompts, 24)
            engine.enable_cuda_graphs(4)
            engine.graphs.capture_all()
            graphed = tokens(engine, prompts, 24)
            case = cases[f"{preset}:{batch}"] = {"eager": eager, "graphed": graphed}
            line = f"{preset} batch {batch}: graphed against eager {first_difference(eager, graphed)}"
            failed += batch == 1 and graphed != eager
            if other is not None:
                same = other.get(f"{preset}:{batch}") == case
                line += f"; against {args.against}: {'equal' if same else 'DIFFERENT'}"
                failed += not same
            print(line, flush=True)
        del engine
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(cases, f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
