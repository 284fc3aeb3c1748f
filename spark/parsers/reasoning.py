"""Reasoning: the text a model writes inside `<think>...</think>`, split off from the answer.

Rules, in the order a reader meets them:
- `<think>` anywhere in the answer opens a block; several blocks are concatenated.
- A block holding only whitespace is a template no-op (`<think>\\n\\n</think>\\n\\n` when
  thinking is off): it yields no reasoning.
- Whitespace right after `</think>` is dropped (templates put "\\n\\n" there).
- A block still open at the end runs to the end (the token limit cut the reasoning: it stays
  reasoning). A tag the output ended inside (`</thi`, `<th`) is dropped, not text.
- When the chat template already opened the block in the prompt, the output starts inside it;
  a `<think>` the model writes anyway as its first non-whitespace text is dropped, with the
  whitespace before it, so the parse is that of the same text with the block not pre-opened.
  A later `<think>` inside the block is text, as in any block.
"""

from __future__ import annotations

from spark.parsers.events import ReasoningResult
from spark.parsers.scan import MORE, TextMachine, find_tag, first_non_space, tag_at

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_ends_in_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a `<think>` block open for the model to continue.

    Args:
      prompt_text: the prompt, as rendered by the chat template.

    Returns:
      True only if the last `<think>` in the prompt has no `</think>` after it.
    """
    i = prompt_text.rfind(THINK_OPEN)
    return i >= 0 and prompt_text.find(THINK_CLOSE, i) < 0


class ThinkStream(TextMachine):
    """Incremental `<think>` parser; see `spark.parsers.reasoning_parser`."""

    def __init__(self, prompt_ends_in_thinking: bool = False) -> None:
        super().__init__()
        self._state = self._think_start if prompt_ends_in_thinking else self._content
        self._reasoning: list[str] = []
        self._content_parts: list[str] = []
        self._held = ""  # the whitespace a block starts with, until we know it is not empty
        self._reopen = prompt_ends_in_thinking  # a first `<think>` of the model's own is dropped

    def _step(self, final: bool) -> bool:
        return self._state(final)

    def _content(self, final: bool) -> bool:
        i, tag = find_tag(self._buf, self._pos, (THINK_OPEN,), False)
        self._emit_content(self._buf[self._pos:i])
        self._pos = i
        if tag is None:
            return self._cut() if final and i < len(self._buf) else False
        self._pos += len(tag)
        self._held, self._state = "", self._think_start
        return True

    def _think_start(self, final: bool) -> bool:
        j = first_non_space(self._buf, self._pos)
        upto = len(self._buf) if j < 0 else j
        self._held += self._buf[self._pos:upto]
        self._pos = upto
        if j < 0:
            return False  # at the end a whitespace-only block gives nothing
        tag = tag_at(self._buf, j, (THINK_CLOSE, THINK_OPEN) if self._reopen else (THINK_CLOSE,), False)
        if tag is MORE:
            return self._cut() if final else False
        self._reopen = False
        if tag == THINK_OPEN:  # the template's block, reopened by the model: start it afresh
            self._pos += len(tag)
        elif tag is None:
            self._emit_reasoning(self._held)
            self._state = self._think
        else:
            self._pos += len(tag)
            self._state = self._after_think
        self._held = ""
        return True

    def _think(self, final: bool) -> bool:
        i, tag = find_tag(self._buf, self._pos, (THINK_CLOSE,), False)
        self._emit_reasoning(self._buf[self._pos:i])
        self._pos = i
        if tag is None:
            return self._cut() if final and i < len(self._buf) else False
        self._pos += len(tag)
        self._state = self._after_think
        return True

    def _after_think(self, final: bool) -> bool:
        j = first_non_space(self._buf, self._pos)
        if j < 0:
            self._pos = len(self._buf)
            return False
        self._pos, self._state = j, self._content
        return True

    def _cut(self) -> bool:
        """The output ended inside a tag: drop it."""
        self._pos = len(self._buf)
        return True

    def _emit_content(self, text: str) -> None:
        if text:
            self._content_parts.append(text)
            self._sink.content(text)

    def _emit_reasoning(self, text: str) -> None:
        if text:
            self._reasoning.append(text)
            self._sink.reasoning(text)

    def _result(self) -> ReasoningResult:
        return ReasoningResult("".join(self._reasoning), "".join(self._content_parts))
