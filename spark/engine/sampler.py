"""The batched sampler: one row per sequence, each with its own SamplingParams.

Every stage is a whole-batch tensor op with per-row parameters broadcast as
[B, 1] columns; a row whose stage is off gets a neutral value (temperature 1,
no threshold) instead of a branch. The only branches are per batch: a stage
that no row uses is skipped, and a batch of plain greedy rows is one argmax.

Randomness is not drawn from a torch generator. Each (row seed, row step,
vocab id) is hashed to a uniform u in (0, 1) with a counter-based integer mix,
and the token is the winner of an exponential race: argmax of p / -log(u).
A row's draw thus depends only on its own seed, step and logits, never on
which other rows share the batch or on the device's RNG.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from spark.engine.kernels import argmax
from spark.engine.sampling import SamplingParams
from spark.engine.transfer import to_device, upload

_NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1
# On a CPU, top-p looks for its cut among this many best tokens, then more (_top_p_threshold).
_CPU_TOP_P_WIDTHS = (256, 4096)
# lowbias32 multipliers (Wellons' hash-prospector), as signed int32 so torch accepts them.
_LOWBIAS1 = 0x21F0AAAD
_LOWBIAS2 = 0xD35A2D97 - (1 << 32)


@attrs.frozen
class SamplingBatch:
    """What the sampler needs besides logits; built by the engine once per step.

    Attributes:
      params: One SamplingParams per row.
      token_histories: Per row, (prompt_ids, output_ids); read only by the penalties.
      seeds: Per row, the effective seed (the engine draws one for unseeded requests).
      steps: Per row, how many tokens the sequence has sampled before (0 for the first).
    """

    params: tuple[SamplingParams, ...] = attrs.field(converter=tuple)
    token_histories: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = attrs.field(converter=tuple)
    seeds: tuple[int, ...] = attrs.field(converter=tuple)
    steps: tuple[int, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        sizes = {len(self.params), len(self.token_histories), len(self.seeds), len(self.steps)}
        if len(sizes) != 1:
            raise ValueError(f"SamplingBatch fields have different lengths: {sizes}")

    def __len__(self) -> int:
        return len(self.params)


@attrs.frozen
class SampleOutput:
    """The sampled tokens and, when any row asked, their logprobs.

    Logprobs come from the raw model distribution (log_softmax of the logits as
    given, before mask, bias, penalties and temperature), as OpenAI and vLLM
    report them. Every row gets K alternatives, K the largest ``logprobs`` in
    the batch; a row that asked for fewer keeps only its first ones.

    Attributes:
      token_ids: [B] int64.
      logprobs: [B] float32, the sampled token's logprob, or None.
      top_token_ids: [B, K] int64, most likely first, or None.
      top_logprobs: [B, K] float32, descending, or None.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class Sampler:
    """Picks one token per row. Stateless; one instance serves every step."""

    def prepare(self, batch: SamplingBatch, vocab_size: int, device: torch.device) -> Prepared | None:
        """What the batch's sampling needs that no logits decide: its per-row columns on the device
        and its noise. Queued while the forward runs, when the logits wait for something else (the
        masks of a constrained step); None for a batch of plain greedy rows, which needs nothing."""
        if all(p.is_plain_greedy for p in batch.params):
            return None
        rows = _Rows.build(batch, vocab_size, device)
        noise = None if all(p.is_greedy for p in batch.params) else race_noise(rows.keys, vocab_size)
        return Prepared(rows, noise)

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, token_mask: torch.Tensor | None = None,
        prepared: Prepared | None = None,
    ) -> SampleOutput:
        """Sample the next token of every row.

        Stages, in order: mask, logit_bias, penalties, argmax for greedy rows,
        then temperature, top-k, top-p, min-p and the seeded draw for the rest.

        Args:
          logits: [B, V] of any float dtype; computed in float32.
          batch: Per-row parameters, histories, seeds and steps.
          token_mask: Optional [B, V] bool, True where a token is allowed
            (the seam for constrained decoding); applied before anything else.
          prepared: ``prepare(batch, ...)``, when it was queued before the logits were known.

        Returns:
          A SampleOutput.
        """
        B, V = logits.shape
        if len(batch) != B:
            raise ValueError(f"logits have {B} rows but the batch has {len(batch)}")
        params = batch.params
        raw = logits.float()  # raw: [B, V]
        x = raw if token_mask is None else raw.masked_fill(~token_mask, _NEG_INF)
        if all(p.is_plain_greedy for p in params):
            return SampleOutput(token_ids=greedy_tokens(x))
        top_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        any_bias = any(p.logit_bias for p in params)
        any_penalty = any(p.has_penalties for p in params)
        all_greedy = all(p.is_greedy for p in params)

        if prepared is None:
            prepared = self.prepare(batch, V, logits.device)
        rows = prepared.rows
        if any_bias:
            x = apply_logit_bias(x, params)
        if any_penalty:
            x = _penalize(x, rows, params, batch.token_histories)
        if all_greedy:
            tokens = greedy_tokens(x)
        else:
            tokens = _draw(_filter(x, rows, params), prepared.noise)
            if any(p.is_greedy for p in params):
                tokens = torch.where(rows.greedy, x.argmax(dim=-1), tokens)

        if top_logprobs is None:
            return SampleOutput(token_ids=tokens)
        chosen, top_ids, top_lp = raw_logprobs(raw, tokens, top_logprobs)
        return SampleOutput(token_ids=tokens, logprobs=chosen, top_token_ids=top_ids, top_logprobs=top_lp)


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under the raw distribution of ``logits`` [R, V] (float32 log-softmax): the logprob of each row's
    token in ``tokens`` [R], and each row's ``k`` most likely token ids and logprobs, best first
    ([R, k] each). The sampler's logprobs and the engine's prompt scores alike."""
    logprobs = logits.float().log_softmax(dim=-1)
    top = logprobs.topk(k, dim=-1)
    return logprobs.gather(1, tokens[:, None]).squeeze(1), top.indices, top.values


@attrs.frozen
class _Rows:
    """Per-row parameters on the device, sent in two host-to-device copies.

    Columns that scale or cut the logits are [B, 1], to broadcast over the vocabulary.
    """

    temperature: torch.Tensor  # float32; greedy rows get 1 so that they stay finite
    top_p: torch.Tensor  # float32; 2 where off, so cumsum rounding past 1 drops nothing
    min_p: torch.Tensor  # float32
    repetition: torch.Tensor  # float32
    presence: torch.Tensor  # float32
    frequency: torch.Tensor  # float32
    top_k: torch.Tensor  # int64; 0 where off or not below V
    greedy: torch.Tensor  # [B] bool
    keys: torch.Tensor  # [B, 2] int32-valued halves of each row's noise key (row_keys)

    @classmethod
    def build(cls, batch: SamplingBatch, V: int, device: torch.device) -> _Rows:
        floats = torch.tensor(
            [
                (p.temperature or 1.0, p.top_p if p.top_p < 1.0 else 2.0, p.min_p)
                + (p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
                for p in batch.params
            ],
            dtype=torch.float32,
        )
        floats = to_device(floats, device)
        ints = torch.tensor(
            [
                (p.top_k if 0 < p.top_k < V else 0, p.is_greedy, *key)
                for p, key in zip(batch.params, row_keys(batch.seeds, batch.steps))
            ],
            dtype=torch.int64,
        )
        ints = to_device(ints, device)
        return cls(*floats.T[:, :, None], ints[:, 0:1], ints[:, 1] != 0, ints[:, 2:4])


@attrs.frozen
class Prepared:
    """A batch's ``Sampler.prepare``: its per-row columns, and the race's noise (None: all greedy)."""

    rows: _Rows
    noise: torch.Tensor | None


def greedy_tokens(x: torch.Tensor, into: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x.argmax(-1)`` of ``[B, V]`` scores: the first index of each row's maximum.

    On a GPU, a few rows take the two-pass Triton argmax (kernels/argmax.py): torch's argmax
    gives each row a single block, which took 28 us over Llama 3's 128k vocabulary on an H200,
    0.6% of a batch-1 step of the 8B model.

    ``into``: (a contiguous int64 table, int64 flat indices [B]): row r's token goes to
    ``table.view(-1)[indices[r]]`` (the CUDA graphs' ring), and the table is returned.
    """
    if x.is_cuda and x.shape[0] <= argmax.MAX_ROWS and x.stride(1) == 1:
        return argmax.argmax_triton(x, *(into or ()))
    tokens = x.argmax(dim=-1)
    if into is None:
        return tokens
    table, indices = into
    table.view(-1).index_copy_(0, indices, tokens)
    return table


