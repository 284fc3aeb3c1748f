"""Start-up time of ``spark serve``: from the command to ``/health`` ok, cold and warm.

    python benchmarks/startup.py [--model dummy:llama-3.1-8b] [--max-batch-size 256]
        [--max-prefill-tokens 8192] [--runs 2] [--out FILE]

Each run starts a server, waits for ``/health`` to say ok (the port answers 503 "loading" before,
then the model loads and warms up: ``spark/engine/warmup.py``), notes the time, and stops it. The
first run on a fresh machine compiles every Triton kernel (cold); the later ones find them in
Triton's on-disk cache (warm). Also counts the kernels each run compiled (Triton's cache entries
before and after). Prints one line per run; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from serving import stop_server, triton_kernels, wait_healthy


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=784)
    ap.add_argument("--port", type=int, default=8331)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default="startup.json")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "spark.cli", "serve", "--model", args.model, "--port", str(args.port),
           "--max-batch-size", str(args.max_batch_size), "--max-prefill-tokens", str(args.max_prefill_tokens),
           "--max-model-len", str(args.max_model_len)]
    rows = []
    for run in range(args.runs):
        before = triton_kernels()
        started = time.time()
        server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_healthy(url, server)
            ready_s = round(time.time() - started, 1)
        finally:
            stop_server(server)
        row = {"bench": "startup", "model": args.model.removeprefix("dummy:"), "run": run, "ready_s": ready_s,
               "triton_compiled": len(triton_kernels() - before)}
        rows.append(row)
        print(f"startup run {run}: ready in {ready_s}s, {row['triton_compiled']} Triton kernels compiled", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
