"""The synchronous engine: one ``step(plan)`` computes one flat batch of tokens.

The caller (the scheduler actor, or ``generate`` below) decides what runs: a
``StepPlan`` names, per sequence, how many of its tokens to compute now and the
pages that hold them. Prefill, chunked prefill and decode are one case: a
sequence whose computed tokens catch up with its known tokens samples its next
token. The engine keeps each sequence's tokens and sampling state, never its
pages: pages belong to whoever owns the ``PageAllocator``.

No trio here; the GPU-runner actor calls ``step`` from a worker thread.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from typing import Hashable, Sequence as Seq

import attrs
import torch

from spark.engine.attention import AttentionMetadata
from spark.engine.config import ModelConfig
from spark.engine.kv_cache import KVCache, num_pages_for_budget
from spark.engine.models.llama import LlamaModel, rope_inv_freq
from spark.engine.page_allocator import PageAllocator
from spark.engine.sampler import Sampler, SamplingBatch
from spark.engine.sampling import SamplingParams

log = logging.getLogger("spark.engine")

CPU_KV_BUDGET_BYTES = 1 << 30
GPU_MEMORY_FRACTION = 0.90  # of the memory free after loading, for the KV cache


@attrs.frozen
class ScheduledChunk:
    """Compute ``num_tokens`` more tokens of ``seq_id``, whose pages are ``block_table``."""

    seq_id: Hashable
    num_tokens: int
    block_table: tuple[int, ...]


@attrs.frozen
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]


@attrs.frozen
class TokenOutput:
    """A token sampled for ``seq_id`` this step."""

    seq_id: Hashable
    token_id: int
    logprob: float | None = None  # of the chosen token, under the model's raw distribution
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    finish_reason: str | None = None  # "stop" | "length" once the sequence is done


@attrs.define(eq=False)
class _Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = attrs.Factory(list)
    num_computed: int = 0
    thinking: bool = False  # inside <think>...</think> now
    thinking_tokens: int = 0  # reasoning tokens generated so far
    forced: list[int] = attrs.Factory(list)  # tokens the engine writes next instead of sampling

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Engine:
    """A model, its KV cache and its sampler, stepped one flat batch at a time."""

    def __init__(
        self,
        model: LlamaModel,
        *,
        tokenizer=None,
        page_size: int = 16,
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
    ):
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        budget = kv_cache_bytes if kv_cache_bytes is not None else self._default_kv_budget()
        num_pages = num_pages_for_budget(self.config, budget, page_size, self.dtype)
        if num_pages < 2:
            raise ValueError(f"KV cache budget of {budget} bytes holds fewer than 2 pages")
        self.kv_cache = KVCache(self.config, num_pages, page_size, self.dtype, self.device)
        self.page_size = page_size
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(
            self.config.eos_token_ids or (tokenizer.eos_token_ids if tokenizer is not None else ())
        )
        self._seqs: dict[Hashable, _Sequence] = {}
        self.graphs = None  # DecodeGraphs once enable_cuda_graphs() ran
        self.think_tags = _think_tags(tokenizer)  # (<think> id, </think> ids) when the vocabulary has them
        self._seed_rng = random.Random()

    @classmethod
    def load(
        cls,
        model: str | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        page_size: int = 16,
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
        dummy_config=None,
        progress: bool = True,
    ) -> "Engine":
        """Load ``model`` ("default", a .gguf path, an HF directory or "dummy[:preset]") and build an engine.

        Raises:
            ModelLoadError: the model cannot be read; its message names the file and the problem.
        """
        from spark.engine.weights import iter_weights, resolve_model

        source = resolve_model(model, dummy_config=dummy_config)
        device = torch.device(device) if device is not None else _default_device()
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        t0 = time.perf_counter()
        with torch.device("meta"):
            net = LlamaModel(source.config)
        net = net.to_empty(device=device).to(dtype)
        net.inv_freq = rope_inv_freq(source.config).to(device)  # to_empty() left the buffer uninitialised
        net.load_weights(iter_weights(source, dtype=dtype, device=device, progress=progress))
        net.eval()
        tokenizer = _load_tokenizer(source)
        log.info("loaded %s (%s) on %s in %.1fs", source.path or "dummy", source.kind, device, time.perf_counter() - t0)
        return cls(net, tokenizer=tokenizer, page_size=page_size, kv_cache_bytes=kv_cache_bytes, max_model_len=max_model_len)

    def _default_kv_budget(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * GPU_MEMORY_FRACTION)
        return CPU_KV_BUDGET_BYTES

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_pages(self) -> int:
        return self.kv_cache.num_pages

    def new_page_allocator(self) -> PageAllocator:
        return PageAllocator(self.kv_cache.num_pages, self.page_size)

    def unload(self) -> None:
        """Drop the weights, the KV cache and the CUDA graphs now, even if this object stays referenced
        somewhere (a switch frees one model's memory before loading the next). The engine is unusable after."""
        self.graphs = None
        self.kv_cache = None
        self.model = None
        self._seqs.clear()

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
        self._seqs[seq_id] = _Sequence(list(prompt_ids), params, seed, thinking=params.starts_in_thinking)

    def remove_sequence(self, seq_id: Hashable) -> None:
        """Forget a sequence (finished sequences are forgotten on their own)."""
        self._seqs.pop(seq_id, None)

    def reset_computed(self, seq_id: Hashable) -> None:
        """The sequence lost its pages (preempted): recompute all its tokens from the next step on."""
        if seq_id in self._seqs:
            self._seqs[seq_id].num_computed = 0

    def num_uncomputed(self, seq_id: Hashable) -> int:
        """Tokens of ``seq_id`` known but not yet in the cache (the prompt left, or 1 when decoding)."""
        s = self._seqs[seq_id]
        return s.num_tokens - s.num_computed

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._seqs[seq_id].num_tokens

    # -- the step ---------------------------------------------------------
    @torch.inference_mode()
    def step(self, plan: StepPlan) -> list[TokenOutput]:
        """Compute the planned tokens in one forward; sample for sequences that caught up.

        Returns:
            One ``TokenOutput`` per sequence that sampled a token this step, in plan order.
        """
        if not plan.chunks:
            return []
        ids, positions, slots, qsl, seq_lens, sample_rows, samplers = [], [], [], [0], [], [], []
        page_size = self.page_size
        for row, chunk in enumerate(plan.chunks):
            s = self._seqs[chunk.seq_id]
            start, end = s.num_computed, s.num_computed + chunk.num_tokens
            if chunk.num_tokens < 1 or end > s.num_tokens:
                raise ValueError(f"plan asks {chunk.num_tokens} tokens of {chunk.seq_id!r}, {s.num_tokens - start} left")
            if len(chunk.block_table) * page_size < end:
                raise ValueError(f"block table of {chunk.seq_id!r} holds {len(chunk.block_table)} pages, needs {end} tokens")
            for pos in range(start, end):
                ids.append(s.token(pos))
                positions.append(pos)
                slots.append(chunk.block_table[pos // page_size] * page_size + pos % page_size)
            qsl.append(qsl[-1] + chunk.num_tokens)
            seq_lens.append(end)
            if end == s.num_tokens:
                sample_rows.append(row)  # logits come one row per chunk: its last token
                samplers.append(chunk.seq_id)

        decode_only = len(ids) == len(plan.chunks)
        tables = [list(c.block_table) for c in plan.chunks]
        logits = None
        if decode_only and self.graphs is not None:
            logits = self.graphs.run(ids, positions, slots, seq_lens, tables)
        if logits is None:
            logits = self._forward_eager(ids, positions, slots, qsl, seq_lens, tables, decode_only)
        for chunk in plan.chunks:
            self._seqs[chunk.seq_id].num_computed += chunk.num_tokens
        if not samplers:
            return []
        if len(sample_rows) != logits.shape[0]:
            logits = logits[torch.tensor(sample_rows, device=self.device)]
        return self._sample(samplers, logits)

    def _forward_eager(self, ids, positions, slots, qsl, seq_lens, tables, decode_only) -> torch.Tensor:
        """The forward of any flat batch. Returns logits of each sequence's last row, or of every row when decoding."""
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            decode_only=decode_only,
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv_cache.layers,
            meta,
        )
        last_rows = torch.tensor(qsl[1:], device=dev) - 1  # [B]: each sequence's last new token
        return self.model.compute_logits(hidden[last_rows])

    # -- CUDA graphs ------------------------------------------------------
    def enable_cuda_graphs(self, max_batch_size: int) -> bool:
        """Prepare decode graphs up to ``max_batch_size`` (captured by ``capture_next_graph``). GPU only."""
        if self.device.type != "cuda":
            return False
        from spark.engine.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(
            self.model, self.kv_cache.layers, max_batch_size=max_batch_size,
            max_pages_per_seq=-(-self.max_model_len // self.page_size), device=self.device,
        )
        return True

    def capture_next_graph(self) -> bool:
        """Capture one more decode graph; False when there is nothing left to capture."""
        return self.graphs is not None and self.graphs.capture_next()

    def _sample(self, seq_ids: list[Hashable], logits: torch.Tensor) -> list[TokenOutput]:
        seqs = [self._seqs[i] for i in seq_ids]
        batch = SamplingBatch(
            params=tuple(s.params for s in seqs),
            token_histories=tuple(
                (tuple(s.prompt_ids), tuple(s.output_ids)) if s.params.has_penalties else ((), ())
                for s in seqs
            ),
            seeds=tuple(s.seed for s in seqs),
            steps=tuple(len(s.output_ids) for s in seqs),
        )
        result = self.sampler(logits, batch)
        token_ids = result.token_ids.tolist()
        chosen_lp = result.logprobs.tolist() if result.logprobs is not None else None
        top_ids = result.top_token_ids.tolist() if result.top_token_ids is not None else None
        top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        outputs = []
        for row, (seq_id, s, token) in enumerate(zip(seq_ids, seqs, token_ids)):
            if s.forced:
                token = s.forced.pop(0)
            s.output_ids.append(token)
            self._track_thinking(s, token)
            k = s.params.logprobs
            top = tuple(zip(top_ids[row][:k], top_lp[row][:k])) if k and top_ids is not None else ()
            reason = self._finish_reason(s, token)
            if reason is not None:
                del self._seqs[seq_id]
            outputs.append(TokenOutput(
                seq_id, token,
                logprob=chosen_lp[row] if k is not None and chosen_lp is not None else None,
                top_logprobs=top, finish_reason=reason,
            ))
        return outputs

    def _track_thinking(self, s: _Sequence, token: int) -> None:
        """Count reasoning tokens; past the budget, queue the closing tag so the answer starts."""
        if self.think_tags is None:
            return
        start_id, end_ids = self.think_tags
        if token == start_id:
            s.thinking = True
        elif token == end_ids[0]:
            s.thinking = False
        elif s.thinking:
            s.thinking_tokens += 1
            budget = s.params.thinking_budget
            if budget is not None and s.thinking_tokens >= budget:
                s.forced = list(end_ids)
                s.thinking = False

    def _finish_reason(self, s: _Sequence, token: int) -> str | None:
        if token in s.params.stop_token_ids or (token in self.eos_token_ids and not s.params.ignore_eos):
            return "stop"
        if len(s.output_ids) >= s.params.max_tokens or s.num_tokens >= self.max_model_len:
            return "length"
        return None

    # -- convenience ------------------------------------------------------
    def generate(
        self,
        prompts: Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams],
        *,
        max_prefill_tokens: int | None = None,
        max_batch_size: int = 256,
    ) -> list[list[TokenOutput]]:
        """Run prompts to completion with a simple FIFO loop (CLI, tests, benchmarks).

        Each step decodes every running sequence and fills the rest of the token
        budget with prefill chunks of waiting ones (at most ``max_prefill_tokens``
        prompt tokens per step, so long prompts are chunked).

        Returns:
            Per prompt, the ``TokenOutput`` of every generated token.
        """
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        allocator = self.new_page_allocator()
        base = object()  # private ids: never collide with a caller's sequences
        waiting = deque((base, i) for i in range(len(prompts)))
        for (b, i) in waiting:
            self.add_sequence((b, i), prompts[i], params[i])
        running: list = []
        results: list[list[TokenOutput]] = [[] for _ in prompts]
        budget = max_prefill_tokens or self.max_model_len
        try:
            while waiting or running:
                chunks = []
                for sid in running:
                    table = allocator.append(sid, self.num_tokens(sid))
                    chunks.append(ScheduledChunk(sid, 1, table))
                left = budget
                while waiting and left > 0 and len(running) < max_batch_size:
                    sid = waiting[0]
                    n = min(self.num_uncomputed(sid), left)
                    done = self._seqs[sid].num_computed + n
                    if not allocator.can_allocate(sid, done):
                        break
                    table = allocator.append(sid, done) if allocator.has(sid) else allocator.allocate(sid, done)
                    chunks.append(ScheduledChunk(sid, n, table))
                    left -= n
                    if done == self.num_tokens(sid):
                        running.append(waiting.popleft())
                    else:
                        break  # a partial prompt fills the budget
                if not chunks:
                    raise RuntimeError("KV cache too small for the next prompt")
                for out in self.step(StepPlan(tuple(chunks))):
                    results[out.seq_id[1]].append(out)
                    if out.finish_reason is not None:
                        running.remove(out.seq_id)
                        allocator.free(out.seq_id)
        finally:
            for i in range(len(prompts)):
                self.remove_sequence((base, i))
        return results


def _think_tags(tokenizer) -> tuple[int, tuple[int, ...]] | None:
    """The ids of <think> and of "</think>\n\n" when the vocabulary has both tags as tokens."""
    if tokenizer is None:
        return None
    start, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    if start is None or end is None:
        return None
    return start, (end, *tokenizer.encode("\n\n"))


def _load_tokenizer(source):
    from spark.engine.tokenizer import Tokenizer

    if source.kind == "gguf":
        return Tokenizer.from_gguf(source.path)
    if source.kind == "hf":
        return Tokenizer.from_hf_dir(source.path)
    return Tokenizer.synthetic(source.config.vocab_size)
