"""SLAI vs FIFO scheduling, simulated: the real core over an engine double on a fake clock.

A step takes ``5 ms + 0.25 ms * tokens`` of simulated time. Eight streams
decode long outputs while long prompts (1500-2000 tokens) keep arriving about
every 300 ms. FIFO gives each step up to ``max_prefill_tokens`` (2048) prompt
tokens, so a running stream waits for a whole long prefill between two tokens;
SLAI cuts prefills to what fits before the tightest time-between-tokens
deadline (100 ms). We measure the gaps between consecutive tokens of the eight
streams (as the core collects them) and the time to first token of the long
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

from spark.actors.host import new_core
from spark.core.events import TokenBatch
from spark.engine.sampling import SamplingParams
from spark.serve_config import ServeConfig
from tests.actors.engine_double import FakeClock, SimulatedEngine

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
    # A step time no line follows, as on a GPU: its tokens padded up to a power of two (graph buckets),
    # times a random factor (log-normal, this sigma). 0 / 0.0: the plain line above.
    pad_to_power_of_two: bool = False
    noise_sigma: float = 0.0

    def step_cost(self):
        """The simulated engine's step time as a function of the step's tokens."""
        rng = random.Random(self.seed + 1)

        def cost(tokens: int) -> float:
            if self.pad_to_power_of_two and tokens > 1:
                tokens = 1 << (tokens - 1).bit_length()
            seconds = self.step_base + self.step_per_token * tokens
            return seconds * (rng.lognormvariate(0.0, self.noise_sigma) if self.noise_sigma else 1.0)

        return cost


# The rough step time: what SLAI's fit under-predicts unless it keeps its recent overruns back.
ROUGH = dict(pad_to_power_of_two=True, noise_sigma=0.1)


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


def run(policy: str, scenario: Scenario = Scenario(), step_trace: str | None = None) -> Result:
    """Run ``scenario`` under ``policy`` ("fifo" or "slai"), in a fraction of a second of real time;
    ``step_trace``: a file for the core's step log (``ServeConfig.step_trace``).

    Returns:
        The token gaps of the streams and the TTFTs of the long prompts.
    """
    clock = FakeClock()
    engine = SimulatedEngine(clock, cost=scenario.step_cost(), num_pages=1 + 4096, page_size=16,
                             max_model_len=1 << 16)
    config = ServeConfig(
        scheduler=policy, max_prefill_tokens=scenario.max_prefill_tokens,
        tbt_deadline_ms=1000 * scenario.tbt_deadline, max_batch_size=64, max_waiting=256,
        prefix_caching=False,  # its prompts are one token repeated: a cache would compute them once
        step_trace=step_trace,
    )
    core = new_core(engine, config, clock=clock)
    streams = [f"stream-{i}" for i in range(scenario.num_streams)]
    for stream in streams:
        core.submit(stream, (1,) * scenario.stream_prompt_tokens,
                    SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True), clock())
    arrivals = _arrivals(scenario)
    submitted = {request_id: at for at, request_id, _ in arrivals}
    token_times: dict[str, list[float]] = {s: [] for s in streams}
    first_token: dict[str, float] = {}
    params = SamplingParams(temperature=0.0, max_tokens=scenario.long_max_tokens, ignore_eos=True)
    done = set()
    while len(done) < scenario.num_long_prompts:
        while arrivals and arrivals[0][0] <= clock():
            at, request_id, n = arrivals.pop(0)
            core.submit(request_id, (1,) * n, params, at)
        for event in core.step():
            if isinstance(event, TokenBatch):
                for out in event.outputs:
                    if out.seq_id in token_times:
                        token_times[out.seq_id].append(event.time)
                    else:
                        first_token.setdefault(out.seq_id, event.time)
                        if out.finish_reason is not None:
                            done.add(out.seq_id)
    if core.step_log is not None:
        core.step_log.close()
    window_start, window_end = scenario.warmup, clock()  # every long prompt is done
    gaps = tuple(
        b - a for times in token_times.values() for a, b in zip(times, times[1:]) if window_start < b <= window_end
    )
    ttfts = tuple(first_token[r] - submitted[r] for r in sorted(first_token))
    return Result(policy, gaps, ttfts, engine.steps, clock())


def _arrivals(scenario: Scenario) -> list[tuple[float, str, int]]:
    """(time, id, prompt tokens) of each long prompt, in arrival order."""
    rng = random.Random(scenario.seed)
    out, t = [], scenario.warmup
    for k in range(scenario.num_long_prompts):
        out.append((t, f"long-{k}", rng.randint(*scenario.long_prompt_tokens)))
        t += scenario.long_interval * rng.uniform(0.8, 1.2)
    return out


def main(argv: list[str] | None = None) -> dict:
    defaults = Scenario()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long-prompts", type=int, default=defaults.num_long_prompts)
    parser.add_argument("--interval", type=float, default=defaults.long_interval, help="mean seconds between long prompts")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rough", action="store_true",
                        help="step times padded to powers of two and noisy (10%%), which a line cannot follow")
    args = parser.parse_args(argv)
    scenario = Scenario(num_long_prompts=args.long_prompts, long_interval=args.interval, seed=args.seed,
                        **(ROUGH if args.rough else {}))
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
