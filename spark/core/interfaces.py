"""What the core asks of an engine, and what the layers above hold of a loaded one.

Two protocols, because two kinds of object are loaded: an ``Engine`` in this process
(it steps: the core drives it directly) and an ``EngineProcess`` (its core runs in the
child; here only its facts and ``close``). Both are ``LoadedEngine``; only the first is a
``StepEngine``.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Protocol, Sequence

from spark.core.grammar import PackedMask
from spark.core.page_allocator import PageAllocator
from spark.core.plan import StepPlan, TokenOutput


class Tokenizer(Protocol):
    """The tokenizer surface the layers above the engine use (``spark.engine.tokenizer.Tokenizer``)."""

    bos_token_id: int | None
    eos_token_ids: Sequence[int]

    def encode(self, text: str, *args, **kwargs) -> list[int]: ...

    def decode(self, ids: Sequence[int], *args, **kwargs) -> str: ...


class LoadedEngine(Protocol):
    """A loaded model, wherever it steps: the facts admission needs, and ``close``."""

    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int
    num_pages: int  # KV pages in the pool, the scratch page included
    page_size: int  # tokens per page

    def close(self) -> None:
        """Free the model's memory (a profile switch, or shutdown); unusable after."""


def register(engine: "StepEngine", plan: StepPlan) -> None:
    """What a plan asks before its chunks: forget its ended sequences, reset its preempted ones,
    register its new ones, start those with a cached prefix past it (every ``StepEngine.launch``
    starts here)."""
    for seq_id in plan.removed:
        engine.remove_sequence(seq_id)
    for seq_id in plan.reset:
        engine.reset_computed(seq_id)
    for new in plan.added:
        engine.add_sequence(new.seq_id, new.prompt_ids, new.params)
    for seq_id, num_tokens in plan.cached:
        engine.reset_computed(seq_id, num_tokens)


class StepEngine(LoadedEngine, Protocol):
    """An engine the core drives: sequences in, one planned step at a time, tokens out.

    ``launch`` queues a step and returns; ``collect`` waits for the oldest launched
    step. Keeping two launched lets the host prepare step N+1 while the device runs N.
    """

    def new_page_allocator(self) -> PageAllocator:
        """An allocator over this engine's KV pages (the core that plans for it owns it)."""

    def add_sequence(self, seq_id: Hashable, prompt_ids: Sequence[int], params) -> None: ...

    def remove_sequence(self, seq_id: Hashable) -> None: ...

    def reset_computed(self, seq_id: Hashable, to: int = 0) -> None:
        """Compute ``seq_id`` from token ``to`` on: 0 after a preemption, a cached prefix's length."""

    def launch(self, plan: StepPlan) -> None: ...

    def collect(self) -> list[TokenOutput]: ...

    def sample_late(self, masks: Mapping[Hashable, PackedMask]) -> None:
        """Sample the newest launched step, whose ``mask_later`` chunks get their masks here (a row
        without one samples unconstrained). Nothing is launched or collected before it."""

    def enable_cuda_graphs(self, max_batch_size: int, verify_rows: int = 0, max_step_tokens: int | None = None) -> bool:
        """Plan decode graphs up to ``max_batch_size``, verify graphs up to ``verify_rows`` rows when the
        server speculates (0: none), and graphs for steps up to ``max_step_tokens`` tokens (prompt chunks
        beside decodes); False where there are none (no GPU)."""

    def capture_next_graph(self) -> bool:
        """Capture one more planned graph; False when none is left."""

    def graph_progress(self) -> tuple[int, int]:
        """(graphs captured, graphs planned)."""
