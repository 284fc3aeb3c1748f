"""The torch ops of one batch-1 decode step on the CPU, per layer and outside the layers, and its time.

    python benchmarks/cpu_step_ops.py [--context 64] [--steps 200] [--repeats 5] [--top 12] [--fragmented] [--ab]

The default model (SmolLM2-135M, the CPU's default weight format), one greedy sequence
decoding after a prompt of ``--context`` tokens. Ops are counted with a ``TorchDispatchMode``
(every aten op that reaches the dispatcher below autograd, views included) over one step;
those between layer 0's first and layer 29's last op are split per layer by module hooks.
Time: ``torch.profiler``'s self CPU time per op over a few steps (its share, top ``--top``),
and, without any profiler, the median ms per ``engine.step`` of ``--repeats`` runs of
``--steps`` decode steps after a warm-up.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spark.core.plan import Chunk, StepPlan
from spark.engine.engine import Engine
from spark.engine.sampling import SamplingParams


class Counter(TorchDispatchMode):
    """Counts aten ops, by name, into ``self.where`` (a key the caller moves between regions)."""

    def __init__(self):
        super().__init__()
        self.where = "outside"
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.where][str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class Decoder:
    """One greedy sequence on ``engine``, a decode step per ``step()``. ``fragmented``: its pages are
    every other one (another holder takes a page beside each of its own), as a server's prefix cache
    leaves them; else they lie in a row, as a fresh allocator gives them out."""

    def __init__(self, engine: Engine, context: int, sid="s", fragmented: bool = False):
        self.engine, self.sid, self.fragmented = engine, sid, fragmented
        self.alloc = engine.new_page_allocator()
        prompt = [(7 * i) % 1000 + 100 for i in range(context)]
        engine.add_sequence(sid, prompt, SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True))
        if fragmented:
            self.alloc.allocate("other", 1)
            table = self.alloc.allocate(sid, 1)
            for n in range(engine.page_size + 1, context + 1, engine.page_size):
                self._interleave(n)
        engine.step(StepPlan((Chunk(sid, context, self._table(context)),)))
        self.tokens: list[int] = []

    def _interleave(self, n: int) -> None:
        other = len(self.alloc._tables["other"])
        self.alloc.append("other", (other + 1) * self.engine.page_size)
        self.alloc.append(self.sid, n)

    def _table(self, n: int):
        if self.fragmented and self.alloc.pages_missing(self.sid, n):
            self._interleave(n)
        return self.alloc.append(self.sid, n) if self.alloc.has(self.sid) else self.alloc.allocate(self.sid, n)

    def step(self) -> None:
        e = self.engine
        out = e.step(StepPlan((Chunk(self.sid, 1, self._table(e.num_tokens(self.sid))),)))
        self.tokens.append(out[0].token_id)


def count_ops(engine: Engine, dec: Decoder) -> tuple[dict, collections.Counter, collections.Counter]:
    counter = Counter()
    model = engine.model
    layers = model.layers
    index = {id(layer): i for i, layer in enumerate(layers)}
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "where", f"layer{i}")))
        hooks.append(layer.register_forward_hook(lambda m, a, o: setattr(counter, "where", "outside")))
    one_row = model.ops.block_one_row if model.one_row else None

    def block_one_row(layer, *args):  # the one-row path calls no block's forward: mark its layers here
        counter.where = f"layer{index[id(layer)]}"
        out = one_row(layer, *args)
        counter.where = "outside"
        return out

    if one_row is not None:
        model.ops.block_one_row = block_one_row
    try:
        with counter:
            dec.step()
    finally:
        for h in hooks:
            h.remove()
        if one_row is not None:
            del model.ops.block_one_row
    per_layer = [counter.counts[f"layer{i}"] for i in range(len(layers))]
    return per_layer[0], per_layer[1], counter.counts["outside"]


def profile_share(dec: Decoder, steps: int, top: int) -> list[tuple[str, float, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            dec.step()
    rows = [(e.key, e.self_cpu_time_total / steps, e.count / steps) for e in prof.key_averages()
            if e.key.startswith("aten::")]
    total = sum(r[1] for r in rows)
    rows.sort(key=lambda r: -r[1])
    return [(k, us, n, us / total) for k, us, n in rows[:top]], total


def time_steps(dec: Decoder, steps: int, repeats: int) -> float:
    meds = []
    for _ in range(repeats):
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            dec.step()
            times.append(time.perf_counter() - t0)
        meds.append(statistics.median(times))
    return 1000 * statistics.median(meds)


def ab(engine: Engine, dec: Decoder, steps: int, repeats: int) -> None:
    """Interleaved in this process: the generic path (every block through ``Block.forward``, the kernels
    through ``torch.ops.aten``) against the default. The generic path shares the decode attention, so it is
    not the code before the one-row block: for that, run this file at both commits, back to back."""
    from spark.engine.models import quantized

    model, fast = engine.model, (quantized._int4_mm, quantized._int8_mm)
    slow = (torch.ops.aten._weight_int4pack_mm_for_cpu, torch.ops.aten._weight_int8pack_mm)
    times: dict[str, list[float]] = {"generic": [], "one-row": []}
    for _ in range(repeats):
        for name, one_row, kernels in (("generic", False, slow), ("one-row", True, fast)):
            model.one_row, (quantized._int4_mm, quantized._int8_mm) = one_row, kernels
            times[name].append(time_steps(dec, steps, 1))
    model.one_row, (quantized._int4_mm, quantized._int8_mm) = True, fast
    for name, ms in times.items():
        print(f"A/B {name:>8}: {statistics.median(ms):.3f} ms per step (median of {repeats} blocks of {steps}; "
              f"{', '.join(f'{m:.2f}' for m in ms)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--fragmented", action="store_true", help="the sequence's pages every other one (not in a row)")
    ap.add_argument("--ab", action="store_true", help="then the generic path against the default, interleaved")
    args = ap.parse_args()

    engine = Engine.load("default", device="cpu", kv_cache_tokens=8192, progress=False)
    dec = Decoder(engine, args.context, fragmented=args.fragmented)
    print(f"pages: {dec.alloc._tables[dec.sid][:8]} ...")
    for _ in range(20):
        dec.step()
    layer0, layer1, outside = count_ops(engine, dec)
    layers = len(engine.model.layers)
    # Layer 0 also builds what every layer of the step reuses (the context's slots): counted apart.
    print(f"ops in layer 0: {sum(layer0.values())}  {dict(layer0.most_common())}")
    print(f"ops per later layer: {sum(layer1.values())}  {dict(layer1.most_common())}")
    print(f"ops outside the layers: {sum(outside.values())}  {dict(outside.most_common())}")
    print(f"ops per step: {sum(layer0.values()) + (layers - 1) * sum(layer1.values()) + sum(outside.values())}")
    rows, total = profile_share(dec, 20, args.top)
    print(f"profiled aten self time per step: {total / 1000:.2f} ms")
    for key, us, n, share in rows:
        print(f"  {key:<45} {n:6.0f}/step {us:8.1f} us {100 * share:5.1f}%")
    ms = time_steps(dec, args.steps, args.repeats)
    print(f"ms per step: {ms:.3f} (median of {args.repeats} x {args.steps} steps, context {args.context}+), "
          f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    print(f"first tokens: {dec.tokens[:12]}")
    if args.ab:
        ab(engine, dec, args.steps, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
