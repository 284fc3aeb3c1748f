"""Key flood: 100,000 distinct bearer tokens cost the server no memory and its real clients no latency.

How Spark identifies a client (``spark/http/application.py`` ``_authenticate``, ``spark/actors/ingress.py``):
  * with ``SPARK_API_KEYS`` set, a token is checked against the key ring (one HMAC digest, one set
    lookup) before the body is read; an unknown token gets 401 and is kept nowhere. Only configured
    keys become rate-limit identities, so the limiter's key cap (``SPARK_RATE_LIMIT_MAX_KEYS``) bounds
    the configured keys that are in use, not the tokens a flood sends.
  * without it, ``g.api_key`` stays None whatever the Authorization header says: no token becomes an
    identity, and the rate limiter is never consulted (``SPARK_RATE_LIMIT_RPS`` then limits nothing).

Both cases are flooded (``--mode keyed|open|both``), each on a fresh server with rate limiting on
(``--rps``) and the key cap set (``--max-keys``): ``--tokens`` requests, each with a new token, over
``--connections`` keep-alive raw sockets from a separate process. Half (``--post-fraction``) are
``POST /v1/chat/completions`` (keyed: a real chat body, 401, and the server closes the connection;
open: a body that fails validation, 400, so that no generation runs), the others ``GET /v1/models``.

Each mode runs, on one server: a warm-up (3 generations, ``--warmup-tokens`` flood requests); the
idle TTFT; the memory flood of ``--tokens`` requests with nothing else meanwhile (no generation: they
can grow the RSS by themselves, as the CPU's KV pages are first touched); the TTFT after it; a flood of
``--during-tokens`` more new tokens with the TTFT sampled every ``--probe-interval`` seconds; a control
flood of ``--control-tokens`` requests that all carry one token, sampled the same way.

Pass criteria, per mode:
  * the server's resident memory (its process tree, /proc) grows by less than ``--max-rss-growth-mb``
    (50) from before the memory flood to after it;
  * the real key's TTFT (streamed chat, request to first content chunk; median of ``--probes``) after
    the memory flood, and during the flood that follows, is within ``--max-ttft-ratio`` (2x) of the idle
    server's;
  * every flood request got the expected status (keyed: 401; open: 200 or 400) and none failed;
  * keyed: the limiter is on for the real key (``--burst`` requests at once, beyond ``--rps``, get 429s).
    Open: the same burst with one token is reported (``rate_limited``), not checked.

Reported, no check: the TTFT during the control flood, which tells what the volume alone costs
from what distinct tokens cost. ``--flood-rps`` caps the floods' rate (0: as fast as they go).

Run: ``python scripts/accept/key_flood.py [--mode both] [--tokens 100000]``; prints one JSON summary and
exits 1 when a check fails. On a CPU of two cores the server, the flood and the probes share them
(and on the CPU the engine is a thread of the server unless ``--engine-process on``): the TTFT during
the flood measures that contention as much as Spark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import queue
import secrets
import sys
import threading
import time

import httpx

from harness import SparkServer, median, round3, verdict

MODEL = "sparky"
REAL_KEY = "sk-real-" + secrets.token_hex(12)
CHAT = json.dumps({"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hello there"}]}).encode()
INVALID_CHAT = json.dumps({"model": MODEL, "messages": "not a list"}).encode()


# -- the flood (in a process of its own) ----------------------------------------------------------


async def _flood(host: str, port: int, tokens: int, connections: int, post_fraction: float, post_body: bytes,
                 start: int, rate: float, same_token: bool) -> dict:
    counter = iter(range(start, start + tokens))
    statuses: dict[str, int] = {}
    errors: list[str] = []
    reconnects = 0
    post_every = round(1 / post_fraction) if post_fraction > 0 else 0
    salt = secrets.token_hex(4)

    def request(i: int) -> bytes:
        token = f"sk-flood-{salt}-same" if same_token else f"sk-flood-{salt}-{i:07d}-{secrets.token_hex(6)}"
        auth = f"Authorization: Bearer {token}\r\n"
        if post_every and i % post_every == 0:
            return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
                    f"Content-Length: {len(post_body)}\r\n\r\n").encode() + post_body
        return f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\n{auth}\r\n".encode()

    async def worker() -> None:
        nonlocal reconnects
        reader = writer = None
        pause = connections / rate if rate > 0 else 0.0
        for i in counter:
            if pause:
                await asyncio.sleep(pause)
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, port)
                    reconnects += 1
                writer.write(request(i))
                head = await reader.readuntil(b"\r\n\r\n")
                status = head[9:12].decode()
                lower = head.lower()
                length = int(lower.split(b"content-length:")[1].split(b"\r\n")[0]) if b"content-length:" in lower else 0
                await reader.readexactly(length)
                statuses[status] = statuses.get(status, 0) + 1
                if b"connection: close" in lower:
                    writer.close()
                    reader = writer = None
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                if writer is not None:
                    writer.close()
                reader = writer = None
        if writer is not None:
            writer.close()

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(connections)))
    return {"sent": tokens, "statuses": statuses, "errors": len(errors), "first_errors": errors[:5],
            "connections_opened": reconnects, "seconds": time.monotonic() - t0}


def _flood_process(out, *args) -> None:
    out.put(asyncio.run(_flood(*args)))


def flood(url: str, args, tokens: int, post_body: bytes, start: int, during=None, same_token: bool = False) -> dict:
    """Run the flood in a child process; call ``during()`` repeatedly until it ends."""
    host, port = url.removeprefix("http://").split(":")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_flood_process, args=(out, host, int(port), tokens, args.connections,
                                                     args.post_fraction, post_body, start, args.flood_rps,
                                                     same_token))
    proc.start()
    while proc.is_alive() and out.empty():
        if during is not None:
            during()
        else:
            time.sleep(0.2)
    try:
        result = out.get(timeout=30)
    except queue.Empty:
        raise RuntimeError(f"the flood process ended with {proc.exitcode} and no result") from None
    proc.join()
    return result


# -- measuring the real client and the server ----------------------------------------------------


def ttft(http: httpx.Client, key: str) -> float:
    """Seconds from sending a streamed chat request to its first content chunk."""
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Say hi."}]}
    t0 = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                if (json.loads(line[6:])["choices"][0].get("delta") or {}).get("content"):
                    first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the stream had no content")
    return first


def paced(measure, n: int, rps: float) -> list[float]:
    """``n`` measurements, spaced so that the real key stays well under its rate limit."""
    values = []
    for _ in range(n):
        values.append(measure())
        time.sleep(2.0 / rps)
    return values


def rss_settled(server: SparkServer, samples: int = 5) -> int:
    values = []
    for _ in range(samples):
        values.append(server.rss_bytes())
        time.sleep(0.5)
    return int(median(values))


def limiter_probe(url: str, key: str, burst: int) -> dict:
    """``burst`` requests of ``key`` at once: the statuses they get."""
    statuses: list[int] = []
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}

    def one() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            statuses.append(http.post("/v1/chat/completions", json=body,
                                      headers={"Authorization": f"Bearer {key}"}).status_code)

    threads = [threading.Thread(target=one) for _ in range(burst)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {str(s): statuses.count(s) for s in sorted(set(statuses))}


def run_mode(mode: str, args) -> tuple[dict, dict[str, bool]]:
    env = {"SPARK_RATE_LIMIT_RPS": str(args.rps), "SPARK_RATE_LIMIT_MAX_KEYS": str(args.max_keys)}
    if mode == "keyed":
        env["SPARK_API_KEYS"] = REAL_KEY
    if args.engine_process:
        env["SPARK_ENGINE_PROCESS"] = args.engine_process
    post_body = CHAT if mode == "keyed" else INVALID_CHAT
    expected = {"401"} if mode == "keyed" else {"200", "400"}
    with SparkServer(env, log_level="WARNING") as server, httpx.Client(base_url=server.url, timeout=120) as http:
        for _ in range(3):
            ttft(http, REAL_KEY)  # warm-up of the generation path
        warm = flood(server.url, args, args.warmup_tokens, post_body, start=0)
        time.sleep(1.0)
        idle = paced(lambda: ttft(http, REAL_KEY), args.probes, args.rps)
        rss_before = rss_settled(server)

        rss_peak = [rss_before]

        def watch() -> None:
            rss_peak[0] = max(rss_peak[0], server.rss_bytes())
            time.sleep(0.2)

        # The memory measurement: a flood that generates nothing, with nothing else meanwhile (generations
        # can grow the RSS by themselves, as KV pages on the CPU are touched for the first time).
        result = flood(server.url, args, args.tokens, post_body, start=args.warmup_tokens, during=watch)
        time.sleep(2.0)
        rss_after = rss_settled(server)
        after = paced(lambda: ttft(http, REAL_KEY), args.probes, args.rps)

        samples: dict[str, list[float]] = {"distinct": [], "same": []}
        flooding = ["distinct"]  # which flood the TTFT samples taken now belong to
        last_probe = [0.0]

        def probe() -> None:
            if time.monotonic() - last_probe[0] >= args.probe_interval:
                samples[flooding[0]].append(ttft(http, REAL_KEY))
                last_probe[0] = time.monotonic()
            time.sleep(0.1)

        during_flood = flood(server.url, args, args.during_tokens, post_body, start=args.warmup_tokens + args.tokens,
                             during=probe)
        control_flood = None
        if args.control_tokens:  # the same volume with one token throughout: what the volume alone costs
            flooding[0] = "same"
            control_flood = flood(server.url, args, args.control_tokens, post_body, start=0, during=probe,
                                  same_token=True)
        during, control = samples["distinct"], samples["same"]
        if mode == "keyed":
            limiter = {"burst": args.burst, "statuses": limiter_probe(server.url, REAL_KEY, args.burst)}
        else:  # the same burst with one token: 429s would make it an identity (or the limit global)
            time.sleep(2.0)
            statuses = limiter_probe(server.url, "sk-one-token", args.burst)
            limiter = {"burst": args.burst, "one_token_statuses": statuses, "rate_limited": "429" in statuses}
        alive = server.proc.poll() is None

    idle_ms, during_ms, after_ms = (median(x) for x in (idle, during, after))
    growth_mb = (rss_after - rss_before) / 2**20
    summary = {
        "mode": mode, "tokens": result["sent"], "flood_s": round3(result["seconds"]),
        "flood_rps": round(result["sent"] / result["seconds"]), "statuses": result["statuses"],
        "flood_errors": result["errors"], "first_errors": result["first_errors"],
        "connections_opened": result["connections_opened"], "warmup_statuses": warm["statuses"],
        "rss_before_mb": round(rss_before / 2**20, 1), "rss_after_mb": round(rss_after / 2**20, 1),
        "rss_peak_mb": round(rss_peak[0] / 2**20, 1), "rss_growth_mb": round(growth_mb, 1),
        "ttft_idle_ms": round3(idle_ms * 1e3), "ttft_during_ms": round3(during_ms * 1e3) if during else None,
        "ttft_after_ms": round3(after_ms * 1e3), "ttft_during_samples": len(during),
        "during_flood_tokens": during_flood["sent"], "during_flood_rps": round(during_flood["sent"] / during_flood["seconds"]),
        "ttft_during_ratio": round3(during_ms / idle_ms) if during else None,
        "ttft_after_ratio": round3(after_ms / idle_ms),
        "same_token_flood_rps": round(control_flood["sent"] / control_flood["seconds"]) if control_flood else None,
        "ttft_during_same_token_flood_ms": round3(median(control) * 1e3) if control else None,
        "ttft_during_same_token_ratio": round3(median(control) / idle_ms) if control else None, "limiter": limiter, "server_alive": alive,
    }
    checks = {
        f"{mode}_rss_growth": growth_mb < args.max_rss_growth_mb,
        f"{mode}_ttft_after": after_ms <= args.max_ttft_ratio * idle_ms,
        f"{mode}_ttft_during": bool(during) and during_ms <= args.max_ttft_ratio * idle_ms,
        f"{mode}_statuses": all(set(f["statuses"]) <= expected and f["errors"] == 0
                                for f in (result, during_flood, control_flood) if f is not None),
        f"{mode}_server_alive": alive,
    }
    if mode == "keyed":
        checks["keyed_limiter_on"] = limiter["statuses"].get("429", 0) > 0
    return summary, checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("keyed", "open", "both"), default="both")
    parser.add_argument("--tokens", type=int, default=100_000, help="flood requests, one new token each")
    parser.add_argument("--warmup-tokens", type=int, default=3000)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--flood-rps", type=float, default=0.0, help="the flood's rate at most (0: as fast as it goes)")
    parser.add_argument("--during-tokens", type=int, default=20_000,
                        help="then a flood of this many new tokens, with the real key's TTFT sampled during it")
    parser.add_argument("--control-tokens", type=int, default=20_000,
                        help="then as many requests with one token throughout, to tell volume from distinct tokens")
    parser.add_argument("--post-fraction", type=float, default=0.5)
    parser.add_argument("--rps", type=float, default=4.0, help="SPARK_RATE_LIMIT_RPS")
    parser.add_argument("--max-keys", type=int, default=1000, help="SPARK_RATE_LIMIT_MAX_KEYS")
    parser.add_argument("--burst", type=int, default=8, help="keyed: requests at once to see the limiter refuse")
    parser.add_argument("--probes", type=int, default=9, help="TTFT samples before and after the flood")
    parser.add_argument("--probe-interval", type=float, default=2.0, help="seconds between TTFT samples during it")
    parser.add_argument("--engine-process", choices=("auto", "on", "off"), default=None,
                        help="SPARK_ENGINE_PROCESS (on the CPU, auto is off: the engine is a thread of the server)")
    parser.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    parser.add_argument("--max-ttft-ratio", type=float, default=2.0)
    args = parser.parse_args()
    summaries, checks = [], {}
    for mode in (("keyed", "open") if args.mode == "both" else (args.mode,)):
        summary, mode_checks = run_mode(mode, args)
        summaries.append(summary)
        checks.update(mode_checks)
    return verdict({"script": "key_flood", "rps": args.rps, "max_keys": args.max_keys, "modes": summaries}, checks)


if __name__ == "__main__":
    sys.exit(main())
