"""Fuzz a Spark server from its own /openapi.json: thousands of generated requests across every route.

    python scripts/fuzz.py                       # starts `spark serve --model default` of its own
    python scripts/fuzz.py --requests 500 --url http://127.0.0.1:8000 --api-key sk-... [--admin-key ...]

The requests are drawn by the strategies of ``tests/http/fuzzing.py`` (those of tests/http/test_fuzz.py):
valid, mutated and hostile bodies, made-up and real path parameters, wrong methods and paths. Prints a
JSON summary (requests per route and per status, 5xx, 4xx bodies not in their API's error shape,
tracebacks, errors the server logged, health and a real chat request afterwards, wall time) and exits
1 if any check failed. A valid body never reaches /api/inference/up or /down: those would take the
model away.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests.http import fuzzing  # noqa: E402  (the repository root is on the path only now)

API_KEY, ADMIN_KEY = "sk-fuzz", "sk-fuzz-admin"
START_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: pathlib.Path) -> tuple[subprocess.Popen, str, pathlib.Path]:
    """``spark serve`` on a free port with its state in ``root``; its process, URL and log file."""
    port = _free_port()
    env = {**os.environ, "SPARK_API_KEYS": API_KEY, "SPARK_ADMIN_KEY": ADMIN_KEY,
           "SPARK_STATE_PATH": str(root / "state.sqlite"), "SPARK_ACTIVITY_LOG_PATH": str(root / "activity.jsonl"),
           "SPARK_USAGE_PATH": str(root / "usage.json"), "SPARK_MAX_MODEL_LEN": "512",
           "SPARK_DEFAULT_MAX_TOKENS": "4", "SPARK_DEVICE": "cpu"}
    log = root / "server.log"
    process = subprocess.Popen([sys.executable, "-m", "spark.cli", "--log-level", "INFO", "serve", "--model",
                                "default", "--host", "127.0.0.1", "--port", str(port), "--cpu-threads", "1"],
                               env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the server did not answer /health within {START_TIMEOUT_S:.0f} s")


def draw_calls(fuzzer: fuzzing.Fuzzer, n: int, rng_seed: int) -> list[fuzzing.Call]:
    """``n`` requests drawn by hypothesis, a round of every route at a time (generation only: nothing
    fails, so nothing shrinks)."""
    calls: list[fuzzing.Call] = []
    per_round = len(fuzzer.ops) + 1

    @seed(rng_seed)
    @settings(max_examples=-(-n // per_round), deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(round_=fuzzer.rounds())
    def collect(round_):
        calls.extend(round_)

    collect()
    return calls[:n]


def send(client: httpx.Client, call: fuzzing.Call) -> tuple[int, list[str]]:
    """The answer's status (0: none came) and what is wrong with it."""
    try:
        r = client.request(call.method, call.path, content=call.body, headers=dict(call.headers))
    except httpx.HTTPError as exc:
        return 0, [f"no answer: {type(exc).__name__}: {exc}"]
    return r.status_code, fuzzing.problems(call, r.status_code, r.content)


def run(url: str, n: int, *, api_key: str, admin_key: str | None, concurrency: int, rng_seed: int) -> dict:
    auth = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=url, timeout=120) as http:
        doc = http.get("/openapi.json").json()
        cid = http.post("/v1/conversations", json={"items": [{"role": "user", "content": "hi"}]}, headers=auth)
        rid = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1}, headers=auth)
        model = http.get("/v1/models", headers=auth).json()["data"][0]["id"]
    ids = {"cid": [cid.json()["id"]], "rid": [rid.json()["id"]], "name": [model, "sparky"]}
    fuzzer = fuzzing.Fuzzer(doc, ids=ids, api_key=api_key, admin_key=admin_key)
    started = time.monotonic()
    calls = draw_calls(fuzzer, n, rng_seed)
    drawn_s = time.monotonic() - started
    per_route, per_status, per_kind = collections.Counter(), collections.Counter(), collections.Counter()
    counts = collections.Counter()
    failures: list[dict] = []
    clients = [httpx.Client(base_url=url, timeout=120) for _ in range(concurrency)]
    try:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            answers = pool.map(lambda ic: send(clients[ic[0] % concurrency], ic[1]), enumerate(calls))
            for call, (status, problems) in zip(calls, answers):
                per_route[call.operation] += 1
                per_status[status] += 1
                per_kind[call.kind] += 1
                counts["5xx"] += status >= 500
                counts["no_answer"] += status == 0
                counts["4xx_not_in_shape"] += any("shape" in p or "no error object" in p or "not JSON" in p
                                                  for p in problems) and 400 <= status < 500
                counts["tracebacks"] += any("traceback" in p for p in problems)
                counts["internal_errors_in_bodies"] += any("internal error in a" in p for p in problems)
                if problems and len(failures) < 30:
                    failures.append({"method": call.method, "path": call.path, "status": status,
                                     "body": (call.body or b"")[:500].decode("utf-8", "backslashreplace"),
                                     "problems": problems})
    finally:
        for client in clients:
            client.close()
    with httpx.Client(base_url=url, timeout=120) as http:
        health = http.get("/health").status_code
        chat = http.post("/v1/chat/completions", headers=auth, json={
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Say hi"}]}).status_code
    return {"requests": len(calls), "per_route": dict(sorted(per_route.items())),
            "per_status": {str(k): v for k, v in sorted(per_status.items())}, "per_kind": dict(per_kind),
            "5xx": counts["5xx"], "no_answer": counts["no_answer"], "4xx_not_in_shape": counts["4xx_not_in_shape"],
            "tracebacks": counts["tracebacks"], "internal_errors_in_bodies": counts["internal_errors_in_bodies"],
            "health_after": health, "chat_after": chat, "draw_s": round(drawn_s, 1),
            "wall_s": round(time.monotonic() - started, 1), "failures": failures}


def logged_errors(log: pathlib.Path) -> list[str]:
    """The ERROR lines (and tracebacks) the server wrote: a stream's failure is logged, not answered."""
    lines = log.read_text(errors="replace").splitlines()
    return [line for line in lines if "Traceback" in line or " ERROR " in line or line.startswith("ERROR")][:30]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--api-key", default=None, help="with --url: a key it accepts")
    parser.add_argument("--admin-key", default=None, help="with --url: its admin key, to fuzz the admin bodies")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spark-fuzz-") as tmp:
        process = log = None
        url, api_key, admin_key = args.url, args.api_key, args.admin_key
        if url is None:
            process, url, log = start_server(pathlib.Path(tmp))
            api_key, admin_key = API_KEY, ADMIN_KEY
        try:
            summary = run(url, args.requests, api_key=api_key or "none", admin_key=admin_key,
                          concurrency=args.concurrency, rng_seed=args.seed)
        finally:
            if process is not None:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
        if log is not None:
            summary["server_logged_errors"] = logged_errors(log)
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    failed = (summary["5xx"] or summary["no_answer"] or summary["4xx_not_in_shape"] or summary["tracebacks"]
              or summary["internal_errors_in_bodies"] or summary.get("server_logged_errors")
              or summary["health_after"] != 200 or summary["chat_after"] != 200)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
