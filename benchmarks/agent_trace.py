"""Agents over HTTP: every turn re-sends the whole history. Prefix cache on vs off.

    python benchmarks/agent_trace.py [--model dummy:llama-3.1-8b] [--sessions 32] [--turns 6]
                                     [--system-words 2000] [--user-words 60] [--new 64] [--out FILE]

For each of cache on and off, a fresh ``spark serve`` (a subprocess) and the same trace:
``--sessions`` agent sessions run at once, each ``--turns`` streamed chat turns in a row. Every
session starts with one system prompt (tool definitions and instructions, ~``--system-words``
tokens), shared by all; each turn appends the previous answer and a new user message of its own.
Per turn: TTFT p50/p99 (first content chunk), and from the usage chunk the prompt tokens and the
cached ones. The hit rate is of the reusable tokens from turn 2 on: everything the session's
previous turn sent and got back (but the answer's last token, whose K/V no step computes).
Prints a table; writes the JSON (``--out``).

With a dummy model the words are the synthetic tokenizer's (``t<i>``: one token each); with a real
one, plain English words.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

from serving import metric_values, percentile, stop_server, wait_for_graphs, wait_healthy

ENGLISH = ("harbour tide berth cargo vessel pilot crane manifest customs anchor channel dredging lock gate quay "
           "container schedule weather draught ballast tug mooring bollard pier warehouse forklift invoice").split()
TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    for name, desc in (("read_file", "Read a file of the workspace"), ("search", "Search the workspace"),
                       ("run_shell", "Run a shell command and return its output"))]


def words(rng: random.Random, n: int, synthetic: bool) -> str:
    if synthetic:
        return " ".join(f"t{rng.randrange(1, 30000)}" for _ in range(n))
    return " ".join(rng.choice(ENGLISH) for _ in range(n))


def system_prompt(n: int, synthetic: bool) -> str:
    tools = json.dumps(TOOLS) if not synthetic else " ".join(f"t{i}" for i in range(1, 200))  # the tools, as text
    return f"{tools} {words(random.Random(1), n, synthetic)}"


async def session(http, index: int, args, system: str, synthetic: bool, records: list) -> None:
    rng = random.Random(100 + index)
    messages = [{"role": "system", "content": system}]
    for turn in range(1, args.turns + 1):
        messages.append({"role": "user", "content": words(rng, args.user_words, synthetic)})
        body = {"model": "sparky", "messages": messages, "max_tokens": args.new, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        start, first, text, usage = time.perf_counter(), None, [], None
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"turn {turn} of session {index}: HTTP {r.status_code}: {await r.aread()}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", ()):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        text.append(piece)
        records.append({"session": index, "turn": turn, "ttft_s": (first or time.perf_counter()) - start,
                        "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0})
        messages.append({"role": "assistant", "content": "".join(text)})


async def trace(url: str, args, system: str, synthetic: bool) -> tuple[list, float]:
    import httpx

    records: list = []
    limits = httpx.Limits(max_connections=args.sessions + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(session(http, i, args, system, synthetic, records) for i in range(args.sessions)))
        return records, time.perf_counter() - start


def warm_up(url: str, system: str) -> int:
    """One request as long as a first turn, of other tokens (it leaves nothing in the cache the trace
    could use). Returns its prompt tokens."""
    import httpx

    body = {"model": "sparky", "messages": [{"role": "system", "content": "warm " + system}], "max_tokens": 2}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()["usage"]["prompt_tokens"]


def summarize(records: list, wall_s: float) -> dict:
    by_turn = {}
    for r in records:
        by_turn.setdefault(r["turn"], []).append(r)
    turns = {}
    reusable = cached = 0
    previous = {}  # session -> tokens it sent and got back in its previous turn
    for turn in sorted(by_turn):
        rows = sorted(by_turn[turn], key=lambda r: r["session"])
        ttft = [r["ttft_s"] for r in rows]
        turns[turn] = {"ttft_p50_ms": round(1000 * percentile(ttft, 0.5), 1),
                       "ttft_p99_ms": round(1000 * percentile(ttft, 0.99), 1),
                       "prompt_tokens_mean": round(sum(r["prompt_tokens"] for r in rows) / len(rows)),
                       "cached_tokens_mean": round(sum(r["cached_tokens"] for r in rows) / len(rows))}
        for r in rows:
            if turn > 1:
                reusable += min(previous[r["session"]] - 1, r["prompt_tokens"] - 1)
                cached += r["cached_tokens"]
            previous[r["session"]] = r["prompt_tokens"] + r["completion_tokens"]
    out_tokens = sum(r["completion_tokens"] for r in records)
    return {"wall_s": round(wall_s, 2), "output_tokens": out_tokens, "output_tok_s": round(out_tokens / wall_s, 1),
            "hit_rate_of_reusable": round(cached / max(1, reusable), 3), "turns": turns,
            "prompt_tokens": sum(r["prompt_tokens"] for r in records), "cached_tokens": sum(r["cached_tokens"] for r in records)}


def run(args, caching: bool, system: str, synthetic: bool) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "spark.cli", "serve", "--model", args.model, "--port", str(args.port),
           "--max-batch-size", str(args.sessions), "--max-model-len", str(args.max_model_len), *args.serve_args]
    if not caching:
        cmd.append("--no-prefix-caching")
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(url, server)
        warm = wait_for_graphs(url, args.settle)
        shared = warm_up(url, system)
        print(f"agent_trace: cache {'on' if caching else 'off'}, system prompt ~{shared} tokens", file=sys.stderr)
        records, wall = asyncio.run(trace(url, args, system, synthetic))
        result = summarize(records, wall)
        result["system_tokens"] = shared
        result["server_prefix_metrics"] = metric_values(url, "spark_prefix_cache_")
        result.update(warm)
        return result
    finally:
        stop_server(server)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=2000)
    ap.add_argument("--user-words", type=int, default=60)
    ap.add_argument("--new", type=int, default=64, help="tokens each answer generates (EOS ignored)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--port", type=int, default=8331)
    ap.add_argument("--settle", type=float, default=180.0, help="seconds to wait at most for decode graphs")
    ap.add_argument("--only", choices=("on", "off"), help="run one side only")
    ap.add_argument("--out", default="agent_trace.json")
    ap.add_argument("serve_args", nargs="*", help="more `spark serve` flags (after --)")
    args = ap.parse_args()
    synthetic = args.model.startswith("dummy:")
    system = system_prompt(args.system_words, synthetic)
    sides = {"on": True, "off": False}
    results = {name: run(args, caching, system, synthetic) for name, caching in sides.items()
               if args.only in (None, name)}
    entry = {"bench": "agent_trace", "model": args.model, "sessions": args.sessions, "turns": args.turns,
             "system_words": args.system_words, "user_words": args.user_words, "new_tokens": args.new, **results}
    print(f"{'turn':>4} | {'TTFT p50 on':>11} {'off':>8} {'ratio':>6} | {'p99 on':>8} {'off':>8} | "
          f"{'prompt':>6} {'cached on':>9}")
    if len(results) == 2:
        on, off = results["on"], results["off"]
        later = []
        for turn in on["turns"]:
            a, b = on["turns"][turn], off["turns"][turn]
            ratio = b["ttft_p50_ms"] / max(a["ttft_p50_ms"], 1e-9)
            if turn > 1:
                later.append(ratio)
            print(f"{turn:>4} | {a['ttft_p50_ms']:>11} {b['ttft_p50_ms']:>8} {ratio:>6.2f} | {a['ttft_p99_ms']:>8} "
                  f"{b['ttft_p99_ms']:>8} | {a['prompt_tokens_mean']:>6} {a['cached_tokens_mean']:>9}")
        entry["ttft_p50_ratio_from_turn_2_min"] = round(min(later), 2) if later else None
        entry["throughput_ratio"] = round(on["output_tok_s"] / off["output_tok_s"], 2)
        print(f"output tok/s on {on['output_tok_s']} off {off['output_tok_s']} (x{entry['throughput_ratio']}); "
              f"hit rate of reusable tokens {on['hit_rate_of_reusable']}; TTFT p50 from turn 2 at least "
              f"x{entry['ttft_p50_ratio_from_turn_2_min']} lower")
    print(json.dumps(entry))
    with open(args.out, "w") as f:
        json.dump(entry, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
