"""One sequence as the engine keeps it, and the rules each sampled token goes through.

The engine owns a ``Sequence`` per request: its tokens and sampling state, never
its pages. Tokens that launched steps are still sampling exist only on the
device; ``pending`` counts them so plans can run ahead of what the host knows.
``accept`` applies the per-token rules: forced tokens (the thinking budget's
closing tag), reasoning-token counting, and the end conditions.
"""

from __future__ import annotations

from collections import deque

import attrs

from spark.engine.sampling import SamplingParams

ThinkTags = tuple[int, tuple[int, ...]]  # (<think> id, ids of "</think>\n\n")


@attrs.define(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = attrs.Factory(list)
    num_computed: int = 0
    thinking: bool = False  # inside <think>...</think> now
    thinking_tokens: int = 0  # reasoning tokens generated so far
    forced: list[int] = attrs.Factory(list)  # tokens the engine writes next instead of sampling
    # Launched steps that will sample this sequence's next tokens, oldest first, as
    # (step, row): their tokens exist only on the device until the step is collected.
    pending: deque = attrs.Factory(deque)
    ended: bool = False  # a collected step finished it (while later launched steps still held it)
    verifying: bool = False  # a launched step verifies its draft: how many tokens it gets is not known yet
    # prompt_logprobs: prompt positions whose next token launched steps score (a recompute after a
    # preemption scores none twice), and the scores collected, until the first token carries them
    scored_to: int = 0
    prompt_scores: list = attrs.Factory(list)

    @property
    def num_tokens(self) -> int:
        """Tokens known on the host: the prompt and the collected outputs."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_planned(self) -> int:
        """Tokens a plan may compute up to: the known ones and those launched steps will sample."""
        return self.num_tokens + len(self.pending)

    @property
    def needs_host_tokens(self) -> bool:
        """The next sample depends on the previous tokens' values on the host (penalties, forcing)."""
        return self.params.has_penalties or bool(self.forced) or self.params.thinking_budget is not None

    def token(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def unscored(self, start: int, end: int) -> range:
        """Of the positions ``start`` to ``end``, those whose next token is the prompt's and that no launched
        step scores yet (``prompt_logprobs``)."""
        return range(max(start, self.scored_to), min(end, len(self.prompt_ids) - 1))

    def ends_by_length_before(self, max_model_len: int) -> bool:
        """A launched step will end it by length, so nothing after that step may be computed."""
        if not self.pending:
            return False
        return len(self.output_ids) + len(self.pending) >= self.params.max_tokens or self.num_planned >= max_model_len

    def accept(self, token: int, *, eos_token_ids: frozenset[int], max_model_len: int,
               think_tags: ThinkTags | None) -> tuple[int, str | None]:
        """Append a sampled token, or the forced one in its place.

        Returns:
            (the token appended, "stop" | "length" | None).
        """
        if self.forced:
            token = self.forced.pop(0)
        self.output_ids.append(token)
        if think_tags is not None:
            self._track_thinking(token, think_tags)
        if token in self.params.stop_token_ids or (token in eos_token_ids and not self.params.ignore_eos):
            return token, "stop"
        if len(self.output_ids) >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return token, "length"
        return token, None

    def _track_thinking(self, token: int, think_tags: ThinkTags) -> None:
        """Count reasoning tokens; past the budget, queue the closing tag so the answer starts."""
        start_id, end_ids = think_tags
        if token == start_id:
            self.thinking = True
        elif token == end_ids[0]:
            self.thinking = False
        elif self.thinking:
            self.thinking_tokens += 1
            budget = self.params.thinking_budget
            if budget is not None and self.thinking_tokens >= budget:
                self.forced = list(end_ids)
                self.thinking = False


def think_tags(tokenizer) -> ThinkTags | None:
    """The ids of <think> and of "</think>\\n\\n" when the vocabulary has both tags as tokens."""
    if tokenizer is None:
        return None
    start, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    if start is None or end is None:
        return None
    return start, (end, *tokenizer.encode("\n\n"))
