"""How long heavy request bodies hold the event loop: /health latency while they are parsed.

Starts a server (``spark serve --model default``) unless ``--url`` is given, then for each heavy case
(a 1.4 MB chat body with a 100,000-entry ``logit_bias`` (refused: ids past the vocabulary), one with
40,000 valid entries; an Anthropic ``count_tokens`` with 100,000
messages) sends it while another client polls ``GET /health`` every 10 ms, and prints, per case, the
heavy request's status and wall time and the worst and median /health latency during it (JSON).

    python benchmarks/event_loop_stall.py [--url http://127.0.0.1:8000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx


def heavy_cases(model: str) -> dict[str, tuple[str, bytes]]:
    bias = {str(i): 0.5 for i in range(100_000)}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logit_bias": bias}
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(99_999)]
    count = {"model": model, "max_tokens": 16, "messages": many}
    valid = {**chat, "logit_bias": {str(i): 0.5 for i in range(40_000)}}  # below the default model's vocabulary
    return {"logit_bias_100k": ("/v1/chat/completions", json.dumps(chat).encode()),
            "logit_bias_40k_valid": ("/v1/chat/completions", json.dumps(valid).encode()),
            "count_tokens_100k_messages": ("/v1/messages/count_tokens", json.dumps(count).encode())}


def measure(url: str, path: str, body: bytes) -> dict:
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=60) as probe:
            while not done.is_set():
                t = time.perf_counter()
                probe.get("/health")
                latencies.append(time.perf_counter() - t)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.3)
    with httpx.Client(base_url=url, timeout=300) as client:
        t = time.perf_counter()
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        wall = time.perf_counter() - t
    time.sleep(0.2)
    done.set()
    poller.join()
    return {"status": r.status_code, "wall_s": round(wall, 3), "health_max_ms": round(1000 * max(latencies), 1),
            "health_p50_ms": round(1000 * statistics.median(latencies), 1)}


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "SPARK_MAX_BODY_BYTES": str(8 << 20), "SPARK_STATE_PATH": ":memory:"}
    proc = subprocess.Popen([sys.executable, "-m", "spark.cli", "serve", "--model", "default", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    proc, url = (None, args.url) if args.url else start_server()
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        results = {}
        for name, (path, body) in heavy_cases(model).items():
            runs = [measure(url, path, body) for _ in range(args.repeat)]
            results[name] = {"bytes": len(body), "runs": runs,
                             "health_max_ms_median": statistics.median(r["health_max_ms"] for r in runs),
                             "wall_s_median": statistics.median(r["wall_s"] for r in runs)}
        print(json.dumps(results, indent=1))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
