"""FP8 KV cache fidelity (issue 22): greedy agreement and logits cosine against the model-dtype cache.

    python scripts/fp8_kv_check.py [--model default] [--prompts 50] [--tokens 128] [--steps 16] [--out FILE]

One engine per KV dtype, same weights (dense, bfloat16 by default, so "auto" is a bf16 cache), on
the CPU unless ``--device`` says. 50 chat prompts decode 128 greedy tokens each (no EOS stop), all
in one batch; per prompt the first position where fp8's tokens differ from auto's (null: none).
Logits: every engine is teacher-forced along auto's greedy tokens (the prompt and the first
``steps - 1`` generated tokens, one prefill through the engine's model), and the logits that
predict generated tokens 0..steps-1 are compared by cosine, so a divergence in the sampled
tokens does not decide what is compared. Prints a summary; writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
from offline_decode import git_commit  # noqa: E402  (benchmarks/, beside this script's directory)

from spark.engine.engine import Engine  # noqa: E402
from spark.engine.offline import generate, prefill_logits  # noqa: E402
from spark.engine.sampling import SamplingParams  # noqa: E402

TOPICS = [
    "why the sky is blue", "how a bicycle stays upright", "what a hash table is", "the water cycle",
    "how vaccines work", "the causes of the French Revolution", "what recursion means in programming",
    "how to make bread at home", "why leaves change colour in autumn", "how a compiler works",
    "the difference between weather and climate", "how the stock market works", "what photosynthesis is",
    "how to learn a new language", "the history of the printing press", "what a black hole is",
    "how airplanes fly", "why we sleep", "how a refrigerator keeps food cold", "what inflation is",
    "how the internet routes a packet", "the rules of chess", "how to write a good essay",
    "what DNA does", "how earthquakes happen", "the life cycle of a star", "what a neural network is",
    "how to care for a houseplant", "why the moon has phases", "how electric cars work",
    "what the Pythagorean theorem says", "how coffee is grown", "the causes of tides",
    "how a lock and key work", "what a prime number is", "how bees make honey",
    "why exercise is good for you", "how a camera takes a picture", "what sorting algorithms exist",
    "how rainbows form", "the basics of budgeting", "how volcanoes erupt", "what an operating system does",
    "how to tie a bowline knot", "why the ocean is salty", "how a battery stores energy",
    "what the Roman Empire was", "how to brew tea properly", "what machine translation is",
    "how glaciers move",
]
STYLES = ["Explain {} in a few sentences.", "Write a short paragraph for a child about {}.",
          "Give me three facts about {}.", "Describe {} step by step."]


def prompts_for(engine: Engine, n: int) -> list[list[int]]:
    texts = [STYLES[i % len(STYLES)].format(TOPICS[i % len(TOPICS)]) for i in range(n)]
    return [engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]


def forced_logits(engine: Engine, sequences: list[list[int]], last: int) -> torch.Tensor:
    """Logits [B, last, V] (fp32, CPU) at the last ``last`` positions of each sequence (call with no live sequence)."""
    return prefill_logits(engine, sequences, last).float().cpu()


def run(args, kv_dtype: str, prompts: list[list[int]] | None, reference: list[list[int]] | None):
    """(prompts, greedy tokens per prompt, forced logits [B, steps, V], seconds) of one KV dtype."""
    engine = Engine.load(args.model, device=args.device, dtype=getattr(torch, args.dtype),
                         weight_format=args.weight_format, kv_dtype=kv_dtype, progress=False,
                         kv_calibration=not args.no_calibration,
                         kv_cache_tokens=args.prompts * 512 + args.prompts * args.tokens)
    prompts = prompts or prompts_for(engine, args.prompts)
    t0 = time.perf_counter()
    outs = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True))
    seconds = time.perf_counter() - t0
    tokens = [[o.token_id for o in seq] for seq in outs]
    forced = [p + t[: args.steps - 1] for p, t in zip(prompts, reference or tokens)]
    logits = forced_logits(engine, forced, args.steps)
    engine.close()
    return prompts, tokens, logits, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", help="the model's (and the auto cache's) dtype")
    ap.add_argument("--weight-format", default="dense")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16, help="generated positions whose logits are compared")
    ap.add_argument("--no-calibration", action="store_true", help="fp8 scales 1.0 (as before kv_calibration.py)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)

    prompts, auto_tokens, auto_logits, auto_s = run(args, "auto", None, None)
    _, fp8_tokens, fp8_logits, fp8_s = run(args, "fp8", prompts, auto_tokens)
    cosine = torch.nn.functional.cosine_similarity(fp8_logits.double(), auto_logits.double(), dim=-1)  # [B, steps]
    per_prompt = []
    for i, (a, f) in enumerate(zip(auto_tokens, fp8_tokens)):
        first = next((j for j, (x, y) in enumerate(zip(a, f)) if x != y), None)
        per_prompt.append({"prompt": i, "prompt_tokens": len(prompts[i]), "first_divergence": first,
                           "agree_frac": round(sum(x == y for x, y in zip(a, f)) / len(a), 4),
                           "cosine_min": round(cosine[i].min().item(), 6)})
    firsts = [p["first_divergence"] for p in per_prompt if p["first_divergence"] is not None]
    top1 = (fp8_logits.argmax(-1) == auto_logits.argmax(-1)).float().mean().item()
    summary = {
        "prompts": args.prompts, "tokens": args.tokens, "steps": args.steps,
        "identical_prompts": args.prompts - len(firsts),
        "first_divergence_median": statistics.median(firsts) if firsts else None,
        "first_divergence_min": min(firsts) if firsts else None,
        "cosine_min": round(cosine.min().item(), 6), "cosine_mean": round(cosine.mean().item(), 6),
        "forced_top1_agreement": round(top1, 4),
        "seconds": {"auto": round(auto_s, 1), "fp8": round(fp8_s, 1)},
    }
    doc = {"bench": "fp8_kv_check", "date": datetime.date.today().isoformat(), "commit": git_commit(),
           "command": " ".join(["python"] + sys.argv), "model": args.model, "device": args.device,
           "dtype": args.dtype, "weight_format": args.weight_format, "kv_scales": "calibrated at load (kv_calibration.py)" if not args.no_calibration else "1.0",
           "summary": summary, "per_prompt": per_prompt}
    out = args.out or f"benchmarks/results/fp8-kv-{args.device}-{doc['date']}.json"
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(summary, indent=1))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
