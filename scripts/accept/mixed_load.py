"""Mixed load: minutes of streaming traffic over every API leave latency and memory where they started.

What it proves: ``--clients`` closed-loop clients (each sends its next request when the last one
ended) stream a mix of chat completions, completions, Responses (half of them stored) and
Anthropic messages, with short and medium prompts and ``max_tokens`` of 16-64 (``WORK``: one cycle of them,
sampled greedily, so that every minute carries the same work), for a
warm-up minute and then ``--minutes`` more. Every request's latency (sent to last byte) and TTFT
(sent to first content) are recorded, and the server's resident memory every ``--rss-interval``
seconds. The warm-up minute is left out; the first and the last measured minutes are compared.

Pass criteria:
  * no request failed (an HTTP status other than 200, a stream without its end, a connection error),
    warm-up included (a stream that ends before any content, the model's first token ending the
    turn, is no failure: the summary counts them);
  * the median RSS of the last minute is less than ``--max-rss-drift`` (5%) above the first minute's;
  * the p50 latency of the last minute is less than ``--max-p50-drift`` (10%) above the first minute's.

Drifts are signed (last / first - 1): a minute that got faster or smaller fails nothing. The summary
also has each window's p50 TTFT and p50 time per content chunk after the first, which do not depend
on how long the answers were. ``server_minutes`` says per minute what the server did (from /metrics:
prefix-cache hit rate, prefill tokens and steps per request, ms per step) and how fast the host was
(``probe_ms``, a fixed piece of Python work timed in a process of its own); ``probe_drift`` is the host's
own slowdown between the two windows, since this VM's speed moves by up to 40% within minutes.

Run: ``python scripts/accept/mixed_load.py [--minutes 10] [--clients 4]`` on a quiet machine; prints one
JSON summary and exits 1 when a check fails. Each client goes round the cycle from a place drawn by one seeded generator per
client, so that every minute sees the same mix.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import threading
import time

import httpx

from harness import SparkServer, median, percentile, round3, verdict

MODEL = "sparky"
SHORT = ("Name three colours.", "What is the capital of France?", "Say something kind.", "Give me a haiku about rain.")
MEDIUM = " ".join(["The harbour town woke slowly: fishermen mended nets, gulls argued over scraps, and the baker's"
                   " ovens filled the narrow streets with the smell of bread."] * 8)
KINDS = ("chat", "completions", "responses", "messages")
# The work of one cycle: every kind with every prompt, each prompt with its max_tokens (16-64), sampled
# greedily, so that a request's answer (and so its work) is the same each time it comes round. A client
# goes round about once a minute: the first and the last minute carry the same work, and a latency
# drift between them is the server's. (Drawn at random, the answers' lengths alone moved the p50 of
# a minute's ~80 requests by 20%, while the TTFT and the time per chunk stayed within 3%.)
WORK = [(kind, prompt, max_tokens) for kind in KINDS for prompt, max_tokens in (
    (SHORT[0], 16), (SHORT[1], 32), (SHORT[2], 48), (SHORT[3], 24),
    (MEDIUM + " Summarise this in one sentence.", 64))]


def request_of(kind: str, prompt: str, max_tokens: int, store: bool) -> tuple[str, dict, dict]:
    """Path, JSON body and extra headers of one streamed request."""
    if kind == "chat":
        return "/v1/chat/completions", {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                                        "messages": [{"role": "user", "content": prompt}]}, {}
    if kind == "completions":
        return "/v1/completions", {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                                   "prompt": prompt}, {}
    if kind == "responses":
        return "/v1/responses", {"model": MODEL, "stream": True, "max_output_tokens": max_tokens, "temperature": 0,
                                 "input": prompt, "store": store}, {}
    return "/v1/messages", {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                            "messages": [{"role": "user", "content": prompt}]}, {"anthropic-version": "2023-06-01"}


def has_content(kind: str, event: dict) -> bool:
    if kind == "chat":
        return bool(((event.get("choices") or [{}])[0].get("delta") or {}).get("content"))
    if kind == "completions":
        return bool((event.get("choices") or [{}])[0].get("text"))
    if kind == "responses":
        return event.get("type") == "response.output_text.delta" and bool(event.get("delta"))
    return event.get("type") == "content_block_delta" and bool((event.get("delta") or {}).get("text"))


def is_end(kind: str, line: str, event: dict | None) -> bool:
    if kind in ("chat", "completions"):
        return line == "data: [DONE]"
    if kind == "responses":
        return event is not None and event.get("type") in ("response.completed", "response.incomplete")
    return event is not None and event.get("type") == "message_stop"


def one_request(http: httpx.Client, kind: str, prompt: str, max_tokens: int, store: bool) -> dict:
    path, body, headers = request_of(kind, prompt, max_tokens, store)
    t0 = time.perf_counter()
    first = None
    ended = False
    chunks = 0
    try:
        with http.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                return {"kind": kind, "error": f"{r.status_code} {r.text[:200]}"}
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = None if line == "data: [DONE]" else json.loads(line[6:])
                if event is not None and has_content(kind, event):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter() - t0
                ended = ended or is_end(kind, line, event)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return {"kind": kind, "error": f"{type(exc).__name__}: {exc}"}
    latency = time.perf_counter() - t0
    if not ended:
        return {"kind": kind, "error": "a stream without its end"}
    # A stream can end before any content, when the model's first token ends the turn: not an error.
    return {"kind": kind, "latency": latency, "ttft": first, "chunks": chunks}


def client(index: int, url: str, key: str, seed: int, until: float, t0: float, out: list[dict]) -> None:
    rng = random.Random(seed * 1000 + index)
    work = WORK[index * 5:] + WORK[:index * 5]  # each client its own place in the cycle
    turn = rng.randrange(len(work))
    with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}", "x-api-key": key}) as http:
        while time.monotonic() < until:
            start = time.monotonic() - t0
            kind, prompt, max_tokens = work[turn % len(work)]
            out.append({"start": start, **one_request(http, kind, prompt, max_tokens, store=turn % 2 == 0)})
            turn += 1


def window(samples: list[dict], start: float, end: float) -> list[dict]:
    return [s for s in samples if start <= s["start"] < end]


def stats(requests: list[dict], rss: list[tuple[float, int]], start: float, end: float) -> dict:
    ok = [r for r in window(requests, start, end) if "error" not in r]
    memory = [v for t, v in rss if start <= t < end]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    per_chunk = [(r["latency"] - r["ttft"]) / (r["chunks"] - 1) for r in ok if r["chunks"] > 1]
    return {"from_s": start, "to_s": end, "requests": len(ok),
            "p50_latency_ms": round3(median(r["latency"] for r in ok) * 1e3) if ok else None,
            "p90_latency_ms": round3(percentile([r["latency"] for r in ok], 0.9) * 1e3) if ok else None,
            "p50_ttft_ms": round3(median(ttfts) * 1e3) if ttfts else None,
            "p50_ms_per_chunk": round3(median(per_chunk) * 1e3) if per_chunk else None,
            "empty_streams": sum(1 for r in ok if r["ttft"] is None),
            "chunks": sum(r["chunks"] for r in ok),
            "rss_mb": round(median(memory) / 2**20, 1) if memory else None}


# What the server did, scraped from /metrics each ``--rss-interval``: counters are differenced per minute
# in the summary's ``server_minutes`` (prefix-cache hit rate, prefill tokens and steps per request, seconds
# per step), gauges are taken as they stood at the minute's end.
SERVER_SERIES = ("spark_prefix_cache_queried_tokens_total", "spark_prefix_cache_hit_tokens_total",
                 "spark_prefix_cache_evictions_total", "spark_prefix_cache_pages", "spark_prefix_cache_pinned_pages",
                 "spark_kv_pages_used", "spark_kv_pages_total", "spark_step_seconds_count", "spark_step_seconds_sum",
                 "spark_step_prefill_tokens_sum", "spark_step_decode_rows_sum", "spark_prompt_tokens_total",
                 "spark_generation_tokens_total")


def scrape(server: SparkServer) -> dict[str, float]:
    try:
        return {k: v for k, v in server.metrics().items() if k in SERVER_SERIES}
    except httpx.HTTPError:
        return {}


def probe_speed(until: float, out: "multiprocessing.Queue") -> None:
    """In a process of its own: every 5 s, the seconds a fixed piece of Python work takes. The VM's
    speed moves by up to 40% within minutes; this says how fast the machine was in each minute, so that
    a latency drift can be told from the host's."""
    while time.monotonic() < until:
        t0 = time.perf_counter()
        sum(i * i for i in range(200_000))
        out.put((time.time(), time.perf_counter() - t0))
        time.sleep(5.0)