def verified(samples: Sequence[int], draft: Sequence[int]) -> int:
    """How many of a verify chunk's samples are emitted: those up to the first that differs from the
    draft, that one included (``samples[i]`` was drawn at the position after ``draft[:i]``).

    This is rejection sampling for a draft that is a point mass q = [d]: each row samples from its
    own distribution p, processed as without speculation, by the exponential race (``race_noise``).
    The race's winner is d with probability p(d) (accept), and given that it is not d it is
    distributed as p with d removed and renormalised (the resample on rejection). Greedy rows
    accept the longest prefix equal to the argmax chain. And since a row's noise is keyed by the
    sequence's seed and the sample's index, speculation never changes which tokens a seed gives.
    """
    n = 0
    while n < len(draft) and samples[n] == draft[n]:
        n += 1
    return n + 1


def _unseeded(params: tuple[SamplingParams, ...]) -> SamplingBatch:
    """A batch for the stages that read only params (the public helpers below)."""
    n = len(params)
    return SamplingBatch(params=params, token_histories=(((), ()),) * n, seeds=(0,) * n, steps=(0,) * n)


def filter_logits(x: torch.Tensor, params: tuple[SamplingParams, ...]) -> torch.Tensor:
    """Divide by temperature, then set what top-k, top-p and min-p drop to -inf.

    Args:
      x: [B, V] float32 logits, already biased and penalized.
      params: One SamplingParams per row; greedy rows are scaled by 1.

    Returns:
      [B, V] float32; softmax of a row is the distribution that row samples from.
    """
    return _filter(x, _Rows.build(_unseeded(params), x.shape[1], x.device), params)


