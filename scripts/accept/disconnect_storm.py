"""Disconnect storm: clients that hang up at random moments leave nothing behind.

What it proves: ``--requests`` streamed requests (chat and completions, half each) are cut at
random moments, ``--concurrency`` at a time: some before the first byte of the response (a raw
socket sends the whole request, waits a random delay, and closes, sometimes with a RST), some
mid-stream (httpx reads a random number of content chunks, then closes the response, which
closes its connection). Every cut is classified by what had arrived when it happened:
``no_bytes``, ``at_first_byte`` (the first byte came before the delay ran out; the cut follows it),
``headers_only`` (headers, no content yet) or ``mid_stream``.

Pass criteria:
  * ``spark_requests_running``, ``spark_requests_waiting`` and ``spark_kv_pages_used`` (/metrics)
    are all 0 within ``--settle-limit`` seconds (2) of the last cut, and still 0 a second later;
  * a normal request (chat, not streamed) and a streamed completion read to its end succeed;
  * no request of the storm failed otherwise (an HTTP error, a reset before the cut).

Run: ``python scripts/accept/disconnect_storm.py [--requests 200] [--concurrency 24]``; prints one JSON
summary and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import struct
import sys
import time

import httpx
import trio

from harness import SparkServer, median, percentile, round3, verdict

MODEL = "sparky"
PROMPTS = ("Count from 1 to 300, one number per line.", "Tell me a very long story about a lighthouse keeper.",
           "List every country you know, with its capital.")


def body_of(endpoint: str, rng: random.Random, max_tokens: int) -> dict:
    prompt = rng.choice(PROMPTS)
    common = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.7}
    if endpoint == "/v1/chat/completions":
        return {**common, "messages": [{"role": "user", "content": prompt}]}
    return {**common, "prompt": prompt}


def content_of(endpoint: str, event: dict) -> str:
    choice = (event.get("choices") or [{}])[0]
    return (choice.get("delta") or {}).get("content") or "" if endpoint == "/v1/chat/completions" else choice.get("text") or ""


async def cut_raw(url: str, endpoint: str, body: dict, delay: float, reset: bool) -> dict:
    """Send the whole request on a raw socket, wait ``delay`` (or until a first byte comes), close."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (f"POST {endpoint} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\n\r\n").encode()
    sock = trio.socket.socket()
    await sock.connect((host, int(port)))
    try:
        await sock.send(head + payload)
        got = b""
        with trio.move_on_after(delay):
            got = await sock.recv(1, socket.MSG_PEEK)
        if reset:  # SO_LINGER 0: close() sends a RST, as a killed client would
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return {"phase": "at_first_byte" if got else "no_bytes", "cut_at": time.monotonic(), "reset": reset}
    finally:
        sock.close()


async def cut_mid_stream(http: httpx.AsyncClient, endpoint: str, body: dict, chunks: int) -> dict:
    """Read ``chunks`` content chunks of the stream, then close it (and so its connection)."""
    seen = 0
    async with http.stream("POST", endpoint, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"phase": "error", "status": response.status_code, "body": response.text[:200],
                    "cut_at": time.monotonic()}
        phase = "headers_only"
        if chunks > 0:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if content_of(endpoint, json.loads(line[6:])):
                    seen += 1
                    phase = "mid_stream"
                    if seen >= chunks:
                        break
            else:
                return {"phase": "finished", "chunks": seen, "cut_at": time.monotonic()}
        cut_at = time.monotonic()
    return {"phase": phase, "chunks": seen, "cut_at": cut_at}


async def storm(url: str, args, rng: random.Random) -> list[dict]:
    results: list[dict] = []
    limit = trio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        async def one(i: int) -> None:
            endpoint = ("/v1/chat/completions", "/v1/completions")[i % 2]
            body = body_of(endpoint, rng, args.max_tokens)
            early = rng.random() < args.early_fraction
            async with limit:
                await trio.sleep(rng.uniform(0, 0.05))  # staggered: cuts land in every stage of a request
                t0 = time.monotonic()
                try:
                    if early:
                        # A quarter hang up as soon as the request is sent; the others after up to
                        # --max-early-delay, log-uniform (the headers come within milliseconds).
                        delay = 0.0 if rng.random() < 0.25 else args.max_early_delay * 10 ** rng.uniform(-3, 0)
                        result = await cut_raw(url, endpoint, body, delay, reset=rng.random() < 0.5)
                    else:
                        result = await cut_mid_stream(http, endpoint, body, rng.randint(0, args.max_cut_chunks))
                except (OSError, httpx.HTTPError) as exc:
                    result = {"phase": "error", "error": f"{type(exc).__name__}: {exc}", "cut_at": time.monotonic()}
                results.append({**result, "endpoint": endpoint, "elapsed": result["cut_at"] - t0})

        async with trio.open_nursery() as nursery:
            for i in range(args.requests):
                nursery.start_soon(one, i)
    return results


