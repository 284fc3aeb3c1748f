"""The synchronous engine: ``launch(plan)`` queues one flat batch of tokens, ``collect()`` reads it back.

The caller (the scheduler actor, or ``generate`` below) decides what runs: a
``StepPlan`` names, per sequence, how many of its tokens to compute now and the
pages that hold them. Prefill, chunked prefill and decode are one case: a
sequence whose computed tokens catch up with its known tokens samples its next
token. The engine keeps each sequence's tokens and sampling state
(``sequence.py``), never its pages: pages belong to whoever owns the
``PageAllocator``. ``step`` is ``launch`` then ``collect``; keeping two steps
launched lets the host prepare step N+1 while the device runs step N.

No trio here; the GPU-runner actor drives it from a thread or a process of its own.
"""

from __future__ import annotations

import logging
import os
import random
from collections import OrderedDict, deque
from typing import Hashable, Sequence as Seq

import attrs
import torch

from spark.engine.attention import AttentionMetadata, leading_single_rows
from spark.engine.config import ModelConfig
from spark.engine.kv_cache import KVCache, kv_storage_dtype, num_pages_for_budget
from spark.engine.models.runtime import Model
from spark.core.interfaces import register
from spark.core.page_allocator import PageAllocator
from spark.core.plan import Chunk, PromptLogprob, StepPlan, TokenOutput
from spark.engine.sampler import (Prepared, SampleOutput, Sampler, SamplingBatch, mask_bits, raw_logprobs,
                                  unpack_token_masks, verified)
from spark.engine.sampling import SamplingParams
from spark.engine.sequence import Sequence, think_tags
from spark.engine.device import IdleCoreThreads
from spark.engine.transfer import HostCopy, upload
from spark.engine import verify

log = logging.getLogger("spark.engine")

# The CPU's KV cache, in tokens, unless told (every page is committed only when first written: a
# large cache costs its sequences' memory, not its size).
CPU_KV_CACHE_TOKENS = 32768
# ... of which, in that default size, the prefix cache keeps at most this many tokens' pages written
# before it reuses its own: past it, a new page is a never-written one only when no cached page can
# be evicted (what live sequences need still comes), so that a server's resident memory stops growing
# with every distinct text it serves (SmolLM2-135M: 23 KB a token in bf16, 755 MB for the whole pool).
# The pool stays at the most pages live sequences held at once, or this, whichever is more: 512 tokens
# (12 MB for SmolLM2) keeps a chat's prefix, where 2048 (47 MB) grew a server serving 8 streams of 200
# tokens (their prompt's pages shared: 26 MB live) to ~44 MB of KV (issue 19: 4x the GGUF is 393 MB).
# A KV cache sized by the caller (kv_cache_tokens, kv_cache_bytes) may all be used.
CPU_KV_WARM_TOKENS = 512
_MAX_ENDED = 65536  # ended ids remembered, so that a plan made before the end is known skips them
GPU_MEMORY_FRACTION = 0.90  # of the memory free after loading, for the KV cache


@attrs.define(eq=False)
class _Launched:
    """A step queued on the device: who samples, and its samples until they are read back."""

    seq_ids: list[Hashable]  # one per sampled row, in plan order
    drafts: dict[int, tuple[int, ...]] = attrs.field(factory=dict)  # first row of a verify chunk -> its draft
    token_ids: torch.Tensor | None = None  # [N] on the device: the next step's inputs read it
    samples: HostCopy | None = None  # token ids, chosen logprobs, top ids, top logprobs
    outputs: list[TokenOutput] | None = None  # once completed
    unsampled: tuple | None = None  # (logits, graph argmax, sample rows, every row samples) until sampled
    late: set[Hashable] = attrs.field(factory=set)  # rows whose masks come with sample_late
    masks: dict = attrs.field(factory=dict)  # meanwhile, the masks its other rows came with
    prepared: Prepared | None = None  # meanwhile, the sampler's part that no logits decide
    scored: list[tuple[Hashable, int, int]] = attrs.field(factory=list)  # prompt_logprobs: (seq, first row, rows)
    scores: HostCopy | None = None  # their target logprobs, top ids, top logprobs