def _filter(x: torch.Tensor, rows: _Rows, params: tuple[SamplingParams, ...]) -> torch.Tensor:
    # Each filter is a per-row threshold, not a scattered mask: tokens tied with
    # the last kept one stay, so what is kept never depends on how ties are ranked.
    x = x / rows.temperature
    V = x.shape[1]
    max_k = max(p.top_k if 0 < p.top_k < V else 0 for p in params)
    if max_k:
        kth = x.topk(max_k, dim=-1).values.gather(1, (rows.top_k - 1).clamp(min=0))  # [B, 1]
        x = x.masked_fill((rows.top_k > 0) & (x < kth), _NEG_INF)
    if any(p.top_p < 1.0 for p in params):
        x = x.masked_fill(x < _top_p_threshold(x, rows.top_p), _NEG_INF)
    if any(p.min_p > 0.0 for p in params):
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p); log(0) = -inf keeps all.
        x = x.masked_fill(x < x.amax(dim=-1, keepdim=True) + rows.min_p.log(), _NEG_INF)
    return x


def _top_p_threshold(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row logit below which top-p drops a token; x: [B, V], top_p: [B, 1] -> [B, 1].

    Top-p keeps a prefix of the tokens ranked by logit. Ranking the whole
    vocabulary is one quick sort on a GPU but the slowest step on a CPU, so
    there the prefix is first sought among the best few hundred tokens, and
    only rows whose prefix runs past them (flat distributions) rank more.
    Either way a row's threshold depends on that row alone.
    """
    V = x.shape[1]
    widths = [w for w in _CPU_TOP_P_WIDTHS if w < V] if x.device.type == "cpu" else []
    log_norm = x.logsumexp(dim=-1, keepdim=True)  # [B, 1]
    threshold = torch.empty_like(log_norm)
    rows = torch.arange(x.shape[0], device=x.device)  # rows whose cut is not found yet
    for width in widths + [V]:
        pending = x[rows]
        ranked = (pending.topk(width, dim=-1) if width < V else pending.sort(dim=-1, descending=True)).values
        cut, kept = _prefix_threshold(ranked, log_norm[rows], top_p[rows])
        threshold[rows] = cut
        if width == V:
            break
        rows = rows[kept.squeeze(1) == width]  # the cut may lie past these candidates
        if len(rows) == 0:
            break
    return threshold


def _prefix_threshold(
    ranked: torch.Tensor, log_norm: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the descending logits ranked: [B, W] where the mass before a token reaches top_p.

    Returns the last kept logit and how many were kept, each [B, 1].
    """
    probs = (ranked - log_norm).exp()  # normalized over the whole row, not the W candidates
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
    return ranked.gather(1, kept - 1), kept


def _draw(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The seeded draw from filtered logits; x: [B, V], noise: ``race_noise`` -> [B] token ids."""
    return (x - noise).argmax(dim=-1)


def race_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] log E with E = -log(u) ~ Exp(1), u the rows' ``uniform_noise``.

    Exponential race: argmax p / E, taken in log space (x - log E) so that no
    softmax is needed. It depends on the keys alone: it can be computed before the logits.
    """
    return (-uniform_noise(keys, vocab_size).log()).log()


def apply_logit_bias(x: torch.Tensor, params: tuple[SamplingParams, ...]) -> torch.Tensor:
    """Add every row's logit_bias to x: [B, V]; a bias of -inf bans its token."""
    B, V = x.shape
    cells = [(row, token) for row, p in enumerate(params) for token, _ in p.logit_bias]
    if not cells:
        return x
    if max(token for _, token in cells) >= V:
        raise ValueError(f"logit_bias names a token id >= the vocabulary size {V}")
    index = upload(cells, torch.int64, x.device)  # [n, 2]
    values = upload([b for p in params for _, b in p.logit_bias], torch.float32, x.device)
    bias = torch.zeros(B, V, device=x.device)
    bias[index[:, 0], index[:, 1]] = values
    return x + bias


def apply_penalties(
    x: torch.Tensor,
    params: tuple[SamplingParams, ...],
    histories: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...],
) -> torch.Tensor:
    """Apply repetition (over prompt + output), presence and frequency (output only) penalties.

    Args:
      x: [B, V] float32 logits.
      params: One SamplingParams per row.
      histories: Per row, (prompt_ids, output_ids).

    Returns:
      [B, V] float32, penalized logits.
    """
    return _penalize(x, _Rows.build(_unseeded(params), x.shape[1], x.device), params, histories)


def _penalize(
    x: torch.Tensor,
    rows: _Rows,
    params: tuple[SamplingParams, ...],
    histories: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...],
) -> torch.Tensor:
    V = x.shape[1]
    # Rows without penalties contribute no history: their counts are never read.
    used = [h if p.has_penalties else ((), ()) for p, h in zip(params, histories)]
    counts = _token_counts([h[0] for h in used], [h[1] for h in used], V, x.device)
    prompt_counts, output_counts = counts[:, 0], counts[:, 1]  # each [B, V]
    seen = (prompt_counts + output_counts) > 0
    x = torch.where(seen, torch.where(x > 0, x / rows.repetition, x * rows.repetition), x)
    return x - rows.presence * (output_counts > 0) - rows.frequency * output_counts


