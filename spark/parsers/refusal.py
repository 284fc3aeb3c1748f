"""The streaming refusal filter: an answer that opens with a refusal is told apart from content.

A model's refusal ("I'm sorry, but I can't help with that.") is text like any other; the APIs
give it fields of its own (OpenAI ``message.refusal``, a Responses ``refusal`` part, Anthropic
``stop_reason: "refusal"``). The filter holds the answer's first characters back while they may
still become one of its patterns (case and curly apostrophes aside, after leading whitespace),
then lets them go as content, or turns the whole answer into ``RefusalDelta``s:

    f = RefusalFilter(DEFAULT_PATTERNS)
    f.feed([ContentDelta("I'm sorry, ")])      # [] (held: it may be a refusal)
    f.feed([ContentDelta("but I can't")])      # [RefusalDelta("I'm sorry, but I can't")]
    f.flush()                                  # at the end: what is still held, as content

Reasoning passes through; a tool call decides "not a refusal".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from spark.parsers.events import ContentDelta, ToolCallDelta

# Openings of refusals as instruction-tuned models write them; ``ServeConfig.refusal_patterns`` replaces them.
DEFAULT_PATTERNS = (
    "I'm sorry, but I can't", "I'm sorry, but I cannot", "I am sorry, but I cannot", "I am sorry, but I can't",
    "I'm sorry, I can't", "I'm sorry, I cannot", "Sorry, but I can't", "Sorry, I can't",
    "I can't help with that", "I cannot help with that", "I can't assist with that", "I cannot assist with that",
    "I can't comply", "I cannot comply", "I won't help with", "I'm unable to help with", "I am unable to help with",
)


@attrs.frozen
class RefusalDelta:
    """A piece of an answer that refuses."""

    text: str


def _normal(text: str) -> str:
    return text.lower().replace("\u2019", "'")


class RefusalFilter:
    """Turn a stream of parser events into the same events, or, for an answer that opens with one of
    ``patterns``, its content as ``RefusalDelta``s (no patterns: everything passes as it is)."""

    def __init__(self, patterns: Sequence[str]):
        self._patterns = tuple(_normal(p.strip()) for p in patterns if p.strip())
        self.state = "undecided" if self._patterns else "content"  # -> "content" | "refusal"
        self._held = ""

    @property
    def refused(self) -> bool:
        return self.state == "refusal"

    def feed(self, events: Iterable) -> list:
        out: list = []
        for event in events:
            if isinstance(event, ContentDelta) and self.state != "content":
                if self.state == "refusal":
                    out.append(RefusalDelta(event.text))
                    continue
                self._held += event.text
                out += self._decide(final=False)
                continue
            if isinstance(event, ToolCallDelta) and self.state == "undecided":
                out += self._decide(final=True)  # an answer that calls a tool does not refuse
            out.append(event)
        return out

    def flush(self) -> list:
        """The end of the answer: what is still held back is content (or completes a refusal)."""
        return self._decide(final=True) if self.state == "undecided" else []

    def _decide(self, *, final: bool) -> list:
        text = _normal(self._held.lstrip())
        if any(text.startswith(p) for p in self._patterns):
            self.state, held, self._held = "refusal", self._held.lstrip(), ""
            return [RefusalDelta(held)]
        if not final and any(p.startswith(text) for p in self._patterns):
            return []  # it may still become one
        self.state, held, self._held = "content", self._held, ""
        return [ContentDelta(held)] if held else []
