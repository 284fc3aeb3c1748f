"""N-gram speculation on issue 22's CPU workload, streamed through a real server: the prompt holds a
~300-line file of this repository and asks it back with one change (``ngram_acceptance.py``'s
request); tok/s with and without speculation, and the acceptance rate.

    python benchmarks/spec_code_edit.py [--max-tokens 1024] [--repeat 3] [--spec-tokens 4]
        [--spec-ngram 4] [--weight-format int4|dense] [--open-block] [--out FILE]

Each mode runs in its own ``spark serve`` subprocess (the same flags but ``--speculative ngram``), both
up at once: one short warm-up each, then ``--repeat`` rounds in which each streams the same greedy
completion of the same prompt, the two taking turns to go first (the CPU's speed moves by the minute:
a pair of runs meets the same conditions). The prompt goes as token ids through /v1/completions;
``--open-block`` ends it with the answer's opening code fence, as the 135M default model otherwise
describes the file rather than copying it. Per run: TTFT, decode
tok/s (tokens after the first over the time after the first), end-to-end tok/s; for speculation,
/metrics' drafted and accepted tokens and tokens per step of the run. The median run of each mode
and their ratio are printed last, as a table; everything goes to JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ngram_acceptance import code_edit_request  # noqa: E402
from serving import metric_values, stop_server, wait_healthy  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy streamed completion: its text, token count and timings."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, tokens, first, last = [], 0, None, None
    t0 = time.perf_counter()
    with httpx.Client(timeout=None) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", ()):
                if choice.get("text"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    text.append(choice["text"])
    end = time.perf_counter()
    first, last = first or end, last or end
    return {"tokens": tokens, "ttft_s": round(first - t0, 3), "e2e_s": round(end - t0, 3),
            "decode_tok_s": round((tokens - 1) / (last - first), 2) if last > first else None,
            "e2e_tok_s": round(tokens / (end - t0), 2), "text": "".join(text)}


class Mode:
    """A ``spark serve`` with or without speculation, and the runs streamed from it."""

    def __init__(self, args, speculative: bool):
        self.speculative, self.runs = speculative, []
        port = free_port()
        cmd = [sys.executable, "-m", "spark.cli", "serve", "--model", "default", "--port", str(port),
               "--max-model-len", str(args.max_model_len)]
        if args.weight_format:
            cmd += ["--weight-format", args.weight_format]
        if speculative:
            cmd += ["--speculative", "ngram", "--spec-tokens", str(args.spec_tokens), "--spec-ngram", str(args.spec_ngram)]
        self.command = " ".join(cmd[1:])
        env = {**os.environ, "SPARK_STATE_PATH": ":memory:", "SPARK_ACTIVITY_LOG_PATH": "", "SPARK_USAGE_PATH": ""}
        self.server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"

    def start(self, prompt: list[int]) -> None:
        import httpx

        wait_healthy(self.url, self.server)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
        stream(self.url, self.model, prompt[-64:], 8)  # warm-up

    def run(self, prompt: list[int], max_tokens: int) -> None:
        before = metric_values(self.url, "spark_spec_")
        run = stream(self.url, self.model, prompt, max_tokens)
        after = metric_values(self.url, "spark_spec_")
        spec = {k.removesuffix("_total"): after.get(k, 0) - before.get(k, 0) for k in after if k.endswith("_total")}
        if self.speculative:
            drafted, accepted = spec.get("spark_spec_drafted_tokens", 0), spec.get("spark_spec_accepted_tokens", 0)
            steps, emitted = spec.get("spark_spec_steps", 0), spec.get("spark_spec_emitted_tokens", 0)
            run |= {"drafted": int(drafted), "accepted": int(accepted),
                    "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
                    "tokens_per_step": round(emitted / steps, 3) if steps else 0.0}
        self.runs.append(run)
        print(f"{'spec ' if self.speculative else 'plain'}: " + json.dumps({k: v for k, v in run.items() if k != "text"}),
              file=sys.stderr)

    def result(self) -> dict:
        return {"command": self.command, "runs": self.runs}


def run_modes(args, prompt: list[int]) -> tuple[dict, dict]:
    """Both servers up at once, their runs alternating (which goes first too): on a machine whose speed
    moves by the minute, each pair of runs meets the same conditions."""
    plain, spec = Mode(args, speculative=False), Mode(args, speculative=True)
    try:
        plain.start(prompt)
        spec.start(prompt)
        for i in range(args.repeat):
            for mode in ((plain, spec) if i % 2 == 0 else (spec, plain)):
                mode.run(prompt, args.max_tokens)
        return plain.result(), spec.result()
    finally:
        stop_server(plain.server)
        stop_server(spec.server)


def first_difference(a: str, b: str) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def median_run(mode: dict) -> dict:
    runs = sorted(mode["runs"], key=lambda r: r["decode_tok_s"] or 0)
    return runs[len(runs) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default="spark/core/page_allocator.py")
    ap.add_argument("--lines", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--spec-tokens", type=int, default=4)
    ap.add_argument("--spec-ngram", type=int, default=4)
    ap.add_argument("--weight-format", choices=("int4", "int8", "dense"), default=None,
                    help="the server's weights on the CPU (default: its own, int4)")
    ap.add_argument("--open-block", action="store_true", help="end the prompt with the answer's opening code fence")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from spark.engine.tokenizer import Tokenizer
    from spark.engine.weights import resolve_model

    tokenizer = Tokenizer.for_source(resolve_model("default"))
    _, request = code_edit_request(args.file, args.lines)
    prompt = tokenizer.encode_chat([{"role": "user", "content": request}])
    if args.open_block:
        prompt += tokenizer.encode("```python\n")
    plain, spec = run_modes(args, prompt)
    p, s = median_run(plain), median_run(spec)
    date = datetime.date.today().isoformat()
    result = {"bench": "spec_code_edit", "date": date, "device": "cpu", "model": "default",
              "weight_format": args.weight_format or "int4 (server default)", "file": args.file, "lines": args.lines,
              "prompt_tokens": len(prompt), "max_tokens": args.max_tokens, "spec_tokens": args.spec_tokens,
              "spec_ngram": args.spec_ngram, "open_block": args.open_block, "repeat": args.repeat,
              "command": "python benchmarks/spec_code_edit.py " + " ".join(sys.argv[1:]),
              # int4 on the CPU is not batch-invariant (a verify chunk's rows may round otherwise than one
              # decode row): the texts may part; dense weights give the same text (tests/engine/test_speculation.py)
              "same_text": p["text"] == s["text"], "first_difference_at_char": first_difference(p["text"], s["text"]),
              "answer_head": p["text"][:800],
              "decode_speedup": round(s["decode_tok_s"] / p["decode_tok_s"], 3) if p["decode_tok_s"] else None,
              "e2e_speedup": round(s["e2e_tok_s"] / p["e2e_tok_s"], 3),
              "plain": {**plain, "runs": [{k: v for k, v in r.items() if k != "text"} for r in plain["runs"]]},
              "speculative": {**spec, "runs": [{k: v for k, v in r.items() if k != "text"} for r in spec["runs"]]}}
    out = args.out or str(ROOT / "benchmarks" / "results" / f"spec-code-edit-cpu-{date}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'mode':<12}{'tokens':>8}{'ttft s':>9}{'decode tok/s':>14}{'e2e tok/s':>11}{'accept':>8}{'tok/step':>10}")
    for name, r in (("plain", p), ("speculative", s)):
        print(f"{name:<12}{r['tokens']:>8}{r['ttft_s']:>9}{r['decode_tok_s']!s:>14}{r['e2e_tok_s']:>11}"
              f"{r.get('acceptance_rate', '-')!s:>8}{r.get('tokens_per_step', '-')!s:>10}")
    print(f"decode speedup {result['decode_speedup']}x, end-to-end {result['e2e_speedup']}x, same text: "
          f"{result['same_text']}; {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
