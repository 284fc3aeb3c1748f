"""Ready means warm: before a GPU engine serves, it runs once every step shape that serving will bring.

Triton compiles a kernel the first time it meets a new specialization (a block size picked from the
rows of the step, a split count picked from the context's length, an int argument that is 1 or a
multiple of 16), cuBLAS picks its algorithms per shape, and the CUDA modules load lazily. On a fresh
machine a server that opened at once paid all of that inside its first minutes of traffic
(``benchmarks/serving.py``: 0.87-0.88 of the offline engine cold against 0.93 warm). So ``warm_up``
drives the engine through a grid of synthetic steps on its own sequences and page allocator, and only
then does the server say ready:

- prefill chunks of every size class up to the step budget (powers of two, one less and one more:
  Triton specializes on divisibility by 16), alone and beside decode rows;
- a long context (up to 16k tokens) prefilled in chunks, then decoded beside short ones and beside a
  prompt chunk: the chunked-prefill attention over a cache, and every split-KV partition count the
  decode kernel picks, with RoPE in the kernel and without (a step with prompt tokens);
- decode steps of every batch size from the largest the server allows down to 1, greedy and sampled,
  and a prompt chunk beside the largest.

Triton keeps what it compiled on disk (``TRITON_CACHE_DIR``, else ``~/.triton/cache``), so a restart on
the same machine loads the kernels instead of compiling them: ``python benchmarks/startup.py``
reports both. On the CPU there is nothing to compile and ``warm_up`` returns at once.
"""

from __future__ import annotations

import logging
import time
from typing import Hashable

import attrs

from spark.core.plan import Chunk, StepPlan
from spark.engine.progress import LoadProgress
from spark.engine.sampling import SamplingParams

log = logging.getLogger("spark.engine")

LONG_CONTEXT = 16384  # the longest context warmed (split counts stop growing well before)
SHORT_PROMPT = 16
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)
_SAMPLED = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_tokens=1 << 30, ignore_eos=True, seed=0)


@attrs.frozen
class WarmupShape:
    """The limits of the steps a server will plan: its batch and its prefill budget."""

    max_batch: int
    max_prefill_tokens: int


def prefill_sizes(limit: int) -> list[int]:
    """Chunk sizes 1..``limit`` that meet each size class: powers of two, one less and one more."""
    sizes = {1, 2, 3, limit}
    p = 4
    while p <= limit:
        sizes.update((p - 1, p, p + 1))
        p *= 2
    return sorted(s for s in sizes if 1 <= s <= limit)


def decode_batches(max_batch: int) -> list[int]:
    """Every batch size, largest first (each has its own small-row configuration or graph bucket)."""
    return list(range(max_batch, 0, -1))


