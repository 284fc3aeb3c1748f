"""An engine double: the engine's verbs, deterministic tokens, no model.

``EngineDouble`` keeps each sequence's tokens and computed count exactly like
``spark.engine.Engine`` and validates every plan the same way (and more
strictly: it also checks the KV pages themselves), so a scheduler bug shows up
as an exception here instead of as wrong text there. Its tokens depend only on
(sequence id, position), never on the batch, so a sequence recomputed after a
preemption or run in any company produces the same tokens.

``SimulatedEngine`` is the double on a ``FakeClock``: collecting a step advances the
clock by ``base + per_token * tokens``, so a ``Core`` driven over it sees step times
that grow with the tokens in the step, in no real time.
"""

from __future__ import annotations

import zlib
from typing import Callable, Hashable, Sequence

from collections import deque

import attrs

from spark.core.plan import StepPlan, TokenOutput
from spark.core.interfaces import register
from spark.core.page_allocator import PageAllocator
from spark.engine.sampling import SamplingParams


class CharTokenizer:
    """A tokenizer whose token id is a character's code point (0 is a special token)."""

    bos_token_id = 0
    eos_token_ids = ()
    special_ids = frozenset({0})

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i in self.special_ids))

    def token_text(self, token_id: int) -> str:
        return chr(token_id)


class PlanError(ValueError):
    """The plan asks what the real engine would refuse, or would corrupt the KV cache."""


def hashed_token(seq_id: Hashable, position: int, vocab_size: int) -> int:
    """A token that depends only on (sequence, position): stable across processes and batches."""
    return zlib.crc32(f"{seq_id}@{position}".encode()) % vocab_size


