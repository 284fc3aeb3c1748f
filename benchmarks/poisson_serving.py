"""Serving under Poisson arrivals and mixed prompt lengths, SLAI against FIFO in one run (issue 24).

    python benchmarks/poisson_serving.py [--policies slai fifo] [--model dummy:llama-3.1-8b]
        [--requests 1000] [--rate 8] [--concurrency-cap 256] [--min-prompt 128] [--max-prompt 4096]
        [--new 128] [--max-batch-size 256] [--max-prefill-tokens 8192] [--load-procs 8]
        [--spark-args="--some-flag 1"] [--step-trace DIR] [--out FILE]

Issue 24's acceptance run (dummy 8B, a 256-stream cap): Poisson arrivals at the rate the GPU
sustains, chat-like prompts of 128-4096 tokens, 512 new tokens each, SLAI held to 23 ms between
tokens (``bash benchmarks/h200_session.sh poisson-20``):

    python benchmarks/poisson_serving.py --model dummy:llama-3.1-8b --requests 800 --rate 20 \
        --prompt-dist lognormal --new 512 --concurrency-cap 256 --max-batch-size 256 \
        --max-prefill-tokens 8192 --spark-args="--tbt-deadline-ms 23"

On an H100 that keeps 145-150 streams on average and up to 212-221. Past that rate (22/s and up)
the card cannot keep pace: the cap fills, clients wait seconds for a slot under either policy
(``send_lag_p99_ms``) and the queue, not the policy, sets the figures. Add the server's TTFT bound
with ``--spark-args="--ttft-bound 2"`` for the admission check (``h200_session.sh poisson-bound``).

For each policy: a fresh ``spark serve --scheduler <policy>`` subprocess; wait for /health and
for the background CUDA-graph capture (/metrics gauges); a warm-up of ``--warmup`` requests
spanning the prompt lengths (not the timed prompts; 4 new tokens each); then the timed run.
Every policy gets the same prompts (random token ids, lengths log-uniform in [--min-prompt,
--max-prompt], or with ``--prompt-dist lognormal`` chat-like: log-normal around ``--prompt-median``
clipped to that range; seeded) arriving at the same times (a Poisson process at ``--rate`` requests/s:
exponential gaps, seeded). The requests are streamed /v1/completions (greedy, ``ignore_eos``,
``--new`` tokens, usage on every chunk: vLLM's ``continuous_usage_stats``), sent by asyncio + httpx in ``--load-procs`` processes
(requests dealt round-robin; each process holds at most its share of ``--concurrency-cap`` in
flight; a request that finds no slot waits in the client). A refused request (HTTP 429 or 503,
the admission control) is counted with its ``Retry-After`` and not retried.

Each row (one per policy) in the JSON under benchmarks/results/:
  bench "poisson_serving"; policy "slai" or "fifo"; model; requests (sent); rate (requests/s);
  concurrency_cap; new_tokens; prompt_min/p50/mean/max (tokens of the prompts).
  output_tok_s: completion tokens (from the usage chunks) / wall time, first scheduled arrival to
    the last stream's end (under an unsaturated load it follows the arrival rate, not the server).
  ttft_p50_ms / ttft_p99_ms / ttft_max_ms: request sent -> first content chunk, admitted requests.
  ttft_from_arrival_p99_ms: the same from the scheduled arrival (adds any wait for a client slot).
  ttft_predictions, ttft_prediction_error_median, ttft_predictions_within_25pct: the admission's TTFT
    predictions in the timed run against the measured TTFT (the server's spark_ttft_prediction_error_ratio
    histogram; the median interpolated within its bucket; absent when nothing was predicted).
  server_itl_p50_ms / server_itl_p99_ms, server_step_p50_ms / server_step_p99_ms: the server's own time
    between a stream's tokens (where its streamer hands them on: before HTTP and the client) and its
    step times, from its /metrics histograms' growth over the timed run (linear within a bucket).
  itl_p50_ms / itl_p99_ms: time between tokens, all streams pooled: the gap before a content chunk
    spread over the tokens it carries (its usage says how many; as SGLang's bench_serving does). A chunk
    carries several when the detokenizer held text back (random tokens: bytes of one character), so
    the engine's token cadence is what this measures; tokens_per_chunk says how often that happened.
  chunk_gap_p50_ms / chunk_gap_p99_ms: the gaps between content chunks themselves, as a reader sees them.
  completed, errors (failed, not counting refusals), refused, refused_by_status ({"429": n, ...}),
    retry_after_s ({value: n} of the refusals' Retry-After headers), refused_without_retry_after.
  send_lag_p99_ms: scheduled arrival -> request sent (the cap's wait plus the generator's lateness).
  streams_mean (time-average of streams in flight, client side), streams_peak.
  steps, step_ms_mean, decode_rows_mean, prefill_tokens_mean: the server's steps in the timed run
    (``spark_step_*`` histograms on /metrics).
  decode_step_ms: the time of a step of decode_rows_mean rows and no prefill, from step time =
    a + b * prefill tokens + c * decode rows fitted over each second of the timed run (the
    server's steps mix prefills in; null when the run is too short to fit).
  itl_p99_over_decode_step = itl_p99_ms / decode_step_ms (the issue asks at most 2).
  graphs_captured, graphs_wait_s, triton_compiled_in_timed_run, load_cpu_cores (the generator's).
The document also holds ``slai_over_fifo_output_tok_s`` when both policies ran. Prints progress to
stderr, a table of both policies side by side last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import shlex
import subprocess
import sys
import threading
import time

from serving import (gather, latency_summary, percentile, spread_load, step_shape, step_totals, stop_server,
                     triton_kernels, wait_for_graphs, wait_healthy)

SENT, DONE, REFUSED, FAILED = range(4)  # slots of the shared progress counters


def workload(args) -> tuple[list[list[int]], list[float]]:
    """The prompts (lengths drawn as ``--prompt-dist`` says, within [min, max]) and their arrival
    offsets (Poisson), seeded."""
    rng = random.Random(args.seed)
    lo, hi = math.log(args.min_prompt), math.log(args.max_prompt)
    if args.prompt_dist == "lognormal":  # chat-like: most prompts short, a long tail to --max-prompt
        draw = lambda: rng.lognormvariate(math.log(args.prompt_median), args.prompt_sigma)  # noqa: E731
    else:
        draw = lambda: math.exp(rng.uniform(lo, hi))  # noqa: E731
    lengths = [min(args.max_prompt, max(args.min_prompt, round(draw()))) for _ in range(args.requests)]
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]
    arrivals, t = [], 0.0
    for _ in range(args.requests):
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    return prompts, arrivals


def warmup_prompts(args) -> list[list[int]]:
    """``--warmup`` prompts of lengths spaced evenly on a log scale from min to max, none of them a
    timed prompt (which would then find its pages in the prefix cache)."""
    rng, n = random.Random(args.seed + 1), args.warmup
    ratio = args.max_prompt / args.min_prompt
    lengths = [round(args.min_prompt * ratio ** (k / max(1, n - 1))) for k in range(n)]
    return [[rng.randrange(1, 500) for _ in range(length)] for length in lengths]


async def arrival_client(url: str, jobs: list[tuple[int, float, list[int]]], cap: int, new: int,
                         start_at: float, counters) -> dict:
    """Send each job ``(index, offset, prompt)`` at ``start_at + offset`` (wall clock), at most ``cap``
    in flight; one record per job: times relative to ``start_at``, TTFT and gaps in seconds."""
    import httpx

    slots = asyncio.Semaphore(cap)

    def bump(slot: int) -> None:
        with counters.get_lock():
            counters[slot] += 1

    async def one(http: httpx.AsyncClient, index: int, offset: float, prompt: list[int]) -> dict:
        await asyncio.sleep(max(0.0, start_at + offset - time.time()))
        rec = {"i": index, "due": offset, "status": None, "ttft": None, "gaps": [], "token_gaps": [], "chunks": 0,
               "tokens": 0,
               "retry_after": None, "error": None}
        async with slots:
            rec["sent"] = time.time() - start_at
            bump(SENT)
            body = {"model": "sparky", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            t0 = last = time.perf_counter()
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    rec["status"] = r.status_code
                    if r.status_code != 200:
                        rec["retry_after"] = r.headers.get("retry-after")
                        rec["error"] = f"{r.status_code} {(await r.aread())[:200]!r}"
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            before = rec["tokens"]
                            if chunk.get("usage"):
                                rec["tokens"] = chunk["usage"]["completion_tokens"]
                            if chunk.get("choices") and chunk["choices"][0].get("text"):
                                now = time.perf_counter()
                                if rec["ttft"] is None:
                                    rec["ttft"] = now - t0
                                else:
                                    rec["gaps"].append(now - last)
                                    # a chunk of n tokens (the text of some waits for the next: bytes
                                    # of one character) spreads its gap over them, as SGLang's bench does
                                    n = max(1, rec["tokens"] - before)
                                    rec["token_gaps"].extend([(now - last) / n] * n)
                                last = now
                                rec["chunks"] += 1
            except httpx.HTTPError as exc:  # counted, not fatal
                rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["end"] = time.time() - start_at
        bump(REFUSED if rec["status"] in (429, 503) else FAILED if rec["error"] else DONE)
        return rec

    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    cpu0 = time.process_time()
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:
        records = await asyncio.gather(*(one(http, *job) for job in jobs))
    return {"records": records, "cpu_s": time.process_time() - cpu0}


def _client_process(url, jobs, cap, new, ready, go, start_at, counters, results) -> None:
    import httpx  # noqa: F401  (imported before the start time is set)

    ready.put(os.getpid())
    go.wait()
    results.put(asyncio.run(arrival_client(url, jobs, cap, new, start_at.value, counters)))


def run_schedule(url: str, prompts: list[list[int]], arrivals: list[float], cap: int, new: int, procs: int,
                 label: str) -> dict:
    """``arrival_client`` over ``procs`` processes that share one start time; progress to stderr.

    Returns:
        ``records`` (one per request, by index) and the generator's ``cpu_s``.
    """
    procs = max(1, min(procs, cap, len(prompts)))
    ctx = multiprocessing.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    start_at, counters = ctx.Value("d", 0.0), ctx.Array("l", 4)
    jobs = list(zip(range(len(prompts)), arrivals, prompts))
    workers = [ctx.Process(target=_client_process, daemon=True, args=(
        url, jobs[i::procs], cap // procs + (i < cap % procs), new, ready, go, start_at, counters, results))
        for i in range(procs)]
    for w in workers:
        w.start()


    gather(ready, procs, workers)
    start_at.value = time.time() + 1.0
    go.set()

    def progress() -> None:
        with counters.get_lock():
            sent, done, refused, failed = counters[:]
        finished = done + refused + failed
        print(f"  {label}: {time.time() - start_at.value:6.0f}s  {finished}/{len(prompts)} done, "
              f"{sent - finished} in flight, {refused} refused, {failed} errors", file=sys.stderr, flush=True)

    parts = gather(results, procs, workers, progress)
    progress()
    for w in workers:
        w.join()
    records = sorted((r for p in parts for r in p["records"]), key=lambda r: r["i"])
    return {"records": records, "cpu_s": sum(p["cpu_s"] for p in parts)}


def decode_step_ms(snapshots: list[tuple[float, dict]], rows: float | None) -> float | None:
    """The mean time of a step of ``rows`` decode rows and no prefill: step time = a + b * prefill
    tokens + c * decode rows, fitted (least squares weighted by steps) over the intervals between
    ``step_totals`` snapshots; None when there are too few intervals or the fit is degenerate."""
    import numpy as np

    samples = []  # (steps, ms per step, prefill tokens per step, decode rows per step) of each interval
    for (_, a), (_, b) in zip(snapshots, snapshots[1:]):
        d = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in b}
        n = d.get("spark_step_seconds_count", 0.0)
        if n > 0:
            samples.append((n, 1000 * d.get("spark_step_seconds_sum", 0.0) / n,
                            d.get("spark_step_prefill_tokens_sum", 0.0) / n,
                            d.get("spark_step_decode_rows_sum", 0.0) / n))
    if rows is None or len(samples) < 5:
        return None
    n, y, prefill, decode = (np.array(c) for c in zip(*samples))
    x = np.stack([np.ones_like(y), prefill, decode], axis=1) * np.sqrt(n)[:, None]
    coef, _, rank, _ = np.linalg.lstsq(x, y * np.sqrt(n), rcond=None)
    if rank < 3:  # e.g. no interval without prefill variation: drop the rows term
        coef, _, rank, _ = np.linalg.lstsq(x[:, :2], y * np.sqrt(n), rcond=None)
        coef = np.append(coef, 0.0)
    estimate = float(coef[0] + coef[2] * rows)
    return round(estimate, 2) if estimate > 0 else None


def histogram_buckets(url: str, name: str) -> dict[float, float]:
    """The cumulative buckets (upper bound -> count) of the server's histogram ``name``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {float(s.labels["le"]): s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name + "_bucket"}


