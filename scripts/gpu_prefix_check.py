"""Prefix caching on the GPU path (issue 20): a cache hit computes what a miss computes.

    python scripts/gpu_prefix_check.py [--model dummy:llama-3.1-8b] [--out FILE]

Dummy weights of a real shape, the CUDA engine (Triton kernels; decode graphs off, so both sides
run the same kernels): 8 prompts sharing a long prefix (several pages, one diverging mid-page),
then a 3-turn chat whose turns re-send the answers, greedy, cache off vs on. Reports the tokens
that agree and the largest logprob difference; random weights give flat distributions, so a
near-tie may flip under bf16 and the logprob difference is the figure to read.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys

from spark.core.core import Core
from spark.core.events import TokenBatch
from spark.core.policies import Limits, make_policy
from spark.core.scheduler import Scheduler
from spark.engine.engine import Engine
from spark.engine.sampling import SamplingParams


def run(engine: Engine, caching: bool, prompts: dict, turns: int, max_tokens: int, *, batch: int = 16,
        prefill: int = 4096) -> tuple[dict, int]:
    core = Core(engine, Scheduler(engine.new_page_allocator(), make_policy("fifo", Limits(max_prefill_tokens=prefill)),
                                  max_batch_size=batch, prefix_caching=caching))
    out: dict = {}
    history = dict(prompts)
    for turn in range(turns):
        for rid, ids in history.items():
            core.submit((rid, turn), ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                         logprobs=0))
        got: dict = {}
        while core.busy:
            for event in core.step():
                if isinstance(event, TokenBatch):
                    for o in event.outputs:
                        got.setdefault(o.seq_id, []).append((o.token_id, o.logprob))
        out.update(got)
        history = {rid: ids + [t for t, _ in got[(rid, turn)]] + [7, 8, 9] for rid, ids in history.items()}
    return out, core.scheduler.prefix_hit


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="gpu-prefix-check.json")
    args = ap.parse_args()
    rng = random.Random(0)
    engine = Engine.load(args.model, device=args.device, progress=False, max_model_len=4096)
    vocab = engine.vocab_size
    shared = [rng.randrange(1, vocab) for _ in range(args.prefix)]
    prompts = {f"p{i}": shared + [rng.randrange(1, vocab) for _ in range(5 + 9 * i)] for i in range(7)}
    prompts["mid"] = shared[: args.prefix - 7] + [11] * 20  # diverges inside a page
    plain, _ = run(engine, False, prompts, 3, 16)
    cached, hit = run(engine, True, prompts, 3, 16)
    # the control: no cache either side, other batching and chunking (how far bf16 alone moves these logits)
    other, _ = run(engine, False, prompts, 3, 16, batch=3, prefill=512)

    def compare(a: dict, b: dict) -> dict:
        agree = sum(x[0] == y[0] for k in a for x, y in zip(a[k], b[k]))
        differing = sum(1 for k in a if [t for t, _ in a[k]] != [t for t, _ in b[k]])
        worst = max(abs(x[1] - y[1]) for k in a for x, y in zip(a[k], b[k]) if x[0] == y[0])
        first = max(abs(a[k][0][1] - b[k][0][1]) for k in a)  # the first token's: the same prompt, computed two ways
        return {"tokens_agree": agree, "sequences_differing": differing, "max_logprob_diff_same_token": round(worst, 5),
                "max_first_token_logprob_diff": round(first, 5)}

    entry = {"check": "gpu_prefix", "model": args.model, "sequences": len(plain),
             "tokens": sum(len(v) for v in plain.values()), "prefix_hit_tokens": hit,
             "cache_vs_plain": compare(plain, cached), "control_plain_vs_plain_other_batching": compare(plain, other)}
    pathlib.Path(args.out).write_text(json.dumps(entry, indent=1))
    print(json.dumps(entry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
