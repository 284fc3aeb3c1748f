"""Turn a stream of generated token ids into text deltas.

Decoding the whole output at every step costs O(n) per token. Instead we decode a small
window: the ids already emitted since the last checkpoint (`_prefix`..`_read`) give the
context, and the text past that context is the new delta. A delta is held back while the
window's text ends in U+FFFD, since that is usually a UTF-8 character whose bytes are
split across tokens and will complete with the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

from spark.engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Ids of context kept from the prompt: enough for tokenizers whose decoding of a token
# depends on its neighbour (SentencePiece's leading space).
_PROMPT_CONTEXT = 5
# Past this many held ids the trailing U+FFFD is probably genuine (invalid bytes or the
# model writing U+FFFD itself); we then release text up to a provably safe boundary so
# the window stays small.
_MAX_HELD = 8
# A UTF-8 character has at most 4 bytes, so 3 ids after a boundary decide whether a
# sequence cut there completes.
_SETTLE = 4


class IncrementalDetokenizer:
    """Incremental decoding of one sequence's output.

    The deltas returned by `push`, followed by `flush`, concatenate to
    `tokenizer.decode(output_ids)` (with no prompt) and never end in half a character.

    Args:
      tokenizer: the model's tokenizer.
      prompt_ids: the prompt, used only as decoding context for the first tokens.
      skip_special_tokens: leave control tokens out of the text.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0  # start of the context window
        self._read = len(self._ids)  # ids before this are emitted

    @property
    def held_ids(self) -> int:
        """How many pushed ids have not made it into a delta yet."""
        return len(self._ids) - self._read

    def push(self, token_id: int) -> str:
        """Add one generated id.

        Args:
          token_id: the id.

        Returns:
          The new text, possibly empty.
        """
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        if len(text) >= len(prefix_text) and not text.endswith(_REPLACEMENT):
            return self._advance(text[len(prefix_text):], len(self._ids))
        if self.held_ids > _MAX_HELD:
            return self._release_settled(prefix_text, text)
        return ""

    def flush(self) -> str:
        """Return whatever is still held, at the end of the sequence."""
        prefix_text = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        return self._advance(text[len(prefix_text):], len(self._ids))

    def _release_settled(self, prefix_text: str, text: str) -> str:
        # Emit up to `cut` if cutting there does not change the text: with _SETTLE ids after
        # it, any character split at `cut` has either completed or failed already.
        cut = len(self._ids) - _SETTLE
        if not self._tokenizer.special_ids.isdisjoint(self._ids[cut:]):
            return ""  # a skipped special token holds no bytes, so the tail may not settle a character
        head = self._decode(self._prefix, cut)
        if head.startswith(prefix_text) and head + self._decode(cut, len(self._ids)) == text:
            return self._advance(head[len(prefix_text):], cut)
        return ""

    def _advance(self, delta: str, read: int) -> str:
        # The emitted ids become the next window's context; older ids are dropped.
        self._prefix, self._read = self._read, read
        del self._ids[:self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        return delta

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip)