# The server's histograms a run reads the growth of: TTFT prediction error, time between tokens, step time.
HISTOGRAMS = ("spark_ttft_prediction_error_ratio", "spark_inter_token_latency_seconds", "spark_step_seconds")


def server_histograms(url: str) -> dict[str, dict[float, float]]:
    out = {name: histogram_buckets(url, name) for name in HISTOGRAMS}
    for label, buckets in labelled_buckets(url, "spark_step_seconds_by_prefill", "prefill").items():
        out[f"step_by_prefill:{label}"] = buckets
    return out


def labelled_buckets(url: str, name: str, label: str) -> dict[str, dict[float, float]]:
    """The cumulative buckets of each ``label`` value of the server's histogram ``name``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name + "_bucket":
                out.setdefault(s.labels[label], {})[float(s.labels["le"])] = s.value
    return out


def bucket_quantile(grown: list[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of cumulative buckets ``(upper bound, count)``, linear within its bucket; None
    when empty or past the last finite bound."""
    total = grown[-1][1] if grown else 0.0
    if not total:
        return None
    lower, below = 0.0, 0.0
    for le, count in grown:
        if count >= q * total:
            if le == float("inf"):
                return None
            return lower + (le - lower) * (q * total - below) / ((count - below) or 1.0)
        lower, below = le, count
    return None


