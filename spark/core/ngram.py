"""Prompt-lookup drafts for n-gram speculation: the tokens that followed the last time a sequence's
newest n tokens appeared in it.

Agents re-send and re-write their context (a file asked back with one change, a tool result quoted),
so the continuation of a repeated span is often that span's earlier continuation: a draft that needs
no second model. ``NgramIndex`` remembers, for every n-gram of ``n_min``..``n_max`` tokens, where its
latest occurrence with a known next token ended. Appending a token costs ``n_max - n_min + 1`` dict
writes and a draft as many lookups, whatever the sequence's length: a 100k-token agent context drafts
as fast as a short one (a scan of the context per step would not).
"""

from __future__ import annotations

from typing import Iterable


class NgramIndex:
    """The n-grams of one growing token sequence, for drafting its continuation.

    Args:
        n_max, n_min: the longest and shortest suffix looked up; the longest that occurred before wins
            (a longer match is likelier to continue the same way).
        tokens: the sequence so far (a prompt).
    """

    def __init__(self, tokens: Iterable[int] = (), *, n_max: int = 4, n_min: int = 2):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        # n-gram -> the end (exclusive) of its latest occurrence that has a next token
        self._ends: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (a step's accepted ones)."""
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here get ``token`` as their next token
            self.tokens.append(token)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._ends[tuple(self.tokens[end - n:end])] = end

    def draft(self, k: int) -> list[int]:
        """``k`` tokens that followed the longest earlier occurrence of the sequence's suffix (the latest
        such occurrence); [] when no suffix of ``n_min`` tokens or more occurred before. A continuation
        that runs into the suffix itself (a loop, a repeated line) goes on as the sequence would if the
        draft were accepted: its own tokens repeat."""
        length = len(self.tokens)
        if k < 1:
            return []
        for n in range(min(self.n_max, length), self.n_min - 1, -1):
            end = self._ends.get(tuple(self.tokens[length - n:]))
            if end is not None:
                draft = self.tokens[end:end + k]
                while len(draft) < k:  # (end + len(draft) >= length: that position holds a drafted token)
                    draft.append(draft[end + len(draft) - length])
                return draft
        return []