def settle(server: SparkServer, since: float, limit: float) -> tuple[float | None, dict]:
    """Poll /metrics until running, waiting and KV pages used are all 0; seconds since ``since``."""
    names = ("spark_requests_running", "spark_requests_waiting", "spark_kv_pages_used")
    deadline = since + max(limit, 10.0) + 20.0  # wait longer than the limit, to report how long it took
    last = {}
    while time.monotonic() < deadline:
        metrics = server.metrics()
        last = {n: metrics.get(n) for n in names}
        if all(v == 0 for v in last.values()):
            return time.monotonic() - since, last
        time.sleep(0.02)
    return None, last


def normal_requests(url: str) -> dict:
    with httpx.Client(base_url=url, timeout=120) as http:
        chat = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 8,
                                                       "messages": [{"role": "user", "content": "Say hello."}]})
        chat_ok = chat.status_code == 200 and bool(chat.json()["choices"][0]["message"]["content"])
        finish = None
        with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "The sea is", "max_tokens": 8,
                                                          "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    finish = json.loads(line[6:])["choices"][0].get("finish_reason") or finish
        return {"chat_status": chat.status_code, "chat_ok": chat_ok, "stream_status": r.status_code,
                "stream_finish_reason": finish}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--early-fraction", type=float, default=0.4, help="cut before the first byte (raw socket)")
    parser.add_argument("--max-early-delay", type=float, default=0.05, help="seconds after sending, at most")
    parser.add_argument("--max-cut-chunks", type=int, default=40, help="content chunks read before a cut, at most")
    parser.add_argument("--max-tokens", type=int, default=256, help="of each request (ignore_eos: it would run long)")
    parser.add_argument("--settle-limit", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)

    with SparkServer() as server:
        normal_requests(server.url)  # warm-up: the first request of a fresh server pays one-time costs
        t0 = time.monotonic()
        results = trio.run(storm, server.url, args, rng)
        last_cut = max(r["cut_at"] for r in results)
        settle_s, gauges = settle(server, last_cut, args.settle_limit)
        time.sleep(1.0)
        again = server.metrics()
        still_zero = all(again.get(n) == 0 for n in gauges)
        after = normal_requests(server.url)
        alive = server.proc.poll() is None

    phases: dict[str, int] = {}
    for r in results:
        phases[r["phase"]] = phases.get(r["phase"], 0) + 1
    errors = [r for r in results if r["phase"] == "error"]
    chunks = [r["chunks"] for r in results if r["phase"] == "mid_stream"]
    summary = {
        "script": "disconnect_storm", "seed": seed, "requests": len(results), "concurrency": args.concurrency,
        "storm_s": round3(last_cut - t0), "phases": phases,
        "resets": sum(1 for r in results if r.get("reset")),
        "mid_stream_chunks": {"median": median(chunks), "max": max(chunks, default=None)},
        "cut_elapsed_s": {"p50": round3(percentile([r["elapsed"] for r in results], 0.5)),
                          "max": round3(max(r["elapsed"] for r in results))},
        "settle_s": round3(settle_s), "gauges_at_settle": gauges, "still_zero_1s_later": still_zero,
        "after": after, "errors": errors[:5], "server_alive": alive, "server_ready_s": round3(server.ready_s),
    }
    checks = {
        "settled_within_limit": settle_s is not None and settle_s <= args.settle_limit,
        "still_zero": still_zero,
        "normal_request_after": after["chat_ok"] and after["stream_status"] == 200
                                and after["stream_finish_reason"] is not None,
        "no_storm_errors": not errors,
        "server_alive": alive,
    }
    return verdict(summary, checks)


if __name__ == "__main__":
    sys.exit(main())