def growth(before: dict[float, float], after: dict[float, float]) -> list[tuple[float, float]]:
    return sorted((le, after[le] - before.get(le, 0.0)) for le in after)


def prediction_error(before: dict[float, float], after: dict[float, float]) -> dict:
    """The timed run's TTFT prediction error from the histogram's growth: its median (linear within the
    bucket it falls in) and the share at most 0.25; empty when the server predicted nothing."""
    grown = growth(before, after)
    total = grown[-1][1] if grown else 0.0
    if not total:
        return {}
    median = bucket_quantile(grown, 0.5)
    within = next(count for le, count in grown if le >= 0.25) / total
    return {"ttft_predictions": int(total), "ttft_prediction_error_median": None if median is None
            else round(median, 3), "ttft_predictions_within_25pct": round(within, 3)}


def server_side(before: dict, after: dict) -> dict:
    """The server's own view of the timed run: its time between tokens (each stream's, where the
    streamer hands tokens on, before HTTP and the client) and its step times, p50/p99 in ms."""
    row = prediction_error(before["spark_ttft_prediction_error_ratio"], after["spark_ttft_prediction_error_ratio"])
    for key, name in (("server_itl", "spark_inter_token_latency_seconds"), ("server_step", "spark_step_seconds")):
        grown = growth(before[name], after[name])
        for q in (0.5, 0.99):
            value = bucket_quantile(grown, q)
            row[f"{key}_p{round(q * 100)}_ms"] = None if value is None else round(1000 * value, 2)
    by_prefill = {}  # which steps are slow: step time by the prompt tokens each step computed
    for name in sorted(k for k in after if k.startswith("step_by_prefill:")):
        grown = growth(before.get(name, {}), after[name])
        if grown and grown[-1][1]:
            quantiles = {f"p{round(q * 100)}_ms": bucket_quantile(grown, q) for q in (0.5, 0.9, 0.99)}
            by_prefill[name.split(":", 1)[1]] = {"steps": int(grown[-1][1]), **{
                k: None if v is None else round(1000 * v, 2) for k, v in quantiles.items()}}
    row["server_step_by_prefill"] = by_prefill
    return row


