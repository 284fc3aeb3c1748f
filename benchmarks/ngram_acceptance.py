"""How often prompt-lookup drafts would be accepted on a code-edit turn (issue 22's CPU workload).

    python benchmarks/ngram_acceptance.py [--file spark/core/page_allocator.py] [--lines 300]
        [--max-tokens 4096] [--out benchmarks/results/ngram-acceptance-cpu-DATE.json]

The default model is asked, in a chat turn, for a ~300-line file of this repository back with one
change (a renamed function), and answers greedily. Greedy verification accepts a draft's tokens
exactly as long as they equal the greedy continuation, so replaying the answer through
``spark.core.ngram.NgramIndex`` gives, for each draft length k and n-gram size, what speculation
would do on this answer: each verify step drafts from prompt + answer so far, accepts the matching
prefix and adds the model's own next token. Reported per (n_max, k): the acceptance rate (accepted
/ drafted tokens), tokens per verify step, and the share of steps that had a draft; for the model's
answer ("rows") and for the answer that does the edit faithfully ("faithful_rows": the drafts'
own quality on this workload, since a 135M model may describe or loop instead of copying).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def replay(prompt: list[int], answer: list[int], *, k: int, n_max: int, n_min: int) -> dict:
    """Speculation with greedy verification, replayed over a known greedy ``answer``."""
    from spark.core.ngram import NgramIndex

    index = NgramIndex(prompt, n_max=n_max, n_min=n_min)
    done = steps = drafted = accepted = with_draft = 0
    while done < len(answer):
        draft = index.draft(k)
        hit = 0
        while hit < len(draft) and done + hit < len(answer) and draft[hit] == answer[done + hit]:
            hit += 1
        emitted = min(hit + 1, len(answer) - done)  # the matching prefix and the model's next token
        index.extend(answer[done:done + emitted])
        done += emitted
        steps += 1
        drafted += len(draft)
        accepted += hit
        with_draft += bool(draft)
    return {"n_max": n_max, "n_min": n_min, "k": k, "steps": steps,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "tokens_per_step": round(len(answer) / steps, 3), "steps_with_draft": round(with_draft / steps, 3)}


RENAMED = "allocate"  # the change the code-edit request asks: this method renamed


def code_edit_request(file: str, lines: int) -> tuple[str, str]:
    """(the file's first ``lines`` lines, the user message asking them back with one change)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    source = "\n".join((root / file).read_text().splitlines()[:lines])
    request = (f"Here is a Python file:\n\n```python\n{source}\n```\n\nRename the method `{RENAMED}` to "
               f"`{RENAMED}_pages` everywhere and give back the whole file, changed, in one code block.")
    return source, request


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default="spark/core/page_allocator.py")
    ap.add_argument("--lines", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--out", default=None)
    ap.add_argument("--open-block", action="store_true",
                    help="start the answer with the code block's opening fence (the default model, 135M, "
                         "describes the file instead of copying it when left to begin on its own)")
    args = ap.parse_args()

    from spark.engine.engine import Engine
    from spark.engine.offline import generate
    from spark.engine.sampling import SamplingParams

    root = pathlib.Path(__file__).resolve().parents[1]
    source, request = code_edit_request(args.file, args.lines)
    name = RENAMED
    engine = Engine.load("default", max_model_len=8192)
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode_chat([{"role": "user", "content": request}])
    if args.open_block:
        prompt += tokenizer.encode("```python\n")
    params = SamplingParams(temperature=0.0, max_tokens=min(args.max_tokens, 8192 - len(prompt) - 1),
                            stop_token_ids=tokenizer.eos_token_ids)
    print(f"prompt {len(prompt)} tokens; generating up to {params.max_tokens} greedily ...", file=sys.stderr)
    t0 = time.perf_counter()
    (outputs,) = generate(engine, [prompt], params)
    seconds = time.perf_counter() - t0
    answer = [o.token_id for o in outputs]
    text = tokenizer.decode(answer, skip_special_tokens=True)
    copied = sum(1 for line in text.splitlines() if line.strip() and line in source.splitlines())
    rows = [replay(prompt, answer, k=k, n_max=n, n_min=2) for n in (2, 3, 4, 5) for k in (1, 2, 3, 4, 5, 6, 8)]
    # The answer a model that does the edit would give: the file in a code block, renamed. Its rows
    # measure the drafts themselves on a faithful edit, whatever the default model answered.
    edited = re.sub(rf"\b{name}\b", f"{name}_pages", source)
    opening = "" if args.open_block else "```python\n"
    faithful = tokenizer.encode(f"{opening}{edited}\n```") + list(tokenizer.eos_token_ids[:1])
    faithful_rows = [replay(prompt, faithful, k=k, n_max=n, n_min=2) for n in (2, 3, 4, 5) for k in (1, 2, 3, 4, 5, 6, 8)]
    result = {"bench": "ngram_acceptance", "date": datetime.date.today().isoformat(), "model": "default",
              "file": args.file, "lines": args.lines, "prompt_tokens": len(prompt), "answer_tokens": len(answer),
              "answer_lines_copied_from_file": copied, "answer_lines": len(text.splitlines()),
              # a small model may loop instead of copying: drafts then look better than on a real edit
              "answer_distinct_lines": len(set(text.splitlines())), "answer_head": text[:1500],
              "answer_opened_block": args.open_block, "greedy_decode_tok_s": round(len(answer) / seconds, 1),
              "command": "python benchmarks/ngram_acceptance.py " + " ".join(sys.argv[1:]), "rows": rows,
              "faithful_answer_tokens": len(faithful), "faithful_rows": faithful_rows}
    best = max(rows, key=lambda r: r["tokens_per_step"])
    faithful_best = max(faithful_rows, key=lambda r: r["tokens_per_step"])
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "faithful_rows", "answer_head")}
                     | {"best": best, "faithful_best": faithful_best}))
    out = args.out or str(root / "benchmarks" / "results" / f"ngram-acceptance-cpu-{result['date']}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
