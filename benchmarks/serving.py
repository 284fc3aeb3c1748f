"""Serving through HTTP against the offline engine, on the same workload.

    python benchmarks/serving.py [--model dummy:llama-3.1-8b] [--clients 256] [--requests 1000]
                                 [--prompt 512] [--new 256] [--load-procs 8] [--out FILE]

1. Starts ``spark serve`` (a subprocess, the GPU), waits for /health and for the
   background CUDA-graph capture (its /metrics gauges; at most ``--settle`` seconds).
2. A load generator (asyncio + httpx in ``--load-procs`` processes, default 8)
   keeps ``--clients`` streamed /v1/completions requests in flight until
   ``--requests`` are done: random token-id prompts of ``--prompt`` tokens,
   ``--new`` greedy tokens, no EOS stop. Per request: time to first token and
   the gaps between content chunks (ITL); tokens come from the usage chunk, so
   a chunk may carry several (``tokens_per_chunk``).
3. Stops the server, then runs the offline engine (``spark.engine.offline.generate`` with
   the same batch limit and CUDA graphs) on the same prompts.
Prints a table; writes the serving entry as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import pathlib
import queue as queue_module
import random
import signal
import subprocess
import threading
import sys
import time


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def latency_summary(result: dict) -> dict:
    """What clients saw in a ``spread_load`` result: TTFT and gaps between chunks (p50/p99,
    ms; 0 when none came), tokens per chunk and the count of failed requests."""
    def ms(values: list[float], q: float, digits: int) -> float:
        return round(1000 * percentile(values or [0.0], q), digits)

    return {
        "ttft_p50_ms": ms(result["ttft"], 0.5, 1), "ttft_p99_ms": ms(result["ttft"], 0.99, 1),
        "itl_p50_ms": ms(result["gaps"], 0.5, 2), "itl_p99_ms": ms(result["gaps"], 0.99, 2),
        "tokens_per_chunk": round(result["output_tokens"] / max(1, result["chunks"]), 2),
        "errors": len(result["errors"]),
    }


def write_report(entry: dict, result: dict, line: str, out: str) -> None:
    """Print the errors seen (a sample), the entry as JSON and a one-line summary; write the JSON."""
    if result["errors"]:
        print("errors, e.g.:", sorted(set(result["errors"]))[:5])
    print(json.dumps(entry))
    print(line)
    with open(out, "w") as f:
        json.dump(entry, f, indent=1)


async def load(url: str, prompts: list[list[int]], clients: int, new: int) -> dict:
    """Keep ``clients`` streamed /v1/completions in flight until ``prompts`` are done (one process).

    Returns:
        start/end (``time.time()``), output tokens (from the usage chunks), content chunks,
        TTFTs and the gaps between content chunks (seconds), the errors, and the CPU seconds it used.
    """
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    ttfts, gaps, tokens, errors = [], [], [], []
    chunks = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal chunks
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"model": "sparky", "prompt": prompt, "max_tokens": new, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            start = time.perf_counter()
            last, count = None, 0
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        errors.append(f"{r.status_code} {(await r.aread())[:200]!r}")
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            count = chunk["usage"]["completion_tokens"]
                        if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                            continue
                        chunks += 1
                        now = time.perf_counter()
                        if last is None:
                            ttfts.append(now - start)
                        else:
                            gaps.append(now - last)
                        last = now
            except httpx.HTTPError as exc:  # counted, not fatal: one broken stream must not lose the run
                errors.append(f"{type(exc).__name__}: {exc}")
            tokens.append(count)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        t0, cpu0 = time.time(), time.process_time()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        t1, cpu1 = time.time(), time.process_time()
    return {"start": t0, "end": t1, "output_tokens": sum(tokens), "chunks": chunks, "ttft": ttfts, "gaps": gaps,
            "errors": errors, "cpu_s": cpu1 - cpu0}


def _load_process(url: str, prompts: list[list[int]], clients: int, new: int, barrier, results) -> None:
    import httpx  # noqa: F401  (imported before the barrier, so that no process starts late)

    barrier.wait()
    results.put(asyncio.run(load(url, prompts, clients, new)))


def gather(results, n: int, workers, tick=None) -> list:
    """``n`` items from ``results``, a queue the load processes ``workers`` fill; raises as soon as one
    of them failed, and calls ``tick`` every 5 s of waiting."""
    got = []
    while len(got) < n:
        try:
            got.append(results.get(timeout=5))
        except queue_module.Empty:
            dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a load process failed (exit code {dead[0]})") from None
            if tick is not None:
                tick()
    return got


def spread_load(url: str, prompts: list[list[int]], clients: int, new: int, procs: int) -> dict:
    """``load`` over ``procs`` processes (one asyncio loop parses a few thousand SSE lines/s at most).

    Clients and prompts are dealt out evenly; the processes start together.

    Returns:
        The merged result: ``wall_s`` from the first start to the last end, the sums and the lists of ``load``.
    """
    procs = max(1, min(procs, clients))
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_load_process, daemon=True, args=(
        url, prompts[i::procs], clients // procs + (i < clients % procs), new, barrier, results))
        for i in range(procs)]
    for w in workers:
        w.start()
    parts = gather(results, procs, workers)
    for w in workers:
        w.join()
    return {
        "wall_s": max(p["end"] for p in parts) - min(p["start"] for p in parts),
        "output_tokens": sum(p["output_tokens"] for p in parts), "chunks": sum(p["chunks"] for p in parts),
        "ttft": [t for p in parts for t in p["ttft"]], "gaps": [t for p in parts for t in p["gaps"]],
        "errors": [e for p in parts for e in p["errors"]], "cpu_s": sum(p["cpu_s"] for p in parts),
    }


def triton_kernels() -> set[str]:
    """The kernels in Triton's on-disk cache (``TRITON_CACHE_DIR``, else ``~/.triton/cache``): one
    ``<name>.json`` per compiled specialization, in a directory named by its hash."""
    root = pathlib.Path(os.environ.get("TRITON_CACHE_DIR") or pathlib.Path.home() / ".triton" / "cache")
    return {f"{p.parent.name}/{p.name}" for p in root.glob("*/*.json") if not p.name.startswith("__grp__")}


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not become healthy")


def stop_server(server: subprocess.Popen) -> None:
    """Stop a ``spark serve`` subprocess as Ctrl-C does (it drains), killing it after 60 s."""
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds used so far by process ``pid`` and by its children (the engine process), from /proc."""
    def used(p: int) -> float:
        with open(f"/proc/{p}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    children = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        children += used(int(entry))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
    return used(pid), children


def metric_values(url: str, prefix: str) -> dict[str, float]:
    """Every sample on the server's /metrics whose name starts with ``prefix``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(prefix)}


def wait_for_graphs(url: str, timeout: float) -> dict:
    """Wait until the server's background CUDA-graph capture is done (its /metrics gauges
    meet), at most ``timeout`` seconds, or 30 s without progress (a failed capture): before
    that some batch sizes decode eagerly."""
    t0 = last_change = time.time()
    seen = None
    while True:
        graphs = metric_values(url, "spark_decode_graphs_")
        captured, planned = graphs.get("spark_decode_graphs_captured", 0), graphs.get("spark_decode_graphs_planned", 0)
        now = time.time()
        if captured != seen:
            seen, last_change = captured, now
        if captured >= planned or now - t0 > timeout or now - last_change > 30:
            break
        time.sleep(0.5)
    waited = round(time.time() - t0, 1)
    if captured < planned:
        print(f"serving: timing with {captured:.0f} of {planned:.0f} decode graphs captured after {waited}s",
              file=sys.stderr)
    return {"graphs_captured": f"{captured:.0f}/{planned:.0f}", "graphs_wait_s": waited}


def step_totals(url: str) -> dict[str, float]:
    """The server's step histograms so far: ``<name>_sum`` and ``<name>_count`` of each."""
    return {name: value for name, value in metric_values(url, "spark_step_").items()
            if name.endswith(("_sum", "_count"))}


