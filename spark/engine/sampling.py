"""Per-request sampling parameters.

One frozen value per request, validated on construction so that the sampler
never has to check a field: a bad value raises ``ValueError`` naming the field.
Semantics follow the OpenAI API where it defines a field (presence/frequency
penalty, logit_bias, logprobs) and HF/vLLM otherwise (repetition_penalty,
top_k, min_p).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping

import attrs

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs


def _as_float(value: object, field: attrs.Attribute) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field.name} must be a number, got {value!r}")
    return float(value)


def _as_int(value: object, field: attrs.Attribute) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{field.name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # accepts numpy ints, refuses 1.5
    except TypeError:
        raise ValueError(f"{field.name} must be an integer, got {value!r}") from None


def _as_optional_int(value: object, field: attrs.Attribute) -> int | None:
    return None if value is None else _as_int(value, field)


def _as_token_ids(value: object, field: attrs.Attribute) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{field.name} must be a sequence of token ids, got {value!r}")
    ids = tuple(_as_int(v, field) for v in value)
    if any(i < 0 for i in ids):
        raise ValueError(f"{field.name} must hold non-negative token ids, got {ids!r}")
    return ids


def _as_logit_bias(value: object, field: attrs.Attribute) -> tuple[tuple[int, float], ...]:
    """A ``{token_id: bias}`` dict (JSON keys may be strings) or pairs, sorted by id."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        pairs = list(value)
    else:
        raise ValueError(f"{field.name} must be a dict of token id -> bias, got {value!r}")
    out: dict[int, float] = {}
    for pair in pairs:
        try:
            key, bias = pair
        except (TypeError, ValueError):
            raise ValueError(f"{field.name} entries must be (token_id, bias) pairs, got {pair!r}") from None
        try:
            token = int(key) if isinstance(key, str) else _as_int(key, field)
        except ValueError:
            raise ValueError(f"{field.name} keys must be token ids, got {key!r}") from None
        bias = _as_float(bias, field)
        # -inf bans a token; +inf or NaN would turn the whole row into NaN.
        if token < 0 or math.isnan(bias) or bias == math.inf:
            raise ValueError(f"{field.name} has a bad entry {token!r}: {bias!r}")
        if token in out:
            raise ValueError(f"{field.name} repeats token id {token}")
        out[token] = bias
    return tuple(sorted(out.items()))


def _in_range(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False):
    """A validator for ``lo <= value <= hi`` (or open ends); NaN always fails."""

    def check(_instance: object, field: attrs.Attribute, value: float | int | None) -> None:
        if value is None:
            return
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
        if not ok:  # NaN compares false, so it lands here too
            if hi == math.inf:
                bound = f"{'>' if lo_open else '>='} {lo}"
            else:
                bound = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
            raise ValueError(f"{field.name} must be {bound}, got {value!r}")

    return check


def _field(default: object, convert, check=None):
    """An attrs field whose converter gets the field, so its errors can name it."""
    return attrs.field(default=default, converter=attrs.Converter(convert, takes_field=True), validator=check)


@attrs.frozen
class SamplingParams:
    """How to pick each next token of one request.

    Attributes:
      temperature: Divides the logits; 0 means greedy (argmax).
      top_k: Keep the k most likely tokens (ties at the boundary stay); 0 or -1 is off.
      top_p: Keep the smallest set of most likely tokens whose mass reaches top_p.
      min_p: Drop tokens less likely than min_p times the most likely one.
      repetition_penalty: Over prompt and output tokens: a seen token's positive
        logit is divided by it, a negative one multiplied (HF/vLLM).
      presence_penalty: Subtracted once from every token already in the output (OpenAI).
      frequency_penalty: Subtracted per occurrence in the output (OpenAI).
      logit_bias: (token_id, bias) pairs added to the logits; -inf bans a token.
        A dict is accepted and stored sorted.
      seed: Fixes the random stream of this request; None lets the engine draw one.
      logprobs: None for no logprobs; k for the sampled token's logprob plus the
        k most likely alternatives (0 <= k <= 20).
      prompt_logprobs: None, or k: each prompt token after the first is scored (its logprob given
        the tokens before it, and the k most likely alternatives), returned with the first token.
        Such a sequence computes logits at every prompt position, and reuses no cached prefix.
      max_tokens: Most tokens to generate.
      stop_token_ids: Tokens that end the request (besides EOS).
      ignore_eos: Keep going past EOS.
      thinking_budget: Most tokens of reasoning (inside <think>...</think>); when
        reached, the engine writes the closing tag itself and the answer follows.
        None: unlimited. Needs a model whose vocabulary has the think tags.
      starts_in_thinking: The prompt ends inside an open <think> (template-forced).
    """

    temperature: float = _field(1.0, _as_float, _in_range(0.0, math.inf, hi_open=True))
    top_k: int = _field(0, _as_int, _in_range(-1, math.inf))
    top_p: float = _field(1.0, _as_float, _in_range(0.0, 1.0, lo_open=True))
    min_p: float = _field(0.0, _as_float, _in_range(0.0, 1.0))
    repetition_penalty: float = _field(1.0, _as_float, _in_range(0.0, math.inf, lo_open=True, hi_open=True))
    presence_penalty: float = _field(0.0, _as_float, _in_range(-2.0, 2.0))
    frequency_penalty: float = _field(0.0, _as_float, _in_range(-2.0, 2.0))
    logit_bias: tuple[tuple[int, float], ...] = _field((), _as_logit_bias)
    seed: int | None = _field(None, _as_optional_int)
    logprobs: int | None = _field(None, _as_optional_int, _in_range(0, MAX_LOGPROBS))
    prompt_logprobs: int | None = _field(None, _as_optional_int, _in_range(0, MAX_LOGPROBS))
    max_tokens: int = _field(256, _as_int, _in_range(1, math.inf))
    stop_token_ids: tuple[int, ...] = _field((), _as_token_ids)
    ignore_eos: bool = attrs.field(default=False)
    thinking_budget: int | None = _field(None, _as_optional_int, _in_range(0, math.inf))
    starts_in_thinking: bool = attrs.field(default=False)

    @ignore_eos.validator
    @starts_in_thinking.validator
    def _check_bool(self, field: attrs.Attribute, value: object) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"{field.name} must be a bool, got {value!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_plain_greedy(self) -> bool:
        """The token is the argmax of the raw logits, and nothing else is asked of the sampler
        (the decode graphs take such tokens themselves; a row constrained by a token mask,
        when constrained decoding comes, must not count as plain)."""
        return self.temperature == 0.0 and not self.logit_bias and not self.has_penalties and self.logprobs is None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