class Engine:
    """A model, its KV cache and its sampler, stepped one flat batch at a time."""

    def __init__(
        self,
        model: Model,
        *,
        tokenizer=None,
        page_size: int = 16,
        kv_cache_bytes: int | None = None,
        kv_cache_tokens: int | None = None,
        max_model_len: int | None = None,
        kv_dtype: str = "auto",
    ):
        self.model = model
        self.config: ModelConfig = model.config
        self.tp = model.tp  # this rank's place in a tensor-parallel group (rank 0 of 1 alone)
        self.tokenizer = tokenizer
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_dtype = kv_dtype  # "auto": K/V in the model's dtype; "fp8": e4m3 with scales (kv_cache.py)
        kv_storage = kv_storage_dtype(kv_dtype, self.dtype)
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        if kv_cache_bytes is not None and kv_cache_tokens is not None:
            raise ValueError("give the KV cache's size in bytes or in tokens, not both")
        self._warm_pages = None  # the allocator's warm_pages: None, the whole pool
        if kv_cache_tokens is None and kv_cache_bytes is None and self.device.type != "cuda":
            kv_cache_tokens = CPU_KV_CACHE_TOKENS
            self._warm_pages = -(-CPU_KV_WARM_TOKENS // page_size)  # a size given is a size meant: all of it
        if kv_cache_tokens is not None:
            if kv_cache_tokens < 1:
                raise ValueError(f"a KV cache of {kv_cache_tokens} tokens holds none")
            num_pages = 1 - (-kv_cache_tokens // page_size)  # and the allocator's scratch page
        else:
            budget = kv_cache_bytes if kv_cache_bytes is not None else self._default_kv_budget()
            num_pages = num_pages_for_budget(self.config.shard(self.tp.world_size), budget, page_size, kv_storage)
            if num_pages < 2:
                raise ValueError(f"KV cache budget of {budget} bytes holds fewer than 2 pages")
        # Rank 0 plans pages for every rank: each holds the same pages, of its own KV heads.
        num_pages = self.tp.agree_min(num_pages)
        self.kv_cache = KVCache(self.config.shard(self.tp.world_size), num_pages, page_size, kv_storage, self.device)
        self.page_size = page_size
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(
            self.config.eos_token_ids or (tokenizer.eos_token_ids if tokenizer is not None else ())
        )
        self._seqs: dict[Hashable, Sequence] = {}
        self.graphs = None  # DecodeGraphs once enable_cuda_graphs() ran
        # Steps of decode and verify chunks of up to this many tokens run as one-token rows, the verify
        # graphs' shape (``verify.py``); 0: verify chunks run as varlen chunks (no graphs for them).
        self.verify_rows = 0
        self.piecewise = None  # PiecewiseGraphs for steps with prompt chunks, likewise (unless switched off)
        self.threads: IdleCoreThreads | None = None  # torch's CPU threads, when they follow the idle cores
        self.think_tags = think_tags(tokenizer)  # (<think> id, </think> ids) when the vocabulary has them
        # Every rank draws a request's seed alike (ranks sample the same tokens: spark/engine/parallel.py).
        self._seed_rng = random.Random(self.tp.seed)
        self._inflight: deque[_Launched] = deque()  # launched, not yet collected, oldest first
        self._late: _Launched | None = None  # the newest launched step, while it waits for masks
        self._ended: OrderedDict[Hashable, None] = OrderedDict()  # recently ended ids: plans may still name them

    @classmethod
    def load(cls, model: str | None = None, **kwargs) -> "Engine":
        """Load ``model`` ("default", a .gguf path, an HF directory or "dummy[:preset]") and build an
        engine: ``loading.load_engine``, whose arguments it takes."""
        from spark.engine.loading import load_engine

        return load_engine(cls, model, **kwargs)

    def _default_kv_budget(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * GPU_MEMORY_FRACTION)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_pages(self) -> int:
        return self.kv_cache.num_pages

    def new_page_allocator(self) -> PageAllocator:
        return PageAllocator(self.kv_cache.num_pages, self.page_size, warm_pages=self._warm_pages)

    def close(self) -> None:
        """Drop the weights, the KV cache and the CUDA graphs now, even if this object stays referenced
        somewhere (a switch frees one model's memory before loading the next). The engine is unusable after."""
        self.graphs = self.piecewise = None
        self.kv_cache = None
        self.model = None
        self._seqs.clear()
        self._inflight.clear()
        self._late = None

    # -- sequences --------------------------------------------------------
    def add_sequence(self, seq_id: Hashable, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Register a sequence; its tokens are computed by later steps."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        if not prompt_ids:
            raise ValueError("prompt must hold at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_model_len}")
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary (size {self.config.vocab_size})")
        bad_bias = [t for t, _ in params.logit_bias if t >= self.config.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias token id {bad_bias[0]} outside the vocabulary (size {self.config.vocab_size})")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        self._seqs[seq_id] = Sequence(list(prompt_ids), params, seed, thinking=params.starts_in_thinking)

    def remove_sequence(self, seq_id: Hashable) -> None:
        """Forget a sequence (finished sequences are forgotten on their own).

        A launched step that still holds it computes its row anyway; the token is dropped.
        """
        if seq_id in self._seqs:
            self._forget(seq_id)

    def reset_computed(self, seq_id: Hashable, to: int = 0) -> None:
        """Compute the sequence from token ``to`` on, from the next step: 0 when it lost its pages
        (preempted), a cached prefix's length when its first pages hold that prefix's K/V already."""
        if seq_id in self._seqs:
            self._seqs[seq_id].num_computed = to

    def num_uncomputed(self, seq_id: Hashable) -> int:
        """Tokens of ``seq_id`` a plan may still compute (the prompt left, or 1 when decoding)."""
        s = self._seqs[seq_id]
        return s.num_planned - s.num_computed

    def num_computed(self, seq_id: Hashable) -> int:
        """Tokens of ``seq_id`` whose K/V launched steps compute or have computed."""
        return self._seqs[seq_id].num_computed

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens of ``seq_id`` so far, those that launched steps are sampling included."""
        return self._seqs[seq_id].num_planned

    # -- the step ---------------------------------------------------------
    def step(self, plan: StepPlan) -> list[TokenOutput]:
        """Compute the planned tokens in one forward; sample for sequences that caught up.

        The synchronous form of ``launch`` + ``collect``; nothing else may be in flight.

        Returns:
            One ``TokenOutput`` per sequence that sampled a token this step, in plan order.
        """
        if self._inflight:
            raise RuntimeError("step() while launched steps are not collected; use launch()/collect()")
        self.launch(plan)
        return self.collect()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> None:
        """Queue the forward and the sampling of ``plan`` on the device and return without waiting.

        A plan may compute tokens that earlier launched steps are still sampling
        (a decode right behind the previous one): their ids are taken on the
        device, so the host prepares step N+1 while the GPU runs step N. Chunks
        of sequences that ended (or will end by length at a launched step) are
        dropped: a pipelined planner learns of an end one step late.

        Raises:
            ValueError: the plan asks tokens a sequence does not have, or pages it lacks.
        """
        if self._late is not None:
            raise RuntimeError("launch() while the last launched step waits for its masks (sample_late)")
        register(self, plan)
        if self.threads is not None:
            self.threads.adjust()
        if any(self._waits_on_host(c) for c in plan.chunks):
            self._complete_all()  # penalties and forced tokens need the previous tokens on the host
        elif self.graphs is not None:
            self._bound_ring_readers()
        ids, positions, slots, qsl, seq_lens, sample_rows, samplers = [], [], [], [0], [], [], []
        logit_rows: list[int] = []  # the flat rows whose logits are computed: each chunk's last, a verify's every one
        drafts: dict[int, tuple[int, ...]] = {}
        feeds: dict[_Launched, tuple[list[int], list[int]]] = {}  # launched step -> (rows of ids, rows of its tokens)
        kept: list[Chunk] = []
        scored: list[tuple[Hashable, int, int]] = []  # (sequence, first logit row, rows) of prompt positions scored
        targets: list[int] = []  # the prompt token each scored row predicts
        page_size = self.page_size
        for chunk in plan.chunks:
            s = self._live(chunk.seq_id)
            if s is None or s.ends_by_length_before(self.max_model_len):
                continue
            start, end = s.num_computed, s.num_computed + chunk.num_tokens
            draft = chunk.draft
            if s.verifying:
                raise ValueError(f"{chunk.seq_id!r} is planned behind its verify step, whose tokens are not known yet")
            if chunk.num_tokens < 1 or end - len(draft) > s.num_planned:
                raise ValueError(f"plan asks {chunk.num_tokens} tokens of {chunk.seq_id!r}, {s.num_planned - start} left")
            if draft and (s.pending or end != s.num_planned + len(draft)):
                raise ValueError(f"the draft of {chunk.seq_id!r} must follow its last token, known on the host")
            if len(chunk.block_table) * page_size < end:
                raise ValueError(f"block table of {chunk.seq_id!r} holds {len(chunk.block_table)} pages, needs {end} tokens")
            if chunk.token_mask is not None and mask_bits(chunk.token_mask) < self.config.vocab_size:
                raise ValueError(f"a token mask of {mask_bits(chunk.token_mask)} bits for a vocabulary of "
                                 f"{self.config.vocab_size}")
            known = s.num_tokens
            for pos in range(start, end):
                if pos < known:
                    ids.append(s.token(pos))
                elif draft:
                    ids.append(draft[pos - known])
                else:  # sampled by a launched step: read on the device
                    launched, row = s.pending[pos - known]
                    dst, src = feeds.setdefault(launched, ([], []))
                    dst.append(len(ids))
                    src.append(row)
                    ids.append(0)
                positions.append(pos)
                slots.append(chunk.block_table[pos // page_size] * page_size + pos % page_size)
            qsl.append(qsl[-1] + chunk.num_tokens)
            seq_lens.append(end)
            if draft:  # every position samples: the token after it, if the draft holds that far
                drafts[len(samplers)] = draft
                sample_rows.extend(range(len(logit_rows), len(logit_rows) + chunk.num_tokens))
                logit_rows.extend(range(qsl[-2], qsl[-1]))
                samplers.extend([chunk.seq_id] * chunk.num_tokens)
            elif s.params.prompt_logprobs is not None and (span := s.unscored(start, end)):
                # logits of every row from the first scored one to the chunk's last (which may sample)
                scored.append((chunk.seq_id, len(logit_rows), len(span)))
                targets.extend(s.prompt_ids[span.start + 1:span.stop + 1])
                s.scored_to = span.stop
                logit_rows.extend(range(qsl[-2] + span.start - start, qsl[-1]))
                if end == s.num_planned:
                    sample_rows.append(len(logit_rows) - 1)
                    samplers.append(chunk.seq_id)
            else:
                if end == s.num_planned:
                    sample_rows.append(len(logit_rows))
                    samplers.append(chunk.seq_id)
                logit_rows.append(qsl[-1] - 1)
            kept.append(chunk)

        step = _Launched(samplers, drafts, scored=scored)
        if kept:
            self._queue(step, kept, ids, positions, slots, qsl, seq_lens, sample_rows, feeds,
                        logit_rows if drafts or scored else None, targets)
        self._inflight.append(step)  # only once queued: a launch that raised leaves nothing to collect

    def _queue(self, step: _Launched, kept, ids, positions, slots, qsl, seq_lens, sample_rows, feeds,
               logit_rows=None, targets=()) -> None:
        """Queue the forward of the chunks ``kept`` and the sampling of ``step``'s rows on the device
        (``logit_rows``: the rows whose logits are needed, when not each chunk's last; ``targets``: the
        prompt tokens that ``step.scored``'s rows predict)."""
        # (tokens, rows, picks): ids[rows] = tokens[picks], on the device, for each launched step read from.
        fed = [(launched.token_ids, dst, src) for launched, (dst, src) in feeds.items()]
        decode_only = len(ids) == len(kept)
        tables = [list(c.block_table) for c in kept]
        flat = None if step.scored else verify.decode_rows(kept, seq_lens, tables, self.verify_rows)
        if flat is not None:  # a verify step as one-token rows; its logit_rows were every row, in order
            decode_only, qsl, logit_rows = True, list(range(len(ids) + 1)), None
            seq_lens, tables = flat.seq_lens, flat.tables
        replayed = None
        if decode_only and self.graphs is not None and not step.scored:
            replayed = self.graphs.run(ids, positions, slots, seq_lens, tables, fed, verify=flat is not None)
        if replayed is None:
            logits = self._forward_eager(ids, positions, slots, qsl, seq_lens, tables, decode_only, fed, logit_rows,
                                         writes_first=flat is not None)
        else:
            logits, greedy = replayed
        for chunk in kept:
            self._seqs[chunk.seq_id].num_computed += chunk.num_tokens
        if step.scored:
            step.scores = self._score_prompts(step, logits, targets)
        if not step.seq_ids:
            return
        for row, seq_id, draft in _groups(step):
            s = self._seqs[seq_id]
            s.pending.append((step, row))
            s.verifying = bool(draft)
        sampling = set(step.seq_ids)
        rows = [c for c in kept if c.seq_id in sampling]
        greedy = None if replayed is None else replayed[1]
        step.unsampled = (logits, greedy, sample_rows, len(sample_rows) == len(ids))
        masks = {c.seq_id: c.token_mask for c in rows if c.token_mask is not None}
        if any(c.mask_later for c in rows):
            step.late, step.masks = {c.seq_id for c in rows if c.mask_later}, masks
            self._late = step  # sampled by sample_late, once its late rows' masks are known
            # Meanwhile the device gets what the sampling needs besides the logits (the rows'
            # columns, the draw's noise): sample_late then queues only what the masks decide.
            step.prepared = self.sampler.prepare(self._sampling_batch(step), self.config.vocab_size, self.device)
        else:
            self._sample(step, masks)

    def _score_prompts(self, step: _Launched, logits: torch.Tensor, targets: Seq[int]) -> HostCopy:
        """Queue the logprobs of the prompt tokens ``step.scored``'s rows predict, and their top
        alternatives, under the raw distribution (as the sampler's logprobs)."""
        rows = upload([first + i for _, first, n in step.scored for i in range(n)], torch.int64, self.device)
        k = max(self._seqs[seq_id].params.prompt_logprobs for seq_id, _, _ in step.scored)
        return HostCopy(raw_logprobs(logits.index_select(0, rows), upload(targets, torch.int64, self.device), k))

    def _keep_scores(self, step: _Launched) -> None:
        """Read a step's prompt scores back onto their sequences, for their first tokens to carry."""
        chosen, top_ids, top_lp = step.scores.read()
        at = 0  # the scores' row of each sequence's first scored position
        for seq_id, _, n in step.scored:
            s = self._seqs.get(seq_id)
            if s is not None and not s.ended:
                k = s.params.prompt_logprobs
                first = len(s.prompt_scores) + 1  # the prompt token its first row predicts
                s.prompt_scores.extend(PromptLogprob(
                    s.prompt_ids[first + i], chosen[at + i],
                    tuple(zip(top_ids[at + i][:k], top_lp[at + i][:k])) if k else (),
                ) for i in range(n))
            at += n

    @torch.inference_mode()
    def sample_late(self, masks) -> None:
        """Sample the newest launched step, whose ``mask_later`` chunks get their masks here (by
        sequence; a row without one samples unconstrained). A no-op when no step waits (its late rows
        ended before the launch). On a failure the step is dropped: nothing is left to collect of it."""
        step, self._late = self._late, None
        if step is None:
            return
        try:
            late = {seq_id: mask for seq_id, mask in masks.items() if seq_id in step.late}
            for mask in late.values():
                if mask_bits(mask) < self.config.vocab_size:
                    raise ValueError(f"a token mask of {mask_bits(mask)} bits for a vocabulary of {self.config.vocab_size}")
            self._sample(step, {**step.masks, **late})
        except BaseException:
            self._inflight.remove(step)
            for s in self._seqs.values():
                while s.pending and s.pending[-1][0] is step:
                    s.pending.pop()
            raise

    def _sample(self, step: _Launched, masks: dict) -> None:
        """Queue the sampling of ``step``'s rows (``masks``: the constrained ones', by sequence)."""
        logits, greedy, sample_rows, every_row_samples = step.unsampled
        step.unsampled = None
        seqs = [self._seqs[i] for i in step.seq_ids]
        token_mask = None
        if masks:
            token_mask = unpack_token_masks([masks.get(seq_id) for seq_id in step.seq_ids], self.config.vocab_size, self.device)
        if (greedy is not None and every_row_samples and token_mask is None
                and all(s.params.is_plain_greedy for s in seqs)):
            # The graph took every row's argmax already: no sampler launch, and the
            # next step reads these tokens from the graphs' ring on the device.
            result = SampleOutput(token_ids=greedy)
        else:
            if len(sample_rows) != logits.shape[0]:
                logits = logits[upload(sample_rows, torch.int64, self.device)]
            result = self.sampler(logits, self._sampling_batch(step), token_mask, step.prepared)
        step.token_ids, step.prepared = result.token_ids, None
        step.samples = HostCopy((result.token_ids, result.logprobs, result.top_token_ids, result.top_logprobs))

    def _sampling_batch(self, step: _Launched) -> SamplingBatch:
        """The sampler's rows of a launched step (each sequence has the step in its ``pending``; a
        step it was launched behind moves a token from ``pending`` to ``output_ids``, which keeps
        its ``steps``). Row ``i`` of a verify chunk samples as if the draft's first ``i`` tokens were
        output already, which they are when that row's sample is emitted: the same step (its noise)
        and the same penalties as without speculation."""
        params, histories, seeds, steps = [], [], [], []
        for _, seq_id, draft in _groups(step):
            s = self._seqs[seq_id]
            done = len(s.output_ids) + len(s.pending) - 1
            for i in range(1 + len(draft)):
                params.append(s.params)
                histories.append((tuple(s.prompt_ids), tuple(s.output_ids) + draft[:i]) if s.params.has_penalties
                                 else ((), ()))
                seeds.append(s.seed)
                steps.append(done + i)
        return SamplingBatch(params=params, token_histories=histories, seeds=seeds, steps=steps)

    def collect(self) -> list[TokenOutput]:
        """Wait for the oldest launched step; its ``TokenOutput``s, in plan order."""
        if not self._inflight:
            raise RuntimeError("collect() without a launched step")
        if self._inflight[0] is self._late:
            raise RuntimeError("collect() of a step that waits for its masks (sample_late)")
        step = self._inflight.popleft()
        if step.outputs is None:
            step.outputs = self._complete(step)
        return step.outputs

    @property
    def num_inflight(self) -> int:
        """Launched steps not yet collected."""
        return len(self._inflight)

    def _complete_all(self) -> None:
        for step in self._inflight:
            if step.outputs is None:
                step.outputs = self._complete(step)

    def _bound_ring_readers(self) -> None:
        """Read back the oldest launched steps until fewer than ``RING_ROWS`` are unread: the
        replay of this launch then writes no ring row that an unread step's tokens are in
        (the pipelined callers keep one step unread at a launch, and never read here)."""
        from spark.engine.cuda_graphs import RING_ROWS

        unread = [step for step in self._inflight if step.outputs is None]
        for step in unread[: max(0, len(unread) - (RING_ROWS - 1))]:
            step.outputs = self._complete(step)

    def _live(self, seq_id: Hashable) -> Sequence | None:
        """The sequence a chunk names, or None when it ended (a planner may not know yet)."""
        s = self._seqs.get(seq_id)
        if s is None:
            if seq_id in self._ended:
                return None
            raise ValueError(f"unknown sequence {seq_id!r}")
        return None if s.ended else s

    def _waits_on_host(self, chunk: Chunk) -> bool:
        s = self._seqs.get(chunk.seq_id)
        return s is not None and bool(s.pending) and s.needs_host_tokens

    def _forget(self, seq_id: Hashable) -> None:
        del self._seqs[seq_id]
        self._ended[seq_id] = None
        while len(self._ended) > _MAX_ENDED:
            self._ended.popitem(last=False)

    def _forward_eager(self, ids, positions, slots, qsl, seq_lens, tables, decode_only, feeds=(),
                       logit_rows=None, writes_first=False) -> torch.Tensor:
        """The forward of any flat batch. Returns logits of each sequence's last row (of every row when
        decoding), or of ``logit_rows``. ``writes_first``: decode rows that read each other's K/V."""
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=upload(slots, torch.int64, dev),
            query_start_loc=upload(qsl, torch.int32, dev),
            seq_lens=upload(seq_lens, torch.int32, dev),
            block_tables=upload([t + [0] * (width - len(t)) for t in tables], torch.int32, dev),
            decode_only=decode_only,
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            num_single=leading_single_rows(qsl),
            writes_first=writes_first,
        )
        input_ids = upload(ids, torch.int64, dev)
        for tokens, rows, picks in feeds:  # ids that launched steps are still sampling
            input_ids.index_copy_(0, upload(rows, torch.int64, dev), tokens.index_select(0, upload(picks, torch.int64, dev)))
        positions = upload(positions, torch.int64, dev)
        hidden = None
        if self.piecewise is not None and not decode_only:  # decode-only steps: the DecodeGraphs' or eager
            hidden = self.piecewise.forward(input_ids, positions, self.kv_cache.layers, meta)
        if hidden is None:
            hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
        if logit_rows is None:
            logit_rows = upload(qsl[1:], torch.int64, dev) - 1  # [B]: each sequence's last new token
        else:
            logit_rows = upload(logit_rows, torch.int64, dev)
        return self.model.compute_logits(hidden[logit_rows])

    # -- CUDA graphs ------------------------------------------------------
    def enable_cuda_graphs(self, max_batch_size: int, verify_rows: int = 0, max_step_tokens: int | None = None) -> bool:
        """Prepare decode graphs up to ``max_batch_size``, verify graphs up to ``verify_rows`` rows (at most
        ``verify.MAX_ROWS``) when the engine speculates (``SpecConfig.verify_rows``; 0: none), and
        piecewise graphs (``piecewise.py``) for the other steps up to ``max_step_tokens`` (default:
        ``max_batch_size`` + 512 prompt tokens; at most ``piecewise.MAX_TOKENS``), all captured by
        ``capture_next_graph``. GPU only; the piecewise ones on one rank, unless ``SPARK_PIECEWISE_GRAPHS=0``."""
        if self.device.type != "cuda":
            return False
        from spark.engine import piecewise
        from spark.engine.cuda_graphs import DecodeGraphs

        self.verify_rows = min(verify_rows, verify.MAX_ROWS)
        self.graphs = DecodeGraphs(
            self.model, self.kv_cache.layers, max_batch_size=max_batch_size,
            max_pages_per_seq=-(-self.max_model_len // self.page_size), device=self.device,
            verify_rows=self.verify_rows,
        )
        if self.tp.world_size == 1 and os.environ.get("SPARK_PIECEWISE_GRAPHS", "1") != "0":
            tokens = min(max_step_tokens or max_batch_size + 512, piecewise.MAX_TOKENS)
            self.piecewise = piecewise.PiecewiseGraphs(self.model, max_tokens=tokens, device=self.device,
                                                       dtype=self.dtype)
        return True

    def capture_next_graph(self) -> bool:
        """Capture one more graph (the decode ones, then the piecewise buckets); False when none is left."""
        if self.graphs is not None and self.graphs.capture_next():
            return True
        return self.piecewise is not None and self.piecewise.capture_next()

    def graph_progress(self) -> tuple[int, int]:
        """(graphs captured, graphs planned), a piecewise bucket counting one; (0, 0) without graphs."""
        parts = [g.progress for g in (self.graphs, self.piecewise) if g is not None]
        return sum(done for done, _ in parts), sum(planned for _, planned in parts)

    def _complete(self, step: _Launched) -> list[TokenOutput]:
        """Read a launched step's samples back (the one host sync of a step) and advance its sequences."""
        if step.scores is not None:
            self._keep_scores(step)
        if step.samples is None:
            return []
        token_ids, chosen_lp, top_ids, top_lp = step.samples.read()
        outputs = []
        for first, seq_id, draft in _groups(step):
            s = self._seqs.get(seq_id)
            if s is None:
                continue  # removed while its step ran
            s.pending.popleft()
            s.verifying = False
            if s.ended:
                if not s.pending:
                    self._forget(seq_id)
                continue  # a step launched before the end was known: its token is dropped
            # A verify chunk's rows after the first sample that differs from the draft were computed
            # after a rejected token (``verified``); a forced token in the run rejects the rest too.
            run = verified(token_ids[first:first + 1 + len(draft)], draft) if draft else 1
            for row in range(first, first + run):
                token, reason = s.accept(token_ids[row], eos_token_ids=self.eos_token_ids,
                                         max_model_len=self.max_model_len, think_tags=self.think_tags)
                k = s.params.logprobs
                top = tuple(zip(top_ids[row][:k], top_lp[row][:k])) if k and top_ids is not None else ()
                if reason is not None:
                    s.ended = True
                    if not s.pending:
                        self._forget(seq_id)
                prompt = None
                if s.params.prompt_logprobs is not None and len(s.output_ids) == 1:
                    prompt, s.prompt_scores = tuple(s.prompt_scores), []
                outputs.append(TokenOutput(
                    seq_id, token,
                    logprob=chosen_lp[row] if k is not None and chosen_lp is not None else None,
                    top_logprobs=top, finish_reason=reason, prompt_logprobs=prompt,
                ))
                if reason is not None or token != token_ids[row]:
                    break
            if draft and not s.ended:
                s.num_computed = s.num_tokens - 1  # the K/V of rejected positions is written over next
        return outputs


def _groups(step: _Launched):
    """(first row, sequence, draft) of each sequence a launched step samples: one row, or a verify
    chunk's ``1 + len(draft)``."""
    row = 0
    while row < len(step.seq_ids):
        draft = step.drafts.get(row, ())
        yield row, step.seq_ids[row], draft
        row += 1 + len(draft)
