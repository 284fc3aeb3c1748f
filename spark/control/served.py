"""What the HTTP layer serves: one model behind ``submit``, and the facts its routes check requests against.

``LocalModel`` (a spark-engine recipe loaded in this process) is the one implementation;
the routes hold this protocol, so that what they may use is written down here and nowhere else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

from spark.actors.messages import GenerateRequest, RequestOutput
from spark.engine.tokenizer import Tokenizer
from spark.metrics import Metrics
from spark.serve_config import ServeConfig


class GenerationStream(Protocol):
    """The pieces of one generation (``RequestStream``'s surface): leaving it early cancels the generation."""

    request_id: str

    async def __aenter__(self) -> GenerationStream: ...

    async def __aexit__(self, *exc) -> None: ...

    async def aclose(self) -> None:
        """Leave the stream now (cancelling the generation if it still runs); safe to call twice."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...


class ServedModel(Protocol):
    """A model the routes generate with."""

    @property
    def served_name(self) -> str:
        """The name clients see (``model`` in every response)."""

    @property
    def config(self) -> ServeConfig:
        """The server's settings with the recipe's applied (chat format, default max_tokens, ...)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens, at most."""

    @property
    def vocab_size(self) -> int:
        """Token ids a request may name (in a prompt or a logit bias) lie below it."""

    @property
    def sampling_defaults(self) -> Mapping[str, float]:
        """The recipe's sampling fields, for those a request leaves out."""

    @property
    def metrics(self) -> Metrics: ...

    @property
    def ready(self) -> bool:
        """Whether it admits requests (its preflight passed, and no switch has begun)."""

    def new_request_id(self, prefix: str = "req") -> str: ...

    def submit_all(self, requests: Sequence[GenerateRequest]) -> list[GenerationStream]:
        """Queue the ``n`` choices of one API request together: one request to the rate limiter,
        all queued or none.

        Raises:
            SubmitError: refused (400 too long, 429 rate limited, 503 queue full or switching).
        """

    def unpin(self, key: str) -> None:
        """End the prefix pin under ``key`` (``GenerateRequest.pin``) now; unknown keys are ignored."""

    def submit(self, request: GenerateRequest) -> GenerationStream:
        """Queue ``request``.

        Raises:
            SubmitError: refused (400 too long, 429 rate limited, 503 queue full or switching).
        """
