"""Greedy output is the same with and without n-gram speculation (issue 22's acceptance), on the default
model with dense float32 weights (batch-invariant on the CPU: a verify chunk's rows compute what
one-token decodes compute), for 50 prompts: half ask the model to repeat or copy text (drafts are
accepted), half are open questions.

Run: ``python scripts/accept/speculative_greedy.py [--prompts 50] [--max-tokens 128] [--batch 8]
[--spec-tokens 4]``; prints one JSON summary (prompts that differ, where; drafted and accepted
tokens; tokens per speculating step) and exits 1 when any output differs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

TEXTS = [
    "The harbour opens at six. Ships wait outside until the pilot boards, then follow the channel to the quay.",
    "red, orange, yellow, green, blue, indigo, violet",
    "def area(w, h):\n    return w * h\n\nprint(area(3, 4))",
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday",
    "To be, or not to be, that is the question.",
    "SELECT name, age FROM people WHERE age > 30 ORDER BY age;",
    "one two three four five six seven eight nine ten",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nfor name in os.listdir('.'):\n    print(name)",
    "Keep calm and carry on. Keep calm and carry on.",
]
REPEATS = ["Repeat this text exactly: {t}", "Copy this back, twice: {t}", "Say this again word for word: {t}",
           "Write this out once more: {t}", "Echo the following: {t}"]
QUESTIONS = [
    "What is the capital of France?", "Tell me a short story about a robot.", "Why is the sky blue?",
    "Give three tips for learning to cook.", "What is a prime number?", "Explain what a database index is.",
    "Write a haiku about the sea.", "How do plants make food?", "What does a compiler do?",
    "Name five animals that live in the ocean.", "How far is the Moon?", "What is photosynthesis?",
    "Describe a cat in two sentences.", "What is the boiling point of water?", "Why do we sleep?",
    "What is machine learning?", "Give me a recipe for pancakes.", "Who wrote Hamlet?",
    "What is the largest planet?", "How does a bicycle work?", "What is gravity?",
    "Write a limerick about a dog.", "What are the primary colours?", "How do airplanes fly?",
    "What is the speed of light?",
]


def prompts(n: int) -> list[str]:
    repeats = [REPEATS[i % len(REPEATS)].format(t=TEXTS[i % len(TEXTS)]) for i in range(n - n // 2)]
    return (repeats + QUESTIONS)[:n]


def run(engine, prompts_ids, params, spec, batch: int) -> tuple[list[list[int]], tuple[int, ...], float]:
    from spark.core.core import Core
    from spark.core.policies import Limits, make_policy
    from spark.core.scheduler import Scheduler
    from spark.engine.offline import drive

    scheduler = Scheduler(engine.new_page_allocator(), make_policy("fifo", Limits(max_prefill_tokens=512)),
                          max_batch_size=batch)
    core = Core(engine, scheduler, speculation=spec)
    for i, ids in enumerate(prompts_ids):
        core.submit(i, ids, params)
    t0 = time.perf_counter()
    out = [[o.token_id for o in outs] for outs in drive(core, range(len(prompts_ids)))]
    c = core.speculator.counts if core.speculator is not None else None
    counts = (c.drafted, c.accepted, c.steps, c.tokens) if c is not None else (0, 0, 0, 0)
    return out, counts, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences decoding together (speculation stays on up to it)")
    ap.add_argument("--spec-tokens", type=int, default=4)
    ap.add_argument("--spec-ngram", type=int, default=4)
    args = ap.parse_args()

    import torch

    from spark.core.speculation import SpecConfig
    from spark.engine.engine import Engine
    from spark.engine.sampling import SamplingParams

    engine = Engine.load("default", device="cpu", dtype=torch.float32, kv_cache_bytes=512 << 20, progress=False)
    texts = prompts(args.prompts)
    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    spec = SpecConfig(num_tokens=args.spec_tokens, ngram_max=args.spec_ngram, max_batch=args.batch)
    plain, _, plain_s = run(engine, ids, params, None, args.batch)
    specd, (drafted, accepted, steps, emitted), spec_s = run(engine, ids, params, spec, args.batch)
    differ = []
    for i, (a, b) in enumerate(zip(plain, specd)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            differ.append({"prompt": i, "text": texts[i][:60], "first_difference_at": at})
    summary = {"check": "speculative_greedy", "prompts": len(ids), "max_tokens": args.max_tokens,
               "batch": args.batch, "spec_tokens": args.spec_tokens, "spec_ngram": args.spec_ngram,
               "identical": len(ids) - len(differ), "differ": differ, "drafted": drafted, "accepted": accepted,
               "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
               "tokens_per_spec_step": round(emitted / steps, 3) if steps else 0.0,
               "plain_seconds": round(plain_s, 1), "spec_seconds": round(spec_s, 1)}
    print(json.dumps(summary))
    return 1 if differ or not accepted else 0


if __name__ == "__main__":
    sys.exit(main())
