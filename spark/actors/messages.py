"""The messages that flow between Spark's actors, and from them to the HTTP layer.

Every message is a frozen attrs value with plain fields. The flow (wired in
``spark.actors.system``):

    HTTP handler --GenerateRequest--> ingress --> scheduler --StepWork--> GPU runner
    GPU runner --StepResult--> scheduler --TokenOutputs--> streamer --RequestOutput--> handler
    handler (gone) --Cancel--> scheduler
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Hashable

import attrs

from spark.engine.engine import StepPlan, TokenOutput
from spark.engine.sampling import SamplingParams


@attrs.frozen
class GenerateRequest:
    """One generation, as the HTTP layer asks for it (``n`` > 1 is n requests)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first match
    api_key: str | None = None  # for rate limiting; None when keys are not configured
    skip_special_tokens: bool = True


@attrs.frozen
class TokenLogprob:
    """The logprob of one generated token and its best alternatives."""

    token_id: int
    token: str  # the token's text (bytes that are not UTF-8 as \\x escapes)
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (token id, text, logprob), best first


@attrs.frozen
class RequestOutput:
    """A piece of a request's stream: new text, and on the last piece why it ended."""

    request_id: str
    text: str  # new text since the previous piece (may be empty)
    token_ids: tuple[int, ...]  # tokens whose text is (or was held back into) this piece
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when logprobs were asked for
    finish_reason: str | None = None  # "stop" | "length" | "error" on the last piece
    stop_string: str | None = None  # the stop string that matched, if one did
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # generated so far, this piece included
    error: str | None = None  # why the request failed, when finish_reason == "error"

    @classmethod
    def merge(cls, pieces: Sequence[RequestOutput]) -> RequestOutput:
        """One piece that says what consecutive ``pieces`` of one request say, in order.

        Texts, token ids and logprobs are joined; how it ended (finish reason, stop string,
        error) and the output count come from the last piece.

        Args:
            pieces: at least one, oldest first; only the last may have a finish reason.

        Returns:
            The merged piece (``pieces[0]`` itself when there is one).
        """
        if len(pieces) == 1:
            return pieces[0]
        last = pieces[-1]
        return cls(
            last.request_id, "".join([p.text for p in pieces]), tuple(chain.from_iterable(p.token_ids for p in pieces)),
            tuple(chain.from_iterable(p.logprobs for p in pieces)), finish_reason=last.finish_reason,
            stop_string=last.stop_string, num_prompt_tokens=max(p.num_prompt_tokens for p in pieces),
            num_output_tokens=last.num_output_tokens, error=last.error,
        )


# -- between actors -----------------------------------------------------------


@attrs.frozen
class Cancel:
    """The request's client went away (or a stop string ended it): free its pages."""

    request_id: str


@attrs.frozen
class StepWork:
    """One engine step for the GPU runner: forget, reset, register, then compute ``plan``."""

    plan: StepPlan
    added: tuple[tuple[Hashable, tuple[int, ...], SamplingParams], ...] = ()
    removed: tuple[Hashable, ...] = ()  # ended (finished, cancelled, failed)
    reset: tuple[Hashable, ...] = ()  # preempted: their pages are gone, recompute from scratch


@attrs.frozen
class StepResult:
    outputs: tuple[TokenOutput, ...]
    seconds: float  # wall time of the step
    error: str | None = None  # the step failed; every sequence in it fails


@attrs.frozen
class Submission:
    """A request accepted by the ingress, with the channel its pieces go to."""

    request: GenerateRequest
    out: object  # trio.MemorySendChannel[RequestOutput]
    arrival: float  # trio.current_time() at acceptance


@attrs.frozen
class StreamOpen:
    """Scheduler -> streamer: a request starts; its tokens follow."""

    submission: Submission


@attrs.frozen
class TokenBatch:
    """Scheduler -> streamer: the tokens one step sampled."""

    outputs: tuple[TokenOutput, ...]
    time: float


@attrs.frozen
class Failed:
    """Scheduler -> streamer: a request ended by the server (an error, or the KV pool full)."""

    request_id: str
    error: str
    reason: str = "error"  # the finish_reason the client sees: "error" or "length"
