"""The messages that flow between Spark's actors, and from them to the HTTP layer.

Every message is a frozen attrs value with plain fields. The flow (wired in
``spark.actors.system``):

    HTTP handler --GenerateRequest--> ingress --Submission--> host --Admit--> core
    core --Opened/TokenBatch/Failed (spark.core.events)--> host --StreamOpen/...--> streamer
    streamer --RequestOutput--> handler;  handler (gone) --Cancel--> host --> core

The host talks to its core (in a thread, or in the engine process) in the messages
at the end of this module; they cross a pipe as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING

import attrs

from spark.core.events import CoreMetrics, Event
from spark.core.grammar import GrammarSpec
from spark.core.scheduler import PrefixPin
from spark.engine.sampling import SamplingParams
from spark.serve_config import ServeConfig

if TYPE_CHECKING:
    import trio


@attrs.frozen
class GenerateRequest:
    """One generation, as the HTTP layer asks for it (``n`` > 1 is n requests)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first match
    api_key: str | None = None  # for rate limiting; None when keys are not configured
    skip_special_tokens: bool = True
    pins: tuple[PrefixPin, ...] = ()  # prefixes to keep cached after it ends (a stored Response, cache_control)
    grammar: GrammarSpec | None = None  # what the output must follow (a JSON schema, a forced tool call)
    speculative: bool = True  # False: never speculates, whatever the server's ``speculative`` says
    tbt_s: float | None = None  # its time-between-tokens target (SLAI); None: the server's ``tbt_deadline_ms``


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
    # when logprobs were asked for: those of the tokens whose text begins in this piece (``streamer``
    # holds them with held text), none of a matched stop string's nor of the token the engine stopped on
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "error" on the last piece
    stop_string: str | None = None  # the stop string that matched, if one did
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # generated so far, this piece included
    error: str | None = None  # why the request failed, when finish_reason == "error"
    num_cached_tokens: int = 0  # of the prompt's tokens, those found in the prefix cache (not computed)
    # on the first piece, when ``params.prompt_logprobs`` asked: the prompt's tokens after the first, scored
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @classmethod
    def merge(cls, pieces: Sequence[RequestOutput]) -> RequestOutput:
        """One piece that says what consecutive ``pieces`` of one request say, in order.

        Texts, token ids and logprobs are joined; how it ended (finish reason, stop string,
        error) and the output count come from the last piece; prompt logprobs from the first.

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
            num_output_tokens=last.num_output_tokens, error=last.error, num_cached_tokens=last.num_cached_tokens,
            prompt_logprobs=pieces[0].prompt_logprobs,
        )


# -- between actors -----------------------------------------------------------


@attrs.frozen
class Cancel:
    """The request's client went away (or a stop string ended it): free its pages."""

    request_id: str


@attrs.frozen
class Unpin:
    """Server -> core: the prefix pinned under ``key`` need not stay (its stored Response was deleted)."""

    key: str


@attrs.frozen
class Submission:
    """A request accepted by the ingress, with the channel its pieces go to."""

    request: GenerateRequest
    out: "trio.MemorySendChannel[RequestOutput]"
    arrival: float  # trio.current_time() at acceptance


@attrs.frozen
class StreamOpen:
    """Host -> streamer: a request starts; its tokens (``TokenBatch``) follow, or a ``Failed``."""

    submission: Submission


# -- between the host and its core (a thread's queue, or the engine process's pipe) --------------


@attrs.frozen
class Admit:
    """Host -> core: a request leaves the server's queue for the core's."""

    request: GenerateRequest
    waited: float  # seconds since it was accepted: the core's clock is not the server's


@attrs.frozen
class Out:
    """Core -> host: what one turn of the core loop said, and its metrics then."""

    events: tuple[Event, ...]
    metrics: CoreMetrics


@attrs.frozen
class Session:
    """Server -> engine process: serve requests with these limits and policy until ``EndSession``."""

    config: ServeConfig


@attrs.frozen
class EndSession:
    pass


@attrs.frozen
class SessionEnded:
    pass


@attrs.frozen
class EngineFacts:
    """Engine process -> server, once loaded: what admission needs to know of the engine."""

    vocab_size: int
    max_model_len: int
    num_pages: int
    page_size: int


@attrs.frozen
class LoadFailure:
    """Engine process -> server: the model did not load."""

    message: str
    load_error: bool = False  # a ModelLoadError: the message is the one line to show
