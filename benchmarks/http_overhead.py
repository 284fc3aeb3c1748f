"""What Spark's HTTP path delivers when the engine costs nothing but a fixed wait (CPU only).

    python benchmarks/http_overhead.py [--clients 256] [--requests N] [--step-ms 30] [--new 256]
                                       [--prompt 64] [--load-procs 2] [--pipeline spark|ideal]
                                       [--profile FILE] [--out FILE]

1. Starts a real Spark server (hypercorn, trio) in a subprocess whose engine is the
   actor tests' ``EngineDouble`` with the SmolLM2 tokenizer, each step padded to
   ``--step-ms`` of wall time by sleeping in the worker thread (a GPU that is never
   the bottleneck and never holds the GIL). The engine alone would then make
   ``clients * 1000 / step_ms`` tok/s: the ceiling. ``--pipeline ideal`` replaces the
   scheduler and GPU runner by a wall clock that hands out a token per sequence every
   step, however busy the event loop is: the HTTP side alone, as if the engine never
   waited for it.
2. A load generator (``serving.spread_load``: asyncio + httpx in ``--load-procs``
   processes) streams /v1/completions with ``--clients`` in flight: random token-id
   prompts, ``--new`` tokens, ``ignore_eos``, tokens counted from the usage chunk.
3. Prints delivered tok/s, the ceiling, their ratio, chunks/s, tokens per chunk and the
   CPU the server and the load used; writes them as JSON. ``--profile FILE`` runs the
   server under cProfile (slower; read it with ``python -m pstats FILE``).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import socket
import subprocess
import sys
import time
import zlib

import trio

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # serving.py, and the repo (spark, tests)

from serving import (  # noqa: E402
    cpu_seconds, latency_summary, rows_each_second, spread_load, step_shape, step_totals, stop_server, wait_healthy,
    write_report,
)


def timed_engine(step_s: float, max_model_len: int, num_pages: int):
    """An ``EngineDouble`` (SmolLM2 tokenizer) whose steps each take ``step_s`` of wall time."""
    import types

    from tests.actors.engine_double import EngineDouble
    from tests.http.replay import smollm_tokenizer

    tokenizer = smollm_tokenizer()
    vocab = tokenizer.vocab_size

    class TimedEngine(EngineDouble):
        def enable_cuda_graphs(self, max_batch_size: int, verify_rows: int = 0, max_step_tokens: int | None = None) -> bool:
            return False

        def step(self, plan):
            t0 = time.perf_counter()
            outputs = super().step(plan)
            time.sleep(max(0.0, step_s - (time.perf_counter() - t0)))  # in the worker thread: the GIL is free
            return outputs

    def token(seq_id, position: int) -> int:  # ordinary tokens only: no EOS, no control tokens
        return 1000 + zlib.crc32(f"{seq_id}@{position}".encode()) % (vocab - 1000)

    engine = TimedEngine(num_pages=num_pages, max_model_len=max_model_len, vocab_size=vocab, tokenizer=tokenizer,
                         eos_token_ids=tokenizer.eos_token_ids, token_fn=token)
    engine.config = types.SimpleNamespace(vocab_size=vocab)  # what create_app reads
    return engine


async def wall_clock_host(step_s: float, vocab: int, transport, config, admissions, cancels, to_streamer, metrics,
                          *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Stands in for ``spark.actors.host.run_host`` (the core and its loop) with ``--pipeline ideal``.

    Every running sequence gets a token each ``step_s`` of wall time, whether or not this
    event loop kept up: steps owed are sent at once, as from an engine that never waits
    for the loop. So the HTTP side (streamer, streams, SSE, hypercorn) is measured alone.
    """
    from spark.actors.messages import StreamOpen
    from spark.core.events import TokenBatch
    from spark.core.plan import TokenOutput

    running: dict[str, list[int]] = {}  # request id -> [tokens made, max_tokens]

    async def admit(sub) -> None:
        running[sub.request.request_id] = [0, sub.request.params.max_tokens]
        await to_streamer.send(StreamOpen(sub))

    async with admissions, cancels, to_streamer:
        task_status.started()
        due = trio.current_time()
        while True:
            if not running:
                await admit(await admissions.receive())
                due = trio.current_time() + step_s
            for channel, act in ((admissions, admit), (cancels, None)):
                while True:
                    try:
                        msg = channel.receive_nowait()
                    except trio.WouldBlock:
                        break
                    if act is None:
                        running.pop(msg.request_id, None)
                    else:
                        await act(msg)
            await trio.sleep_until(due)
            now = trio.current_time()
            while due <= now and running:  # every step that came due meanwhile
                outputs = []
                for rid, made in list(running.items()):
                    made[0] += 1
                    end = made[0] >= made[1]
                    token = 1000 + zlib.crc32(f"{rid}@{made[0]}".encode()) % (vocab - 1000)
                    outputs.append(TokenOutput(rid, token, finish_reason="length" if end else None))
                    if end:
                        del running[rid]
                await to_streamer.send(TokenBatch(tuple(outputs), now))
                due += step_s


