"""What the core asks of a grammar: the tokens allowed next, and each token that was taken.

A request that must follow a grammar (a JSON schema, a forced tool call) carries a ``GrammarSpec``;
the core asks its ``Grammars`` for a ``Matcher`` when it admits it, puts the matcher's mask on every
chunk of it that samples, and tells the matcher each token collected. The mask of a token depends
on the token before, so the pipelined step planned while that token is still being sampled carries
no mask yet: its chunk says ``mask_later``, the device runs its forward meanwhile, and the masks of
all such rows are filled at once (``Grammars.masks``) when the step before is collected, then handed
to the engine (``StepEngine.sample_late``) before it samples.
``spark.engine.grammar`` implements this with xgrammar.
"""

from __future__ import annotations

from typing import Protocol

import attrs

# A mask as any buffer of packed bits, bit i of its little-endian bytes allowing token i: bytes, or
# a row of xgrammar's int32 bitmask handed on without a copy (``memoryview(mask)`` reads either).
PackedMask = object


@attrs.frozen
class GrammarSpec:
    """A grammar as plain text: ``kind`` "json_schema" (``source``: the schema's JSON; "{}" any JSON
    value), or "structural_tag" (``source``: xgrammar's structural tag JSON)."""

    kind: str
    source: str


class Matcher(Protocol):
    def mask(self) -> bytes:
        """The tokens allowed next: bit i of the little-endian bytes allows token i."""

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar does not allow it (the state is unchanged)."""


class Grammars(Protocol):
    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher of ``spec`` (compiled once per spec). Raises ValueError for a bad grammar."""

    def masks(self, matchers: list[Matcher]) -> list[PackedMask]:
        """Each matcher's ``mask()``, filled in one call (in parallel where the backend can): the same
        bits, as any buffer (xgrammar's: the rows of one int32 array, with no bytes object per row)."""

    def accept(self, matchers: list[Matcher], token_ids: list[int]) -> list[bool]:
        """Each matcher's ``accept`` of its token, in one call."""
