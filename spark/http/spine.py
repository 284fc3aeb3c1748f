"""The spine of the generating APIs: what OpenAI chat/completions, Anthropic Messages and Responses share.

A generating route is declared with ``gateway.generates``, which routes the body's model through
the slot (switching, proxying, usage logging) and hands the route a ``Serving``. Each API module
then maps its wire format onto the same steps:

    params = sampling_params(serving.limits, given, max_tokens=...)     # spark.http.params: defaults merged
    turn, stage = await fit_turn(serving, messages, max_tokens=..., **turn_kwargs)   # compacted to fit
    job = build_job(...) or single_job(...)                             # max_tokens capped to the room left
    fanin = await submit(serving, job)                                  # refusals as ApiError
    async for choice, piece, events in turn_steps(fanin, parsers): ...  # spark.http.turn: how streams are read
    return sse(chunks, stage) or answer(body, stage)                    # the compaction stage told, both ways
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import attrs
import trio
from quart import Response, g, request

from spark.actors.ingress import SubmitError
from spark.control.activity import Tally
from spark.control.served import ServedModel
from spark.http.compaction import answer_reserve, prepare_fitting_turn
from spark.http.errors import ApiError
from spark.http.fanin import FanIn, Generations
from spark.http.formatting import SSE_HEADERS
from spark.http.params import Job, Limits
from spark.http.schemas import read_json, structure_body
from spark.http.turn import PreparedTurn, chat_format, prepare_turn

T = TypeVar("T")
COMPACTION_HEADER = "X-Spark-Compaction"
# A body larger than this is decoded in a worker thread: a 1.4 MB logit_bias, or 100,000 messages,
# took the event loop (and every other request's stream) for a second.
OFF_LOOP_BYTES = 64 << 10


@attrs.frozen
class Serving:
    """What a generating route is handed: the model that serves this request, fixed when it was routed."""

    model: ServedModel
    limits: Limits
    tally: Tally | None  # the request's activity line (None: not logged)
    generations: Generations  # where its streams live: no longer than the request


async def json_body() -> Any:
    """The request body's JSON, read once per request (the gateway reads the model from it, the
    route the rest), decoded off the event loop when the body is large.

    Raises:
        ApiError: 400 ``invalid_json`` (``schemas.read_json``), each time it is asked for.
    """
    if "json_body" not in g:
        raw = await request.get_data()
        try:
            g.json_body = read_json(raw) if len(raw) <= OFF_LOOP_BYTES else await trio.to_thread.run_sync(read_json, raw)
        except ApiError as exc:
            g.json_body = exc
    if isinstance(g.json_body, ApiError):
        raise g.json_body
    return g.json_body


async def request_body(cls: type) -> Any:
    """The request body as ``cls`` (``schemas.structure_body``), off the event loop when it is large.

    Raises:
        ApiError: 400 for a body that is not JSON or not a ``cls``.
    """
    return await off_loop(structure_body, await json_body(), cls)


async def optional_request_body(cls: type) -> Any:
    """``request_body``, an empty body read as ``{}`` (the routes whose every field is optional)."""
    if not (await request.get_data()).strip():
        return structure_body({}, cls)
    return await request_body(cls)


async def off_loop(fn: Callable[..., T], *args) -> T:
    """``fn(*args)``: in a worker thread when the request's body is large (its work grows with it),
    else at once (a thread hop costs more than a small body's work)."""
    if request.content_length is not None and request.content_length <= OFF_LOOP_BYTES:
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args)


def not_ready() -> ApiError:
    return ApiError(503, "the server is not ready: the model is loading (or the engine failed)", code="not_ready",
                    retry_after=1)


async def fit_turn(serving: Serving, messages: Sequence[dict], *, max_tokens: int | None, compact: bool = True,
                   **turn_kwargs) -> tuple[PreparedTurn, str | None]:
    """``prepare_turn`` off the event loop, compacted (``spark.http.compaction``) to leave the answer room.

    Args:
      max_tokens: what the request asks for (None: the server's default); the room kept is capped.
      compact: False renders the messages as sent (``render_turn``): a prompt that leaves no room
        is then refused when its job is built (``params.room_left``).
      turn_kwargs: tools, tool choice and thinking, as ``prepare_turn`` takes them.

    Returns:
      ``(turn, stage)``: stage is None, or the compaction stage applied.
    """
    if not compact:
        return await render_turn(serving, messages, **turn_kwargs), None
    model, limits = serving.model, serving.limits
    reserve = answer_reserve(limits.max_model_len, max_tokens, limits.default_max_tokens)
    render = functools.partial(prepare_fitting_turn, model.tokenizer, chat_format(model.config, model.tokenizer),
                               messages, max_model_len=limits.max_model_len, reserve=reserve, **turn_kwargs)
    return await trio.to_thread.run_sync(render)


async def render_turn(serving: Serving, messages: Sequence[dict], **turn_kwargs) -> PreparedTurn:
    """``prepare_turn`` off the event loop, as sent: never compacted, whatever its length (what a count
    of the prompt measures, and what a request that refuses compaction is served or refused as)."""
    model = serving.model
    render = functools.partial(prepare_turn, model.tokenizer, chat_format(model.config, model.tokenizer), messages,
                               **turn_kwargs)
    return await trio.to_thread.run_sync(render)


async def submit(serving: Serving, job: Job) -> FanIn:
    """Submit the job's choices; their pieces are read from the returned fan-in, which the request owns."""
    fanin = await submit_job(serving.model, job, serving.generations.nursery, tally=serving.tally)
    return serving.generations.own(fanin)


async def submit_job(model: ServedModel, job: Job, nursery: trio.Nursery, *, tally: Tally | None = None) -> FanIn:
    """Submit every choice and start reading them (pumps in ``nursery``); ``tally`` counts their tokens.

    Raises:
        ApiError: the model refused the choices (all of them: they are admitted together).
    """
    try:
        streams = model.submit_all(job.requests)
    except SubmitError as exc:
        raise ApiError.refused(exc) from None
    if tally is not None:
        for r in job.requests:
            tally.add_prompt(r.prompt_ids)
    return await FanIn.start(nursery, streams, tally=tally)


def stage_headers(stage: str | None) -> dict[str, str]:
    return {COMPACTION_HEADER: stage} if stage else {}


def with_stage(body: dict, stage: str | None) -> dict:
    """A response object that says which compaction stage its prompt went through, if any."""
    return {**body, "spark_compaction": stage} if stage else body


def answer(body: dict, stage: str | None) -> tuple[dict, int, dict[str, str]]:
    """A non-streamed answer: the body and the header both name the compaction stage."""
    return with_stage(body, stage), 200, stage_headers(stage)


def sse(chunks: AsyncIterator[bytes], stage: str | None = None) -> Response:
    """A streamed answer; the header names the compaction stage (the body is sent as it comes)."""
    response = Response(chunks, content_type="text/event-stream", headers=SSE_HEADERS | stage_headers(stage))
    response.timeout = None  # a stream lasts as long as the generation
    return response