@attrs.define(eq=False)
class _Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = attrs.Factory(list)
    num_computed: int = 0
    table: tuple[int, ...] | None = ()  # the block table its computed tokens live in; None: a cached prefix's

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class EngineDouble:
    """The verbs of ``spark.engine.Engine`` over a fake model.

    Args:
        num_pages: pages of the KV pool (page 0 is the allocator's scratch page).
        page_size: tokens per page.
        max_model_len: context length.
        vocab_size: token ids are in ``[0, vocab_size)``.
        tokenizer: None, or a tokenizer for the streamer to detokenize with.
        eos_token_ids: tokens that end a sequence unless ``ignore_eos``.
        token_fn: ``(seq_id, position) -> token``; ``hashed_token`` by default.
        scripts: ``{seq_id: outputs}`` replayed instead for those sequences (then length).
    """

    def __init__(
        self,
        *,
        num_pages: int = 1024,
        page_size: int = 16,
        max_model_len: int = 4096,
        vocab_size: int = 49152,
        tokenizer=None,
        eos_token_ids: Sequence[int] = (),
        token_fn: Callable[[Hashable, int], int] | None = None,
        scripts: dict[Hashable, Sequence[int]] | None = None,
    ):
        self.num_pages, self.page_size = num_pages, page_size
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.token_fn = token_fn or (lambda seq_id, pos: hashed_token(seq_id, pos, vocab_size))
        self.scripts = dict(scripts or {})
        self.fail_if: Callable[[StepPlan], bool] | None = None  # failure injection: True makes step() raise
        self.steps = 0  # steps computed (not counting failed ones)
        self.step_tokens: list[int] = []  # tokens computed per step
        self.sequences: dict[Hashable, _Sequence] = {}
        self.ended: set[Hashable] = set()  # finished or removed: a pipelined plan may still name them
        self._page_owner: dict[int, Hashable] = {}  # page -> the sequence that last wrote it
        self._page_tokens: dict[int, tuple[int, ...]] = {}  # page -> the tokens whose K/V it holds
        self.prefix_hits = 0  # tokens whose computing a cached prefix saved
        self._launched: deque[list[TokenOutput]] = deque()

    def new_page_allocator(self) -> PageAllocator:
        return PageAllocator(self.num_pages, self.page_size)

    # -- sequences (the real engine's checks) -----------------------------
    def add_sequence(self, seq_id: Hashable, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id!r} already exists")
        if not prompt_ids:
            raise ValueError("prompt must hold at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_model_len}")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary (size {self.vocab_size})")
        self.sequences[seq_id] = _Sequence(list(prompt_ids), params)

    def remove_sequence(self, seq_id: Hashable) -> None:
        if self.sequences.pop(seq_id, None) is not None:
            self.ended.add(seq_id)

    def reset_computed(self, seq_id: Hashable, to: int = 0) -> None:
        if seq_id in self.ended:
            return  # it ended at the step before this one was planned
        s = self.sequences[seq_id]
        s.num_computed, s.table = to, (() if to == 0 else None)  # None: the next chunk's table holds them
        self.prefix_hits += to

    def num_uncomputed(self, seq_id: Hashable) -> int:
        s = self.sequences[seq_id]
        return s.num_tokens - s.num_computed

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.sequences[seq_id].num_tokens

    def close(self) -> None:
        self.sequences.clear()

    # -- CUDA graphs: a double has none -------------------------------------
    def enable_cuda_graphs(self, max_batch_size: int, verify_rows: int = 0, max_step_tokens: int | None = None) -> bool:
        return False

    def capture_next_graph(self) -> bool:
        return False

    def graph_progress(self) -> tuple[int, int]:
        return (0, 0)

    # -- the step ---------------------------------------------------------
    def launch(self, plan: StepPlan) -> None:
        """The step runs at launch (``step``); ``collect`` hands its tokens back, oldest first."""
        self._launched.append(self.step(plan))

    def collect(self) -> list[TokenOutput]:
        return self._launched.popleft()

    def sample_late(self, masks) -> None:
        """A double samples without masks (its tokens are scripted): nothing waits for them."""

    def step(self, plan: StepPlan) -> list[TokenOutput]:
        """Register the plan's sequences, validate its chunks like the real engine, "compute"
        them, sample for sequences that caught up.

        Like the real engine, chunks of sequences that ended are dropped (a pipelined
        scheduler plans the next step before it learns of an end).
        """
        register(self, plan)
        plan = StepPlan(tuple(c for c in plan.chunks if c.seq_id in self.sequences or c.seq_id not in self.ended))
        if not plan.chunks:
            return []
        if self.fail_if is not None and self.fail_if(plan):
            raise RuntimeError("injected step failure")
        seen = set()
        for chunk in plan.chunks:  # validate all before changing anything, as the real engine does
            if chunk.seq_id in seen:
                raise PlanError(f"{chunk.seq_id!r} appears twice in one plan")
            seen.add(chunk.seq_id)
            self._check_chunk(chunk)
        outputs = []
        for chunk in plan.chunks:
            s = self.sequences[chunk.seq_id]
            start, end = s.num_computed, s.num_computed + chunk.num_tokens
            tokens = s.tokens
            for i in range(start // self.page_size, self.pages_for(end)):
                page = chunk.block_table[i]
                self._page_owner[page] = chunk.seq_id
                self._page_tokens[page] = tuple(tokens[i * self.page_size: min((i + 1) * self.page_size, end)])
            s.num_computed, s.table = end, chunk.block_table
            if end == s.num_tokens:
                outputs.append(self._sample(chunk.seq_id, s))
        self.steps += 1
        self.step_tokens.append(sum(c.num_tokens for c in plan.chunks))
        return outputs

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _check_chunk(self, chunk) -> None:
        if chunk.seq_id not in self.sequences:
            raise KeyError(chunk.seq_id)
        s = self.sequences[chunk.seq_id]
        start, end = s.num_computed, s.num_computed + chunk.num_tokens
        if chunk.num_tokens < 1 or end > s.num_tokens:
            raise PlanError(f"plan asks {chunk.num_tokens} tokens of {chunk.seq_id!r}, {s.num_tokens - start} left")
        table = chunk.block_table
        if len(table) * self.page_size < end:
            raise PlanError(f"block table of {chunk.seq_id!r} holds {len(table)} pages, needs {end} tokens")
        if 0 in table:
            raise PlanError(f"block table of {chunk.seq_id!r} names the scratch page 0")
        if len(set(table)) != len(table):
            raise PlanError(f"block table of {chunk.seq_id!r} repeats a page: {table}")
        kept = self.pages_for(start)
        if s.table is None:  # its first `start` tokens are a cached prefix: those pages must hold exactly them
            tokens = s.tokens
            for i in range(start // self.page_size):
                want = tuple(tokens[i * self.page_size:(i + 1) * self.page_size])
                if self._page_tokens.get(table[i]) != want:
                    raise PlanError(f"{chunk.seq_id!r} maps page {table[i]} as its cached tokens "
                                    f"{i * self.page_size}.., but it holds others")
        elif table[:kept] != s.table[:kept]:
            raise PlanError(f"{chunk.seq_id!r} moved pages holding computed tokens: {s.table[:kept]} -> {table[:kept]}")
        for page in table[start // self.page_size: self.pages_for(end)]:
            owner = self._page_owner.get(page, chunk.seq_id)
            if owner != chunk.seq_id and self._holds(owner, page):
                raise PlanError(f"{chunk.seq_id!r} writes page {page}, which holds tokens of {owner!r}")

    def _holds(self, seq_id: Hashable, page: int) -> bool:
        s = self.sequences.get(seq_id)
        return s is not None and s.table is not None and page in s.table[: self.pages_for(s.num_computed)]

    def _sample(self, seq_id: Hashable, s: _Sequence) -> TokenOutput:
        script = self.scripts.get(seq_id)
        if script is not None:
            token = script[len(s.output_ids)]
        else:
            token = self.token_fn(seq_id, s.num_tokens)
        s.output_ids.append(token)
        reason = None
        if token in s.params.stop_token_ids or (token in self.eos_token_ids and not s.params.ignore_eos):
            reason = "stop"
        elif len(s.output_ids) >= s.params.max_tokens or s.num_tokens >= self.max_model_len:
            reason = "length"
        elif script is not None and len(s.output_ids) == len(script):
            reason = "length"  # the script ran out
        if reason is not None:
            del self.sequences[seq_id]  # the real engine forgets finished sequences
            self.ended.add(seq_id)
        k = s.params.logprobs
        return TokenOutput(
            seq_id, token,
            logprob=-1.0 if k is not None else None,
            top_logprobs=((token, -1.0),)[:k] if k else (),
            finish_reason=reason,
        )


class FakeClock:
    """Seconds that pass only when told to."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SimulatedEngine(EngineDouble):
    """The double whose steps take ``base + per_token * tokens`` seconds of ``clock`` (at collect), or
    what ``cost(tokens)`` says when given (a step time no line follows)."""

    def __init__(self, clock: FakeClock, *, base: float = 0.005, per_token: float = 0.00025, cost=None, **kwargs):
        super().__init__(**kwargs)
        self.clock, self.base, self.per_token = clock, base, per_token
        self.cost = cost or (lambda tokens: self.base + self.per_token * tokens)
        self._costs: deque[float] = deque()

    def launch(self, plan: StepPlan) -> None:
        super().launch(plan)
        self._costs.append(self.cost(sum(c.num_tokens for c in plan.chunks)))

    def collect(self) -> list[TokenOutput]:
        self.clock.advance(self._costs.popleft())
        return super().collect()
