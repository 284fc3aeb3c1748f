"""A short benchmark of the active model over HTTP: time to first token and tokens/s at 1 and N streams.

Requests are streamed completions of a fixed token-id prompt with ``ignore_eos``, so
that every stream generates exactly ``max_tokens`` tokens whatever the model.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import attrs
import httpx


@attrs.frozen
class BenchRow:
    streams: int
    ttft_p50_s: float  # time to first token, median over the streams
    ttft_max_s: float
    stream_tokens_per_s: float  # output tokens per second of one stream, mean (TTFT included)
    total_tokens_per_s: float  # output tokens of all streams over the wall time
    completion_tokens: int
    errors: int


@attrs.frozen
class _Run:
    ttft: float | None
    seconds: float
    tokens: int
    error: str | None = None


def run_bench(url: str, model: str, *, api_key: str | None = None, streams: tuple[int, ...] = (1, 8),
              max_tokens: int = 64, prompt_tokens: int = 32, timeout_s: float = 600.0) -> list[BenchRow]:
    """One round per entry of ``streams``, each that many concurrent streamed completions.

    Args:
      url: the server, e.g. ``http://127.0.0.1:8000``.
      model: the model name to send (``sparky``: whatever is active).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": list(range(10, 10 + prompt_tokens)), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    rows = []
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s,
                      limits=httpx.Limits(max_connections=max(streams) + 2)) as client:
        _one(client, {**body, "max_tokens": 2})  # warm-up: first-request costs stay out of the numbers
        for n in streams:
            runs: list[_Run | None] = [None] * n
            start = threading.Barrier(n)

            def worker(i: int) -> None:
                start.wait()
                runs[i] = _one(client, body)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            ok = [r for r in runs if r is not None and r.error is None and r.ttft is not None]
            tokens = sum(r.tokens for r in ok)
            ttfts = [r.ttft for r in ok] or [float("nan")]
            rows.append(BenchRow(
                streams=n, ttft_p50_s=statistics.median(ttfts), ttft_max_s=max(ttfts),
                stream_tokens_per_s=statistics.fmean([r.tokens / r.seconds for r in ok]) if ok else 0.0,
                total_tokens_per_s=tokens / wall if wall > 0 else 0.0, completion_tokens=tokens,
                errors=n - len(ok)))
    return rows


def _one(client: httpx.Client, body: dict) -> _Run:
    t0 = time.perf_counter()
    ttft, tokens, chunks = None, None, 0
    try:
        with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return _Run(None, 0.0, 0, f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    return _Run(None, 0.0, 0, event["error"].get("message"))
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0].get("text"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    except httpx.HTTPError as exc:
        return _Run(None, 0.0, 0, f"{type(exc).__name__}: {exc}")
    return _Run(ttft, time.perf_counter() - t0, tokens if tokens is not None else chunks)


def format_table(rows: list[BenchRow]) -> str:
    lines = [f"{'streams':>7}  {'TTFT p50':>9}  {'TTFT max':>9}  {'tok/s/stream':>12}  {'tok/s total':>11}  "
             f"{'tokens':>6}  {'errors':>6}"]
    for r in rows:
        lines.append(f"{r.streams:>7}  {r.ttft_p50_s * 1000:>7.0f}ms  {r.ttft_max_s * 1000:>7.0f}ms  "
                     f"{r.stream_tokens_per_s:>12.1f}  {r.total_tokens_per_s:>11.1f}  {r.completion_tokens:>6}  "
                     f"{r.errors:>6}")
    return "\n".join(lines)