class _Driver:
    """Synthetic sequences on the engine, with pages from an allocator of their own."""

    def __init__(self, engine, progress: LoadProgress):
        self.engine, self.progress = engine, progress
        self.pages = engine.new_page_allocator()
        self._next = 0

    def add(self, length: int, params: SamplingParams = _GREEDY) -> Hashable:
        seq_id = ("warm-up", self._next)
        self._next += 1
        vocab = self.engine.vocab_size
        self.engine.add_sequence(seq_id, [(7 + 31 * i + self._next) % vocab for i in range(length)], params)
        return seq_id

    def step(self, sizes: dict[Hashable, int]) -> None:
        chunks = []
        for seq_id, n in sizes.items():
            done = self.engine.num_computed(seq_id) + n
            table = self.pages.append(seq_id, done) if self.pages.has(seq_id) else self.pages.allocate(seq_id, done)
            chunks.append(Chunk(seq_id, n, table))
        self.engine.step(StepPlan(tuple(chunks)))
        self.progress.advance(1)

    def prefill(self, seq_id: Hashable, length: int, budget: int) -> None:
        """Compute a prompt of ``length`` tokens, ``budget`` tokens a step (its last step samples)."""
        for done in range(0, length, budget):
            self.step({seq_id: min(budget, length - done)})

    def prefill_all(self, seq_ids) -> None:
        """Compute short prompts whole, in one step."""
        self.step({s: self.engine.num_uncomputed(s) for s in seq_ids})

    def drop(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.engine.remove_sequence(seq_id)
            self.pages.free(seq_id)


def _tokens_for_pages(engine, reserve: int) -> int:
    return max(0, (engine.num_pages - 1 - reserve) * engine.page_size)


def warm_up(engine, shape: WarmupShape, *, progress: bool = True, any_device: bool = False) -> float:
    """Run every step shape ``shape`` allows once on ``engine`` (a GPU one; on the CPU, nothing,
    unless ``any_device``: a test of the grid itself).

    Returns:
        Seconds spent.
    """
    if engine.device.type != "cuda" and not any_device:
        return 0.0
    t0 = time.perf_counter()
    budget = max(1, shape.max_prefill_tokens)
    max_batch = max(1, min(shape.max_batch, _tokens_for_pages(engine, 2) // (SHORT_PROMPT + shape.max_batch + 2)))
    sizes = prefill_sizes(min(budget, engine.max_model_len - 64))
    long_len = min(LONG_CONTEXT, engine.max_model_len - 64, _tokens_for_pages(engine, max_batch + 8) // 2)
    per_step = max(1, budget // SHORT_PROMPT)  # short prompts prefilled in one step
    total = (1 + 4 * len(sizes) + (-(-long_len // budget) + 6 if long_len > budget else 0)
             + 2 * (-(-max_batch // per_step) + 1 + max_batch))
    with LoadProgress(total, "warm-up (kernels for every step shape)", enabled=progress, unit="steps") as bar:
        d = _Driver(engine, bar)
        rows = [d.add(SHORT_PROMPT, _GREEDY if i % 2 else _SAMPLED) for i in range(min(4, max_batch))]
        d.prefill_all(rows)
        decoding = {r: 1 for r in rows}
        # Each chunk size: a whole prompt alone, one beside decode rows, one over a cached context.
        for size in sizes:
            alone, mixed, over = d.add(size), d.add(size), d.add(32 + size)
            d.step({alone: size})
            d.step({mixed: size, **decoding})
            d.step({over: 32})
            d.step({over: size, **decoding})
            d.drop([alone, mixed, over])
        # A long context in chunks (attention over a cache), then decoded beside short rows: the split counts.
        if long_len > budget:
            long = d.add(long_len)
            d.prefill(long, long_len, budget)
            for b in (1, 2, 3, 4):
                d.step({long: 1, **{r: 1 for r in rows[: b - 1]}})
            # Beside a prompt chunk, decode attention takes the rows' RoPE from the step (its variant
            # without RoPE), split over the long context too.
            for b in (1, 4):
                chunk = d.add(SHORT_PROMPT)
                d.step({chunk: SHORT_PROMPT, long: 1, **{r: 1 for r in rows[: b - 1]}})
                d.drop([chunk])
            d.drop([long])
        d.drop(rows)
        # Every decode batch size, greedy and sampled, largest first.
        for params in (_GREEDY, _SAMPLED):
            batch = [d.add(SHORT_PROMPT, params) for _ in range(max_batch)]
            for i in range(0, max_batch, per_step):
                d.prefill_all(batch[i:i + per_step])
            # A prompt chunk beside the whole batch: decode attention without RoPE and without a
            # split (the rows alone fill the GPU), which a few rows beside a chunk never pick.
            chunk = d.add(SHORT_PROMPT)
            d.step({**{s: 1 for s in batch}, chunk: SHORT_PROMPT})
            d.drop([chunk])
            for b in decode_batches(max_batch):
                d.step({s: 1 for s in batch[:b]})
            d.drop(batch)
    seconds = time.perf_counter() - t0
    log.info("warm-up: %d steps in %.1fs", bar.done, seconds)
    return seconds


def load_warm(model: str | None, shape: WarmupShape | None, *, world_size: int = 1, **load_kwargs):
    """``Engine.load(model, **load_kwargs)``, then ``warm_up`` for ``shape`` (None: not warmed).

    With ``world_size`` > 1 this process is rank 0 of a tensor-parallel group whose followers are
    started already (``spark.engine.ranks``): it returns their ``Leader``, warmed on every rank."""
    from spark.engine.engine import Engine

    if world_size > 1:
        from spark.engine.ranks import lead

        engine = lead(model, world_size=world_size, **load_kwargs)
    else:
        engine = Engine.load(model, **load_kwargs)
    if shape is not None:
        warm_up(engine, shape, progress=load_kwargs.get("progress", True))
    return engine