def window_probe(probes: list[tuple[float, float]], start: float, end: float) -> float:
    inside = [v for t, v in probes if start <= t < end]
    return median(inside) if inside else float("nan")


def server_minutes(samples: list[tuple[float, dict]], requests: list[dict], total: float,
                   probes: list[tuple[float, float]]) -> list[dict]:
    """Per minute: the counters' growth and the gauges at its end (a drift's cause: hit rate, prefill work)."""
    rows = []
    for start in range(0, int(total), 60):
        inside = [(t, v) for t, v in samples if start <= t < start + 60 and v]
        if len(inside) < 2:
            continue
        (t0, a), (t1, b) = inside[0], inside[-1]
        d = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in SERVER_SERIES}
        steps = d["spark_step_seconds_count"] or 1.0
        done = len([r for r in window(requests, start, start + 60) if "error" not in r]) or 1
        rows.append({
            "minute": start // 60, "requests": done,
            "probe_ms": round3(1e3 * median(v for t, v in probes if start <= t < start + 60)) if any(
                start <= t < start + 60 for t, _ in probes) else None,
            "hit_rate": round3(d["spark_prefix_cache_hit_tokens_total"] / (d["spark_prefix_cache_queried_tokens_total"] or 1)),
            "prompt_tokens_per_request": round3(d["spark_prompt_tokens_total"] / done),
            "prefill_tokens_per_request": round3(d["spark_step_prefill_tokens_sum"] / done),
            "steps_per_request": round3(steps / done),
            "ms_per_step": round3(1e3 * d["spark_step_seconds_sum"] / steps),
            "decode_rows_per_step": round3(d["spark_step_decode_rows_sum"] / steps),
            "evictions": d["spark_prefix_cache_evictions_total"],
            "cached_pages": b.get("spark_prefix_cache_pages"), "pinned_pages": b.get("spark_prefix_cache_pinned_pages"),
            "pages_total": b.get("spark_kv_pages_total"),
        })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="measured minutes, after the warm-up")
    parser.add_argument("--warmup-minutes", type=float, default=1.0)
    parser.add_argument("--window-s", type=float, default=60.0, help="the first and last windows compared")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rss-interval", type=float, default=5.0)
    parser.add_argument("--max-rss-drift", type=float, default=0.05)
    parser.add_argument("--max-p50-drift", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    key = "sk-mixed-load"
    warm, total = args.warmup_minutes * 60, (args.warmup_minutes + args.minutes) * 60

    requests: list[dict] = []
    rss: list[tuple[float, int]] = []
    series: list[tuple[float, dict]] = []
    with SparkServer({"SPARK_API_KEYS": key}, log_level="WARNING") as server:
        t0 = time.monotonic()
        until = t0 + total
        wall0 = time.time()
        probe_queue: multiprocessing.Queue = multiprocessing.Queue()
        prober = multiprocessing.Process(target=probe_speed, args=(until, probe_queue), daemon=True)
        prober.start()
        threads = [threading.Thread(target=client, args=(i, server.url, key, seed, until, t0, requests))
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            rss.append((time.monotonic() - t0, server.rss_bytes()))
            series.append((time.monotonic() - t0, scrape(server)))
            time.sleep(args.rss_interval)
        for t in threads:
            t.join()
        prober.join(timeout=10)
        probes = []
        while not probe_queue.empty():
            at, seconds = probe_queue.get()
            probes.append((at - wall0, seconds))
        alive = server.proc.poll() is None

    errors = [r for r in requests if "error" in r]
    first = stats(requests, rss, warm, warm + args.window_s)
    last = stats(requests, rss, total - args.window_s, total)

    def drift(key_: str) -> float | None:
        if first[key_] is None or last[key_] is None:
            return None
        return (last[key_] - first[key_]) / first[key_]

    rss_drift, p50_drift = drift("rss_mb"), drift("p50_latency_ms")
    by_kind = {k: sum(1 for r in requests if r["kind"] == k) for k in KINDS}
    summary = {
        "script": "mixed_load", "seed": seed, "clients": args.clients, "minutes": args.minutes,
        "warmup_minutes": args.warmup_minutes, "requests": len(requests), "by_kind": by_kind,
        "errors": len(errors), "first_errors": [f"{r['kind']}: {r['error']}" for r in errors[:5]],
        "warmup": stats(requests, rss, 0, warm), "first_minute": first, "last_minute": last,
        "whole_measured": stats(requests, rss, warm, total),
        "rss_drift": round3(rss_drift), "p50_drift": round3(p50_drift),
        # the host's own slowdown over the same windows (a fixed piece of Python work: speed_probe)
        "probe_drift": round3(window_probe(probes, total - args.window_s, total)
                              / window_probe(probes, warm, warm + args.window_s) - 1) if probes else None,
        "rss_mb_min_max": [round(min(v for _, v in rss) / 2**20, 1), round(max(v for _, v in rss) / 2**20, 1)],
        "server_alive": alive,
        "server_minutes": server_minutes(series, requests, total, probes),
    }
    checks = {
        "no_errors": not errors,
        "rss_drift": rss_drift is not None and rss_drift < args.max_rss_drift,  # growth: shrinking is no fault
        "p50_drift": p50_drift is not None and p50_drift < args.max_p50_drift,  # slower: faster is no fault
        "server_alive": alive,
    }
    return verdict(summary, checks)


if __name__ == "__main__":
    sys.exit(main())