def serve(args) -> None:
    """The server process: serve the timed engine until SIGINT (then write the profile, if asked)."""
    import trio

    from spark.http.serve import serve_async
    from spark.serve_config import ServeConfig

    max_model_len = args.prompt + args.new + 16
    engine = timed_engine(args.step_ms / 1000, max_model_len, num_pages=args.clients * (max_model_len // 16 + 2) + 64)
    config = ServeConfig(model="double", served_name="double", port=args.port, device="cpu",
                         max_batch_size=args.clients, max_waiting=2 * args.clients, max_model_len=max_model_len,
                         max_prefill_tokens=args.clients * args.prompt, tbt_deadline_ms=10_000)
    run = functools.partial(trio.run, functools.partial(serve_async, config, engine=engine, settle_gc=True))
    if args.pipeline == "ideal":
        from spark.actors import system

        system.run_host = functools.partial(wall_clock_host, args.step_ms / 1000, engine.vocab_size)
    if not args.profile:
        run()
        return
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        run()
    finally:
        profile.disable()
        profile.dump_stats(args.profile)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--requests", type=int, default=None, help="default: one per client")
    ap.add_argument("--step-ms", type=float, default=30.0)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--load-procs", type=int, default=2)
    ap.add_argument("--pipeline", choices=("spark", "ideal"), default="spark",
                    help="spark: the real core loop around the timed double; ideal: tokens on a "
                         "wall clock, as if the engine never waited for the event loop")
    ap.add_argument("--profile", default=None, help="cProfile the server into this file")
    ap.add_argument("--out", default="http_overhead.json")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args)
        return 0

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--port", str(port), "--clients", str(args.clients),
           "--step-ms", str(args.step_ms), "--prompt", str(args.prompt), "--new", str(args.new),
           "--pipeline", args.pipeline]
    if args.profile:
        cmd += ["--profile", os.path.abspath(args.profile)]
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rng = random.Random(0)
    requests = args.requests or args.clients
    prompts = [[rng.randrange(1000, 20000) for _ in range(args.prompt)] for _ in range(requests)]
    try:
        wait_healthy(url, server, timeout=120)
        spread_load(url, prompts[: args.clients], args.clients, 4, args.load_procs)  # warm-up: connections, caches
        cpu0, steps0, series = cpu_seconds(server.pid)[0], step_totals(url), []
        with rows_each_second(url, series):
            result = spread_load(url, prompts, args.clients, args.new, args.load_procs)
        cpu1, steps = cpu_seconds(server.pid)[0], step_shape(steps0, step_totals(url))
        steps["decode_rows_each_second"] = series
    finally:
        stop_server(server)
    tok_s = result["output_tokens"] / result["wall_s"]
    ceiling = args.clients * 1000 / args.step_ms
    entry = {
        "bench": "http_overhead", "pipeline": args.pipeline, "clients": args.clients, "requests": requests,
        "step_ms": args.step_ms,
        "prompt_tokens": args.prompt, "new_tokens": args.new, "load_procs": args.load_procs,
        "output_tok_s": round(tok_s, 1), "engine_tok_s": round(ceiling, 1), "ratio": round(tok_s / ceiling, 3),
        "chunks_per_s": round(result["chunks"] / result["wall_s"], 1),
        **latency_summary(result),
        # near 1.0: the server's one event loop is the limit (the engine's sleeps cost no CPU)
        "server_cpu": round((cpu1 - cpu0) / result["wall_s"], 2),
        "load_cpu": round(result["cpu_s"] / result["wall_s"], 2),  # the load processes' cores, all together
        "error_samples": sorted(set(result["errors"]))[:3],
        "profiled": bool(args.profile),
        "server_steps": steps,
    }
    line = (f"delivered {tok_s:.0f} tok/s of the engine's {ceiling:.0f} (ratio {entry['ratio']}); "
            f"{entry['chunks_per_s']} chunks/s, {entry['tokens_per_chunk']} tokens per chunk; "
            f"CPU: server {entry['server_cpu']}, load {entry['load_cpu']} cores; TTFT p50 {entry['ttft_p50_ms']} ms; "
            f"steps: {steps}")
    write_report(entry, result, line, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
