"""SLAI vs FIFO scheduling, simulated: the real actors over an engine double on a mock clock.

A step takes ``5 ms + 0.25 ms * tokens`` of simulated time. Eight streams
decode long outputs while long prompts (1500-2000 tokens) keep arriving about
every 300 ms. FIFO gives each step up to ``max_prefill_tokens`` (2048) prompt
tokens, so a running stream waits for a whole long prefill between two tokens;
SLAI cuts prefills to what fits before the tightest time-between-tokens
deadline (100 ms). We measure the gaps between consecutive tokens of the eight
streams (as their pieces arrive) and the time to first token of the long
prompts. ``tests/actors/test_slai_simulation.py`` runs the same scenario.

    python benchmarks/slai_simulation.py [--long-prompts 12] [--interval 0.3] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repo root holds spark/ and tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attrs
import trio
import trio.testing

from spark.actors.messages import GenerateRequest
from spark.actors.system import open_system
from spark.engine.sampling import SamplingParams
from spark.serve_config import ServeConfig
from tests.actors.engine_double import EngineDouble, simulated_executor

RESULTS = Path(__file__).resolve().parent / "results" / "slai-simulation.json"


@attrs.frozen
class Scenario:
    step_base: float = 0.005  # seconds per step
    step_per_token: float = 0.00025  # seconds per computed token
    tbt_deadline: float = 0.100  # SLAI's time-between-tokens target
    max_prefill_tokens: int = 2048
    num_streams: int = 8
    stream_prompt_tokens: int = 32
    num_long_prompts: int = 12
    long_prompt_tokens: tuple[int, int] = (1500, 2000)
    long_interval: float = 0.300  # mean seconds between long prompts (each gap is drawn within +-20%)
    long_max_tokens: int = 4
    warmup: float = 0.5  # streams decode alone this long first (the cost model learns the step time)
    seed: int = 0


@attrs.frozen
class Result:
    policy: str
    gaps: tuple[float, ...]  # seconds between consecutive tokens of the streams, while prompts arrived or waited
    ttfts: tuple[float, ...]  # seconds from submit to first token, per long prompt
    steps: int
    simulated_seconds: float

    def gap(self, q: float) -> float:
        return percentile(self.gaps, q)

    def ttft(self, q: float) -> float:
        return percentile(self.ttfts, q)

    def summary(self) -> dict:
        return {
            "gap_p50_ms": 1000 * self.gap(0.5), "gap_p99_ms": 1000 * self.gap(0.99), "gap_max_ms": 1000 * max(self.gaps),
            "ttft_p50_ms": 1000 * self.ttft(0.5), "ttft_p99_ms": 1000 * self.ttft(0.99),
            "num_gaps": len(self.gaps), "steps": self.steps, "simulated_seconds": self.simulated_seconds,
        }


def percentile(values, q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``q`` of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def simulate(policy: str, scenario: Scenario = Scenario()) -> Result:
    """Run ``scenario`` under ``policy`` ("fifo" or "slai"); needs a ``MockClock`` (autojump) to be quick.

    Returns:
        The token gaps of the streams and the TTFTs of the long prompts.
    """
    rng = random.Random(scenario.seed)
    engine = EngineDouble(num_pages=1 + 4096, page_size=16, max_model_len=1 << 16)
    config = ServeConfig(
        scheduler=policy, max_prefill_tokens=scenario.max_prefill_tokens,
        tbt_deadline_ms=1000 * scenario.tbt_deadline, max_batch_size=64, max_waiting=256,
    )
    execute = simulated_executor(engine, base=scenario.step_base, per_token=scenario.step_per_token)
    token_times: list[list[float]] = [[] for _ in range(scenario.num_streams)]
    ttfts: list[float] = []
    start = trio.current_time()
    async with open_system(engine, config, execute=execute) as system:
        async with trio.open_nursery() as streams:
            for i in range(scenario.num_streams):
                prompt = (1,) * scenario.stream_prompt_tokens
                params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
                streams.start_soon(_read_stream, system, GenerateRequest(f"stream-{i}", prompt, params), token_times[i])
            await trio.sleep(scenario.warmup)
            window_start = trio.current_time()
            async with trio.open_nursery() as longs:
                for k in range(scenario.num_long_prompts):
                    prompt = (1,) * rng.randint(*scenario.long_prompt_tokens)
                    params = SamplingParams(temperature=0.0, max_tokens=scenario.long_max_tokens, ignore_eos=True)
                    longs.start_soon(_time_first_token, system, GenerateRequest(f"long-{k}", prompt, params), ttfts)
                    await trio.sleep(scenario.long_interval * rng.uniform(0.8, 1.2))
            window_end = trio.current_time()  # every long prompt is done
            streams.cancel_scope.cancel()
    gaps = tuple(
        b - a for times in token_times for a, b in zip(times, times[1:]) if window_start < b <= window_end
    )
    return Result(policy, gaps, tuple(ttfts), engine.steps, trio.current_time() - start)


def run(policy: str, scenario: Scenario = Scenario()) -> Result:
    """``simulate`` under a fresh autojumping mock clock (a fraction of a second of real time)."""
    return trio.run(simulate, policy, scenario, clock=trio.testing.MockClock(autojump_threshold=0))


async def _read_stream(system, request: GenerateRequest, times: list[float]) -> None:
    async with system.submit(request) as stream:
        async for _ in stream:
            times.append(trio.current_time())


async def _time_first_token(system, request: GenerateRequest, ttfts: list[float]) -> None:
    submitted = trio.current_time()
    async with system.submit(request) as stream:
        async for piece in stream:
            if piece.num_output_tokens == 1:
                ttfts.append(trio.current_time() - submitted)


def main(argv: list[str] | None = None) -> dict:
    defaults = Scenario()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long-prompts", type=int, default=defaults.num_long_prompts)
    parser.add_argument("--interval", type=float, default=defaults.long_interval, help="mean seconds between long prompts")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    scenario = Scenario(num_long_prompts=args.long_prompts, long_interval=args.interval, seed=args.seed)
    results = {policy: run(policy, scenario) for policy in ("fifo", "slai")}
    print(f"step = {1000 * scenario.step_base:g} ms + {1000 * scenario.step_per_token:g} ms/token, "
          f"TBT deadline {1000 * scenario.tbt_deadline:g} ms, {scenario.num_streams} streams, "
          f"{scenario.num_long_prompts} prompts of {scenario.long_prompt_tokens[0]}-{scenario.long_prompt_tokens[1]} "
          f"tokens every ~{1000 * scenario.long_interval:g} ms")
    header = f"{'policy':<7}{'gap p50':>10}{'gap p99':>10}{'gap max':>10}{'TTFT p50':>11}{'TTFT p99':>11}{'steps':>8}"
    print(header)
    print("-" * len(header))
    for policy, result in results.items():
        s = result.summary()
        print(f"{policy:<7}{s['gap_p50_ms']:>8.1f}ms{s['gap_p99_ms']:>8.1f}ms{s['gap_max_ms']:>8.1f}ms"
              f"{s['ttft_p50_ms']:>9.0f}ms{s['ttft_p99_ms']:>9.0f}ms{s['steps']:>8}")
    report = {"scenario": attrs.asdict(scenario), "results": {p: r.summary() for p, r in results.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
