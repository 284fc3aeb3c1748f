"""The plan of one engine step, and what the step gives back. One name each.

A ``StepPlan`` is everything the engine needs to run a step: the sequences to forget,
to recompute from scratch (preempted) and to register, then the ``Chunk``s to
compute. A chunk is "compute ``num_tokens`` more tokens of this sequence, held in
these pages"; prefill, chunked prefill and decode are one case of it, and a
sequence whose computed tokens reach its known tokens samples its next token.

Speculation (``speculation.py``) is a chunk too: the last known token and the ``draft`` after
it, verified in one forward, with logits at every position; the step gives back the tokens it
accepts (one or more). A chunk carries its row's token mask (grammar); a rank's slice of a
group (tensor parallelism) is the engine's ``Runtime``, and the same plan goes to every rank.
"""

from __future__ import annotations

from typing import Hashable

import attrs


@attrs.frozen
class Chunk:
    """Compute ``num_tokens`` more tokens of ``seq_id``, whose pages are ``block_table``.

    ``token_mask``, when the chunk samples, limits the token it samples to the allowed ones:
    bit i of the little-endian bytes allows token i (xgrammar's int32 bitmask, as bytes).
    ``mask_later``: it has a mask, which depends on a token still being sampled; the engine runs the
    forward and waits for ``StepEngine.sample_late`` before it samples.
    ``draft``: speculated tokens after the sequence's last known token (``num_tokens`` is then
    ``1 + len(draft)``): each position samples, and the step emits the samples up to the first
    that differs from the draft, that one included.
    """

    seq_id: Hashable
    num_tokens: int
    block_table: tuple[int, ...]
    token_mask: bytes | None = None
    mask_later: bool = False
    draft: tuple[int, ...] = ()

    @property
    def decodes(self) -> bool:
        """A decode row (one token, or a verification of drafts), not a prompt chunk: what a step's
        time counts per row rather than per token."""
        return self.num_tokens == 1 or bool(self.draft)


@attrs.frozen
class NewSequence:
    """A sequence for the engine to register before the step: its prompt and sampling parameters."""

    seq_id: Hashable
    prompt_ids: tuple[int, ...]
    params: object  # spark.engine.sampling.SamplingParams (kept opaque: the core never reads it)


@attrs.frozen
class StepPlan:
    """One step: forget ``removed``, recompute ``reset`` from scratch, register ``added``, start ``cached``
    past their cached prefix, compute ``chunks``."""

    chunks: tuple[Chunk, ...]
    added: tuple[NewSequence, ...] = ()
    removed: tuple[Hashable, ...] = ()  # ended (finished, cancelled, failed)
    reset: tuple[Hashable, ...] = ()  # preempted: their pages are gone
    cached: tuple[tuple[Hashable, int], ...] = ()  # (sequence, tokens): its first pages hold their K/V


@attrs.frozen
class PromptLogprob:
    """A prompt token scored by the model given the tokens before it (teacher forcing)."""

    token_id: int
    logprob: float  # under the model's raw distribution, as ``TokenOutput.logprob``
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@attrs.frozen
class TokenOutput:
    """A token sampled for ``seq_id`` in a step."""

    seq_id: Hashable
    token_id: int
    logprob: float | None = None  # of the chosen token, under the model's raw distribution
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    finish_reason: str | None = None  # "stop" | "length" once the sequence is done
    # On a sequence's first token, when its params ask ``prompt_logprobs``: its prompt's tokens after
    # the first, each scored (the first has nothing before it). None otherwise.
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None


@attrs.frozen
class StepResult:
    """What a launched step gave: its tokens, how long it took, or why it failed."""

    outputs: tuple[TokenOutput, ...]
    seconds: float  # device time of the step
    error: str | None = None  # the step failed; every sequence in it fails
