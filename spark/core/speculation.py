"""N-gram speculation: which decodes carry drafts, and how much they gave.

A decode of a speculating sequence becomes a verify chunk: its last known token and up to
``num_tokens`` drafted ones (``NgramIndex``: the tokens that followed the latest earlier
occurrence of its suffix), computed in one forward. The engine samples every position and
emits the samples up to the first that differs from the draft, that one included: greedy
rows accept the longest prefix equal to the argmax chain, sampled rows keep their output
distribution (``spark.engine.engine``). The scheduler then rolls the rejected tokens back.

A sequence drafts as many tokens as its last verification accepted, plus one (up to ``num_tokens``):
a draft that is all taken doubles the next, a rejected one shrinks it, so that a sequence whose
context does not repeat pays one extra position a step rather than ``num_tokens``.

Drafts need the sequence's last token on the host, so while any sequence speculates the core
launches one step at a time (no step planned behind one in flight). Speculation pays while a
step is bound by reading the weights; past ``max_batch`` running sequences it is compute-bound
and the extra positions cost as much as they give, so it is off and pipelining is back.
"""

from __future__ import annotations

from typing import Hashable, Iterable

import attrs

from spark.core.ngram import NgramIndex

METHODS = ("ngram",)


@attrs.frozen
class SpecConfig:
    """How sequences speculate."""

    method: str = attrs.field(default="ngram", validator=attrs.validators.in_(METHODS))
    num_tokens: int = attrs.field(default=4, validator=attrs.validators.ge(1))  # drafted tokens per step at most
    ngram_max: int = attrs.field(default=4, validator=attrs.validators.ge(1))  # the longest suffix looked up
    ngram_min: int = attrs.field(default=2, validator=attrs.validators.ge(1))  # the shortest (capped to ngram_max)
    max_batch: int = attrs.field(default=8, validator=attrs.validators.ge(1))  # off with more running than this

    @property
    def verify_rows(self) -> int:
        """Tokens of the largest verify step: every speculating sequence's token and drafts (the
        engine's verify graphs are sized by it)."""
        return self.max_batch * (1 + self.num_tokens)


@attrs.define
class SpecCounts:
    """What speculation did: totals since start (the metrics take differences)."""

    drafted: int = 0  # tokens drafted
    accepted: int = 0  # of those, emitted
    steps: int = 0  # decodes of speculating sequences while speculation was on (drafts or not)
    tokens: int = 0  # tokens those steps emitted


class Speculator:
    """The drafts of the sequences that speculate: one ``NgramIndex`` each, fed every token they get."""

    def __init__(self, config: SpecConfig):
        self.config = config
        self.counts = SpecCounts()
        self._indexes: dict[Hashable, NgramIndex] = {}
        self._lengths: dict[Hashable, int] = {}  # each sequence's next draft length at most

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._indexes

    def __bool__(self) -> bool:
        return bool(self._indexes)

    def start(self, seq_id: Hashable, prompt_ids: Iterable[int]) -> None:
        c = self.config
        self._indexes[seq_id] = NgramIndex(prompt_ids, n_max=c.ngram_max, n_min=min(c.ngram_min, c.ngram_max))
        self._lengths[seq_id] = c.num_tokens

    def forget(self, seq_id: Hashable) -> None:
        self._indexes.pop(seq_id, None)
        self._lengths.pop(seq_id, None)

    def extend(self, seq_id: Hashable, tokens: Iterable[int]) -> None:
        """Tokens ``seq_id`` got (a collected step's)."""
        index = self._indexes.get(seq_id)
        if index is not None:
            index.extend(tokens)

    def draft(self, seq_id: Hashable, limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens to verify after ``seq_id``'s last one (fewer as its drafts fail)."""
        return tuple(self._indexes[seq_id].draft(min(self._lengths[seq_id], limit)))

    def on(self, running: int) -> bool:
        """Whether sequences speculate with ``running`` sequences decoding."""
        return bool(self._indexes) and running <= self.config.max_batch

    def observe(self, seq_id: Hashable, drafted: int, emitted: int) -> None:
        """A collected decode of a speculating sequence: ``drafted`` tokens verified, ``emitted`` given."""
        accepted = max(0, min(drafted, emitted - 1))
        c = self.counts
        c.steps += 1
        c.tokens += emitted
        c.drafted += drafted
        c.accepted += accepted
        if drafted and seq_id in self._lengths:
            grown = 2 * drafted if accepted == drafted else accepted + 1
            self._lengths[seq_id] = min(self.config.num_tokens, grown)