def _token_counts(prompts: list, outputs: list, V: int, device: torch.device) -> torch.Tensor:
    """[B, 2, V] float32 occurrence counts of each row's prompt and output ids.

    Built on the host as one flat (row, slot) index list and sent in one copy.
    Ids outside the vocabulary (tokenizer-added tokens the model cannot emit)
    land in a spare column that is dropped.
    """
    B = len(prompts)
    ids = torch.tensor([t for seq in prompts + outputs for t in seq], dtype=torch.int64)
    lengths = torch.tensor([len(seq) for seq in prompts + outputs], dtype=torch.int64)
    seq_of = torch.repeat_interleave(torch.arange(2 * B), lengths)  # prompts are 0..B-1, outputs B..2B-1
    ids = torch.where((ids >= 0) & (ids < V), ids, V)
    flat = ((seq_of % B) * 2 + seq_of // B) * (V + 1) + ids  # into [B, 2, V + 1]
    counts = torch.zeros(B * 2 * (V + 1), device=device)
    counts.index_add_(0, to_device(flat, device), torch.ones(len(flat), device=device))
    return counts.view(B, 2, V + 1)[:, :, :V]


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift (torch's >> is arithmetic on signed ints: it copies the sign)."""
    return (x >> bits).bitwise_and_((1 << (x.element_size() * 8 - bits)) - 1)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In place, a 32-bit avalanche mix ("lowbias32") of int32 x.

    The [B, V] hash runs in int32 because CPUs vectorize 32-bit multiplies but
    not 64-bit ones: about 5x faster than splitmix64 over a whole vocabulary.
    """
    x.bitwise_xor_(_shift_right(x, 16)).mul_(_LOWBIAS1)
    x.bitwise_xor_(_shift_right(x, 15)).mul_(_LOWBIAS2)
    return x.bitwise_xor_(_shift_right(x, 15))


def _splitmix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def row_keys(seeds: Sequence[int], steps: Sequence[int]) -> list[tuple[int, int]]:
    """Each row's noise key: splitmix64 of (seed, step), split in signed 32-bit halves.

    On the host, in Python integers: a few dozen tiny [B] kernels fewer per step.

    Args:
      seeds: Each row's seed; any Python int (taken mod 2**64).
      steps: Each row's count of tokens sampled before.

    Returns:
      One (low, high) pair per row, each in int32 range.
    """
    keys = []
    for seed, step in zip(seeds, steps):
        key = _splitmix64((_splitmix64(seed & _MASK64) + step * 0x9E3779B97F4A7C15) & _MASK64)
        keys.append(tuple(((half & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000 for half in (key, key >> 32)))
    return keys


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counter-based uniforms: u[b, v] is a pure function of (keys[b], v).

    Args:
      keys: [B, 2] integer tensor of row_keys: each row's (low, high) key halves.
      vocab_size: V.

    Returns:
      [B, V] float32 in the open interval (0, 1).
    """
    low, high = keys[:, 0:1].to(torch.int32), keys[:, 1:2].to(torch.int32)  # each [B, 1]
    # Two rounds, the high key half between them: rows whose low halves differ
    # by j would otherwise see the same noise shifted by j vocab ids.
    # int32 addition and multiplication wrap mod 2**32 in torch, on CPU and CUDA.
    x = torch.arange(vocab_size, dtype=torch.int32, device=keys.device) + low  # x: [B, V]
    x = _mix32_(_mix32_(x).bitwise_xor_(high))
    bits = _shift_right(x, 9)  # top 23 bits
    # bits + 0.5 needs 24 significant bits, exactly float32's: u is exact and
    # never rounds to 0 or 1 (which would make -log(u) 0 or inf).
    return (bits.float() + 0.5) * (1.0 / (1 << 23))


def mask_bits(mask) -> int:
    """The tokens a packed mask covers: 8 per byte of its buffer (bytes, or a row of xgrammar's int32 words)."""
    return memoryview(mask).nbytes * 8


def unpack_token_masks(masks: Sequence[object | None], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, V] bool from each row's packed mask (bit i of the little-endian bytes: token i allowed;
    bytes, or a row of xgrammar's int32 bitmask, which is the same bytes); a row without one allows
    every token. The packed bits cross to the device and are unpacked there: an eighth of the bool
    rows' size."""
    import numpy as np

    width = -(-vocab_size // 8)
    # Written in place in pinned memory on a GPU: a copy from pageable memory would wait for the
    # forward the device is running (the masks are filled while it runs), and torch's copy into
    # pinned memory (``pin_memory()``) runs on its CPU thread pool, beside xgrammar's fill threads.
    host = torch.empty((len(masks), width), dtype=torch.uint8, pin_memory=torch.device(device).type == "cuda")
    packed = host.numpy()
    for row, mask in enumerate(masks):
        if mask is None:
            packed[row] = 0xFF
        else:  # (a buffer: no copy until this row's; sized by the engine's checks)
            packed[row] = np.frombuffer(mask, dtype=np.uint8, count=width)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    words = host.to(device, non_blocking=True)
    return ((words.unsqueeze(-1) >> shifts) & 1).view(len(masks), -1)[:, :vocab_size].bool()