def policy_row(policy: str, args, prompts, arrivals, url: str, extra: list[str]) -> dict:
    """Start a server with ``policy``, warm it, run the schedule, stop it; the row of the JSON."""
    cmd = [sys.executable, "-m", "spark.cli", "serve", "--model", args.model, "--port", str(args.port),
           "--scheduler", policy, "--max-batch-size", str(args.max_batch_size),
           "--max-prefill-tokens", str(args.max_prefill_tokens),
           "--max-model-len", str(args.max_model_len or args.max_prompt + args.new + 16), *extra]
    print(f"poisson_serving: {policy}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.step_trace:  # the server's every step (warm-up included), one JSON line each
        env["SPARK_STEP_TRACE"] = os.path.join(args.step_trace, f"{policy}-steps.jsonl")
    server = subprocess.Popen(cmd, env=env)
    snapshots: list[tuple[float, dict]] = []
    stop = threading.Event()
    try:
        wait_healthy(url, server)
        graphs = wait_for_graphs(url, args.settle)
        if args.warmup:
            warm = warmup_prompts(args)
            spread_load(url, warm, len(warm), 4, min(args.load_procs, len(warm)))
        kernels = triton_kernels()
        histograms_before = server_histograms(url)

        def sample() -> None:
            while True:
                snapshots.append((time.time(), step_totals(url)))
                if stop.wait(1.0):
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        result = run_schedule(url, prompts, arrivals, args.concurrency_cap, args.new, args.load_procs, policy)
        stop.set()
        sampler.join()
        snapshots.append((time.time(), step_totals(url)))
        observed = server_side(histograms_before, server_histograms(url))
        compiled = sorted(triton_kernels() - kernels)  # "<hash>/<kernel>.json": what the load compiled late
    finally:
        stop.set()
        stop_server(server)

    recs = result["records"]
    ok = [r for r in recs if r["status"] == 200 and not r["error"]]
    refused = [r for r in recs if r["status"] in (429, 503)]
    failed = [r for r in recs if r["error"] and r["status"] not in (429, 503)]
    wall = max(r["end"] for r in recs) - min(arrivals)
    token_gaps = [g for r in ok for g in r["token_gaps"]]
    pooled = {"ttft": [r["ttft"] for r in ok if r["ttft"] is not None], "gaps": token_gaps,
              "output_tokens": sum(r["tokens"] for r in ok), "chunks": sum(r["chunks"] for r in ok),
              "errors": [r["error"] for r in failed]}
    lengths = [len(p) for p in prompts]
    by_status, retry_after = {}, {}
    for r in refused:
        by_status[str(r["status"])] = by_status.get(str(r["status"]), 0) + 1
        if r["retry_after"] is not None:
            retry_after[r["retry_after"]] = retry_after.get(r["retry_after"], 0) + 1
    # streams in flight over time, from the client's send/end times
    events = sorted([(r["sent"], 1) for r in recs] + [(r["end"], -1) for r in recs], key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    steps = step_shape(snapshots[0][1], snapshots[-1][1])
    decode_ms = decode_step_ms(snapshots, steps["decode_rows_mean"])
    latency = latency_summary(pooled)
    row = {
        "bench": "poisson_serving", "policy": policy, "model": args.model.removeprefix("dummy:"),
        "requests": len(recs), "rate": args.rate, "concurrency_cap": args.concurrency_cap, "new_tokens": args.new,
        "prompt_min": min(lengths), "prompt_p50": percentile(lengths, 0.5),
        "prompt_mean": round(sum(lengths) / len(lengths), 1), "prompt_max": max(lengths),
        "output_tok_s": round(pooled["output_tokens"] / wall, 1), **latency,
        "chunk_gap_p50_ms": round(1000 * percentile([g for r in ok for g in r["gaps"]] or [0.0], 0.5), 2),
        "chunk_gap_p99_ms": round(1000 * percentile([g for r in ok for g in r["gaps"]] or [0.0], 0.99), 2),
        "ttft_max_ms": round(1000 * max(pooled["ttft"] or [0.0]), 1), **observed,
        "ttft_from_arrival_p99_ms": round(1000 * percentile(
            [r["sent"] - r["due"] + r["ttft"] for r in ok if r["ttft"] is not None] or [0.0], 0.99), 1),
        "completed": len(ok), "refused": len(refused), "refused_by_status": by_status,
        "retry_after_s": retry_after, "refused_without_retry_after": sum(r["retry_after"] is None for r in refused),
        "send_lag_p99_ms": round(1000 * percentile([r["sent"] - r["due"] for r in recs], 0.99), 1),
        "streams_mean": round(sum(r["end"] - r["sent"] for r in recs) / wall, 1), "streams_peak": peak,
        "wall_s": round(wall, 2), "output_tokens": pooled["output_tokens"],
        **steps, "decode_step_ms": decode_ms,
        "itl_p99_over_decode_step": round(latency["itl_p99_ms"] / decode_ms, 2) if decode_ms else None,
        **graphs, "triton_compiled_in_timed_run": len(compiled),
        "triton_compiled_names": sorted({name.split("/")[-1].removesuffix(".json") for name in compiled}),
        "load_cpu_cores": round(result["cpu_s"] / wall, 2), "load_procs": args.load_procs,
    }
    if failed:
        print(f"  {policy}: errors, e.g.: {sorted(set(pooled['errors']))[:3]}", file=sys.stderr)
    return row


def device_name() -> str:
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        name = []
    return name[0].split()[-1].lower() if name else "cpu"


def table(rows: list[dict]) -> str:
    fields = ["requests", "completed", "refused", "errors", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
              "ttft_max_ms", "itl_p50_ms", "itl_p99_ms", "server_itl_p99_ms", "server_step_p99_ms", "tokens_per_chunk",
              "ttft_prediction_error_median", "decode_step_ms",
              "itl_p99_over_decode_step", "step_ms_mean", "decode_rows_mean", "prefill_tokens_mean",
              "streams_mean", "streams_peak", "send_lag_p99_ms", "load_cpu_cores"]
    lines = [f"{'':26}" + "".join(f"{r['policy']:>12}" for r in rows)]
    lines += [f"{f:26}" + "".join(f"{str(r.get(f)):>12}" for r in rows) for f in fields]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", nargs="+", choices=["slai", "fifo"], default=["slai", "fifo"])
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--concurrency-cap", type=int, default=256, help="streams in flight at most (client side)")
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=4096)
    ap.add_argument("--prompt-dist", choices=["loguniform", "lognormal"], default="loguniform",
                    help="prompt lengths: log-uniform in [min, max], or log-normal (chat-like) clipped to it")
    ap.add_argument("--prompt-median", type=int, default=256, help="lognormal: the median prompt length")
    ap.add_argument("--prompt-sigma", type=float, default=1.0, help="lognormal: sigma of log(length)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=0, help="default: --max-prompt + --new + 16")
    ap.add_argument("--spark-args", default="", help='more flags for spark serve, e.g. --spark-args="--x 1"')
    ap.add_argument("--port", type=int, default=8341)
    ap.add_argument("--load-procs", type=int, default=8, help="load-generator processes")
    ap.add_argument("--warmup", type=int, default=32, help="warm-up requests per server (4 tokens each)")
    ap.add_argument("--settle", type=float, default=180.0, help="seconds to wait at most for the graph capture")
    ap.add_argument("--step-trace", default="", help="a folder: each server logs its steps to <policy>-steps.jsonl")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    prompts, arrivals = workload(args)
    url = f"http://127.0.0.1:{args.port}"
    extra = shlex.split(args.spark_args)
    rows = []
    for policy in args.policies:
        rows.append(policy_row(policy, args, prompts, arrivals, url, extra))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    device, date = device_name(), time.strftime("%Y-%m-%d")
    doc = {"bench": "poisson_serving", "date": date, "device": device, "command": shlex.join(sys.argv),
           "rows": rows}
    by = {r["policy"]: r for r in rows}
    if "slai" in by and "fifo" in by and by["fifo"]["output_tok_s"]:
        doc["slai_over_fifo_output_tok_s"] = round(by["slai"]["output_tok_s"] / by["fifo"]["output_tok_s"], 3)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"poisson-serving-{device}-{date}.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(rows))
    if "slai_over_fifo_output_tok_s" in doc:
        print(f"SLAI output tok/s / FIFO's: {doc['slai_over_fifo_output_tok_s']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
