"""Which generated tokens wrote the text a Responses output shows: its ``output_text`` logprobs.

The parser splits the model's text into reasoning, answer text and tool calls. Markup (``<think>``,
``<tool_call>``) shows nowhere, and text may wait a while before it shows (what could start a tag, the
whitespace before a message). So each piece's tokens are added before the events of their piece, and each
text shown is looked up in the bytes of the tokens still waiting: the tokens before it wrote markup and are
dropped, the tokens across it wrote it, the tokens after it wait for the next text.
"""

from __future__ import annotations

from collections.abc import Sequence

from spark.actors.messages import TokenLogprob
from spark.http.formatting import token_logprobs


class OutputTokens:
    """The tokens no shown text has claimed yet, each as its logprob entry (``formatting.token_logprobs``)."""

    def __init__(self):
        # (entry, the bytes it wrote); entry None: the rest of a token whose entry a text already took
        self._waiting: list[tuple[dict | None, bytes]] = []

    def add(self, logprobs: Sequence[TokenLogprob]) -> None:
        self._waiting += [(entry, bytes(entry["bytes"])) for entry in token_logprobs(logprobs)]

    def drop(self) -> None:
        """Forget the tokens waiting: what they wrote shows as no text (a call's markup and arguments)."""
        self._waiting = []

    def take(self, text: str) -> list[dict]:
        """The entries of the tokens that wrote ``text``, the next text shown.

        A token that runs past the text is taken with it, and its rest starts the next text. When the
        tokens' bytes do not hold the text (a tokenizer whose pieces do not join into its text), every
        token waiting is taken.
        """
        if not self._waiting:  # no logprobs asked for, or none left: nothing to look up
            return []
        written = b"".join(data for _, data in self._waiting)
        start = _token_aligned_find(written, text.encode(), self._starts())
        if start < 0:
            taken, self._waiting = [entry for entry, _ in self._waiting if entry is not None], []
            return taken
        end = start + len(text.encode())
        taken, waiting, pos = [], [], 0
        for entry, data in self._waiting:
            lo, pos = pos, pos + len(data)
            if pos <= start:
                continue  # markup before the text
            if lo >= end:
                waiting.append((entry, data))
                continue
            if entry is not None:
                taken.append(entry)
            if pos > end:
                waiting.append((None, data[end - lo:]))
        self._waiting = waiting
        return taken

    def _starts(self) -> set[int]:
        starts, pos = set(), 0
        for _, data in self._waiting:
            starts.add(pos)
            pos += len(data)
        return starts


def _token_aligned_find(haystack: bytes, needle: bytes, starts: set[int]) -> int:
    """Where ``needle`` first occurs at a token's start in ``haystack``, else where it first occurs at all
    (a token that writes markup and text both), or -1. A text also found inside markup (an ``a`` in
    ``</tool_call>``) is the one that starts a token."""
    first = at = haystack.find(needle)
    while at >= 0 and at not in starts:
        at = haystack.find(needle, at + 1)
    return at if at >= 0 else first