def step_shape(before: dict[str, float], after: dict[str, float]) -> dict:
    """Steps taken between two ``step_totals``, and their mean time, decode rows and prefill tokens."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    steps = delta.get("spark_step_seconds_count", 0.0)

    def mean(name: str, scale: float = 1.0) -> float | None:
        return round(scale * delta.get(name + "_sum", 0.0) / steps, 2) if steps else None

    return {"steps": int(steps), "step_ms_mean": mean("spark_step_seconds", 1000.0),
            "decode_rows_mean": mean("spark_step_decode_rows"), "prefill_tokens_mean": mean("spark_step_prefill_tokens")}


@contextlib.contextmanager
def rows_each_second(url: str, series: list[float]):
    """While the block runs, append to ``series`` the mean decode rows of the steps taken in
    each second: a closed loop of equal requests moves in waves, and the mean hides them."""
    done = threading.Event()

    def sample() -> None:
        last = step_totals(url)
        while not done.wait(1.0):
            now = step_totals(url)
            steps = now.get("spark_step_decode_rows_count", 0.0) - last.get("spark_step_decode_rows_count", 0.0)
            rows = now.get("spark_step_decode_rows_sum", 0.0) - last.get("spark_step_decode_rows_sum", 0.0)
            series.append(round(rows / steps, 1) if steps else 0.0)
            last = now

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield series
    finally:
        done.set()
        sampler.join()


def offline(model: str, prompts: list[list[int]], new: int, batch: int) -> float:
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    from spark.engine.engine import Engine
    from spark.engine.offline import generate
    from spark.engine.sampling import SamplingParams

    engine = Engine.load(model, progress=False, max_model_len=len(prompts[0]) + new + 16)
    if engine.enable_cuda_graphs(batch):
        engine.graphs.capture_all()
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    generate(engine, prompts[:batch], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    sync()
    t0 = time.perf_counter()
    out = generate(engine, prompts, params, max_batch_size=batch, max_prefill_tokens=8192)
    sync()
    return sum(len(o) for o in out) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--scheduler", default="slai")
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--load-procs", type=int, default=8, help="load-generator processes the clients are spread over")
    ap.add_argument("--out", default="serving.json")
    ap.add_argument("--cold", action="store_true",
                    help="label the row a first run on a fresh machine (nothing compiled or cached yet)")
    ap.add_argument("--settle", type=float, default=180.0,
                    help="seconds to wait at most for the background CUDA-graph capture before timing")
    args = ap.parse_args()

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(args.prompt)] for _ in range(args.requests)]
    url = f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "spark.cli", "serve", "--model", args.model, "--port", str(args.port),
           "--max-batch-size", str(args.clients), "--max-model-len", str(args.prompt + args.new + 16),
           "--max-prefill-tokens", str(args.max_prefill_tokens), "--scheduler", args.scheduler]
    kernels_before = triton_kernels()
    started = time.time()
    server = subprocess.Popen(cmd, env=env)
    try:
        wait_healthy(url, server)
        startup_s = round(time.time() - started, 1)
        kernels_ready = triton_kernels()
        warm = wait_for_graphs(url, args.settle)
        spread_load(url, prompts[: args.clients], args.clients, 8, args.load_procs)  # warm-up
        kernels_timed = triton_kernels()
        before, cpu_before, series = step_totals(url), cpu_seconds(server.pid), []
        with rows_each_second(url, series):
            result = spread_load(url, prompts, args.clients, args.new, args.load_procs)
        steps, cpu_after = step_shape(before, step_totals(url)), cpu_seconds(server.pid)
        steps["decode_rows_each_second"] = series
        steps.update(warm)
        # Kernels Triton compiled before the server said ready, and after (shapes its warm-up missed:
        # those compiles land in the first requests' time).
        kernels_end = triton_kernels()
        compiled = {"startup_s": startup_s, "triton_compiled_before_ready": len(kernels_ready - kernels_before),
                    "triton_compiled_after_ready": sorted(k.split("/")[1] for k in kernels_end - kernels_ready),
                    "triton_compiled_in_timed_run": sorted(k.split("/")[1] for k in kernels_end - kernels_timed)}
        # Cores busy during the load: the HTTP server's event loop (scheduler included), the engine process.
        steps["server_cpu_cores"] = round((cpu_after[0] - cpu_before[0]) / result["wall_s"], 2)
        steps["engine_cpu_cores"] = round((cpu_after[1] - cpu_before[1]) / result["wall_s"], 2)
        steps["engine_busy_frac"] = round(steps["steps"] * (steps["step_ms_mean"] or 0) / 1000 / result["wall_s"], 3)
    finally:
        stop_server(server)
    serving_tok_s = result["output_tokens"] / result["wall_s"]
    offline_tok_s = offline(args.model, prompts, args.new, args.clients)
    entry = {
        "bench": "serving", "model": args.model.removeprefix("dummy:"), "clients": args.clients,
        "requests": args.requests, "prompt_tokens": args.prompt, "new_tokens": args.new,
        "output_tok_s": round(serving_tok_s, 1), "offline_tok_s": round(offline_tok_s, 1),
        "ratio_to_offline": round(serving_tok_s / offline_tok_s, 3), "cold": args.cold,
        **latency_summary(result), **compiled,
        "load_procs": args.load_procs,
        "server_steps": steps,
    }
    line = (f"serving {serving_tok_s:.0f} tok/s, offline {offline_tok_s:.0f} tok/s, ratio {entry['ratio_to_offline']}; "
            f"TTFT p50/p99 {entry['ttft_p50_ms']}/{entry['ttft_p99_ms']} ms; "
            f"ITL p50/p99 {entry['itl_p50_ms']}/{entry['itl_p99_ms']} ms; {entry['tokens_per_chunk']} tokens per chunk; "
            f"{steps['steps']} steps of {steps['step_ms_mean']} ms, {steps['decode_rows_mean']} decode rows and "
            f"{steps['prefill_tokens_mean']} prefill tokens on average; engine busy {steps['engine_busy_frac']}; "
            f"CPU cores: server {steps['server_cpu_cores']}, engine {steps['engine_cpu_cores']}; "
            f"ready in {startup_s}s with {compiled['triton_compiled_before_ready']} Triton compiles, "
            f"{len(compiled['triton_compiled_after_ready'])} after, {len(compiled['triton_compiled_in_timed_run'])} "
            f"in the timed run")
    write_report(entry, result, line, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
