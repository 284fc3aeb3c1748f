"""The OpenAI-compatible routes: health, models, metrics, chat completions, completions."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator

import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Blueprint, Response, current_app, g, request

from spark.actors.system import SubmitError
from spark.http.compaction import answer_reserve, prepare_fitting_turn
from spark.http import formatting as fmt
from spark.http.errors import ApiError
from spark.http.fanin import FanIn, StreamFailed
from spark.http.params import MODEL_ALIAS, Job, base_params, build_job, chat_turn, check_model, encode_prompts, logprobs_k
from spark.http.schemas import ChatRequest, CompletionRequest, parse_body
from spark.http.turn import ContentDelta, ReasoningDelta, TurnDone, TurnParser, chat_format

bp = Blueprint("openai", __name__)


def _state():
    return current_app.extensions["spark"]


def _system():
    system = _state().system
    if system is None:
        raise ApiError(503, "the server is not ready: the model is loading (or the engine failed)",
                       code="not_ready", retry_after=1)
    return system


@bp.get("/health")
async def health():
    system = _state().system
    if system is None or not system.ready:
        raise ApiError(503, "not ready", code="not_ready", retry_after=1)
    return {"status": "ok"}


@bp.get("/metrics")
async def metrics():
    return Response(generate_latest(_system().metrics.registry), content_type=CONTENT_TYPE_LATEST)


def _slot():
    slot = _state().slot
    if slot is None:
        _system()  # start-up has not run: 503
    return slot


@bp.get("/v1/models")
async def list_models():
    """Every registered model name (served names and aliases) with its state: active, loading, available..."""
    return {"object": "list", "data": _slot().model_cards(_state().started_at)}


@bp.get("/v1/models/<path:name>")
async def get_model(name: str):
    card = _slot().model_card(name, _state().started_at)
    if card is None:
        if name == MODEL_ALIAS:
            _system()  # no model is active: 503
        raise ApiError(404, f"model {name!r} does not exist", param="model", code="model_not_found")
    return card


@bp.post("/v1/chat/completions")
async def chat_completions():
    system, limits = _system(), _state().limits
    req = parse_body(await request.get_data(), ChatRequest)
    check_model(req.model, limits.served_name)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = base_params(req, limits, max_tokens=max_tokens, logprobs=logprobs_k(req))
    writes = chat_format(system.config, system.tokenizer)  # the served model's tool-call and reasoning format
    kwargs = chat_turn(req)  # compacted to leave room for the answer (spark.http.compaction): stage in a header
    reserve = answer_reserve(limits.max_model_len, max_tokens, limits.default_max_tokens)
    turn, stage = await trio.to_thread.run_sync(functools.partial(
        prepare_fitting_turn, system.tokenizer, writes, kwargs.pop("messages"), max_model_len=limits.max_model_len,
        reserve=reserve, **kwargs))
    compaction = {"X-Spark-Compaction": stage} if stage else {}
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    job = build_job(rid, req, [turn.prompt.prompt_ids], turn.sampling(params), limits, api_key=g.api_key)
    parsers = [turn.parser() for _ in job.requests]
    head = {"id": rid, "created": int(time.time()), "model": limits.served_name}
    fanin = await submit_job(system, job, current_app.nursery)
    if job.stream:
        response = _sse(_chat_events(head, job, fanin, parsers))
        response.headers.update(compaction)
        return response
    dones, logprobs = await _collect_turns(job, fanin, parsers)
    choices = [fmt.chat_choice(i, fmt.chat_message(done.result, reasoning=parsers[i].reasoning), done.finish_reason,
                               logprobs[i]) for i, done in enumerate(dones)]
    return {**head, "object": "chat.completion", "choices": choices,
            "usage": fmt.usage(job.prompt_tokens, sum(d.usage.completion_tokens for d in dones))} | (
        {"spark_compaction": stage} if stage else {}), 200, compaction


@bp.post("/v1/completions")
async def completions():
    system, limits = _system(), _state().limits
    req = parse_body(await request.get_data(), CompletionRequest)
    check_model(req.model, limits.served_name)
    if req.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    params = base_params(req, limits, max_tokens=req.max_tokens, logprobs=logprobs_k(req))
    prompts = await trio.to_thread.run_sync(encode_prompts, system.tokenizer, req, limits.vocab_size)
    rid = f"cmpl-{uuid.uuid4().hex}"
    job = build_job(rid, req, prompts, params, limits, api_key=g.api_key)
    head = {"id": rid, "created": int(time.time()), "model": limits.served_name}
    fanin = await submit_job(system, job, current_app.nursery)
    if job.stream:
        return _sse(_completion_events(head, job, fanin))
    texts, logprobs, reasons, completion_tokens = await _collect(job, fanin)
    choices = [fmt.completion_choice(i, texts[i], reasons[i],
                                     None if logprobs[i] is None else fmt.completion_logprobs(logprobs[i]))
               for i in range(len(texts))]
    return {**head, "object": "text_completion", "choices": choices,
            "usage": fmt.usage(job.prompt_tokens, completion_tokens)}


# -- generation ---------------------------------------------------------------------


async def submit_job(system, job: Job, nursery: trio.Nursery) -> FanIn:
    """Submit every choice and start reading them (pumps in ``nursery``).

    Raises:
        ApiError: the system refused a choice (those already submitted are cancelled).
    """
    streams = []
    try:
        for r in job.requests:
            streams.append(system.submit(r))
    except SubmitError as exc:
        with trio.CancelScope(shield=True):
            for stream in streams:
                async with stream:  # entering and leaving a stream cancels its request
                    pass
        raise ApiError(exc.status, exc.message, code=exc.code, retry_after=exc.retry_after) from None
    return await FanIn.start(nursery, streams)


def _sse(events: AsyncIterator[bytes]) -> Response:
    response = Response(events, content_type="text/event-stream", headers=fmt.SSE_HEADERS)
    response.timeout = None  # a stream lasts as long as the generation
    return response


def _failed(piece) -> ApiError:
    return ApiError(500, f"generation failed: {piece.error or 'unknown error'}", code="generation_failed")


async def _collect(job: Job, fanin: FanIn):
    """Wait for every choice; returns per choice its text, logprobs (or None), finish reason; and the token count."""
    n = len(job.requests)
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs = [[] if r.params.logprobs is not None else None for r in job.requests]
    reasons: list[str | None] = [None] * n
    completion_tokens = 0
    try:
        async for i, piece in fanin:
            if piece.finish_reason == "error":
                raise _failed(piece)
            texts[i].append(piece.text)
            if logprobs[i] is not None:
                logprobs[i].extend(piece.logprobs)
            if piece.finish_reason is not None:
                reasons[i] = piece.finish_reason
                completion_tokens += piece.num_output_tokens
    except StreamFailed as exc:
        raise ApiError(500, f"generation failed: {exc}", code="generation_failed") from None
    finally:
        fanin.close()
    return ["".join(t) for t in texts], logprobs, reasons, completion_tokens


async def _collect_turns(job: Job, fanin: FanIn, parsers: list[TurnParser]):
    """Wait for every choice's ``TurnDone``; returns them and per choice its logprobs (or None).

    Raises:
        ApiError: a choice failed, or broke its tool choice.
    """
    dones: list[TurnDone | None] = [None] * len(parsers)
    logprobs = [[] if r.params.logprobs is not None else None for r in job.requests]
    try:
        async for i, piece in fanin:
            if logprobs[i] is not None:
                logprobs[i].extend(piece.logprobs)
            for event in parsers[i].step(piece):
                if isinstance(event, TurnDone):
                    if event.error is not None:
                        raise event.error
                    dones[i] = event
    except StreamFailed as exc:
        raise ApiError(500, f"generation failed: {exc}", code="generation_failed") from None
    finally:
        fanin.close()
    return dones, logprobs


async def _chat_events(head: dict, job: Job, fanin: FanIn, parsers: list[TurnParser]) -> AsyncIterator[bytes]:
    """The chunks of a streamed chat completion; an error is an ``{"error"}`` event, then ``[DONE]``.

    The events of one piece go out in one write, and the last piece's with the usage and ``[DONE]``.
    """
    if job.include_usage:
        head = {**head, "usage": None}  # as OpenAI: every chunk has the key, only the last a value
    completion_tokens, ended = 0, 0
    text_chunks = {(i, kind): fmt.sse_template(fmt.chat_chunk(head, i, fmt.chat_delta(kind(fmt.SLOT))))
                   for i in range(len(job.requests)) for kind in (ContentDelta, ReasoningDelta)}
    out: list[bytes] = []
    try:
        yield b"".join(fmt.sse(fmt.chat_chunk(head, i, {"role": "assistant", "content": ""}))
                       for i in range(len(job.requests)))
        async for i, piece in fanin:
            events = parsers[i].step(piece)
            done = events.pop() if events and isinstance(events[-1], TurnDone) else None
            if done is not None and done.error is not None:
                yield b"".join(out) + fmt.sse(done.error.body()) + fmt.SSE_DONE
                return
            logprobs = piece.logprobs if job.requests[i].params.logprobs is not None else None
            if logprobs and not events:  # the piece's text is held back, its tokens are not
                events = [ContentDelta("")]
            for k, event in enumerate(events):
                fill = text_chunks.get((i, type(event))) if not (logprobs and k == 0) else None
                if fill is not None:
                    out.append(fill(event.text))
                else:
                    out.append(fmt.sse(fmt.chat_chunk(head, i, fmt.chat_delta(event),
                                                      logprobs=logprobs if k == 0 else None)))
            if done is not None:
                completion_tokens += done.usage.completion_tokens
                ended += 1
                out.append(fmt.sse(fmt.chat_chunk(head, i, {}, finish_reason=done.finish_reason)))
            if out and ended < len(parsers):
                yield b"".join(out)
                out.clear()
        if job.include_usage:
            out.append(fmt.sse({**head, "object": "chat.completion.chunk", "choices": [],
                                "usage": fmt.usage(job.prompt_tokens, completion_tokens)}))
        yield b"".join(out) + fmt.SSE_DONE
    except StreamFailed as exc:
        yield b"".join(out) + fmt.sse(ApiError(500, f"generation failed: {exc}", code="generation_failed").body()) \
            + fmt.SSE_DONE
    finally:
        fanin.close()


async def _completion_events(head: dict, job: Job, fanin: FanIn) -> AsyncIterator[bytes]:
    """The chunks of a streamed completion: one write per piece, the last with the usage and ``[DONE]``."""
    head = {**head, "object": "text_completion"} | ({"usage": None} if job.include_usage else {})
    offsets = [0] * len(job.requests)  # text_offset of each choice's next token
    text_chunks = [fmt.sse_template({**head, "choices": [fmt.completion_choice(i, fmt.SLOT, None, None)]})
                   for i in range(len(job.requests))]
    completion_tokens, ended = 0, 0
    out: list[bytes] = []
    try:
        async for i, piece in fanin:
            if piece.finish_reason == "error":
                yield b"".join(out) + fmt.sse(_failed(piece).body())
                return
            if job.requests[i].params.logprobs is not None:
                logprobs = fmt.completion_logprobs(piece.logprobs, offsets[i])
                offsets[i] += sum(len(lp.token) for lp in piece.logprobs)
                if piece.text or piece.logprobs:
                    out.append(fmt.sse({**head, "choices": [fmt.completion_choice(i, piece.text, None, logprobs)]}))
            elif piece.text:
                out.append(text_chunks[i](piece.text))
            if piece.finish_reason is not None:
                completion_tokens += piece.num_output_tokens
                ended += 1
                out.append(fmt.sse({**head, "choices": [fmt.completion_choice(i, "", piece.finish_reason, None)]}))
            if out and ended < len(job.requests):
                yield b"".join(out)
                out.clear()
        if job.include_usage:
            out.append(fmt.sse({**head, "choices": [], "usage": fmt.usage(job.prompt_tokens, completion_tokens)}))
        yield b"".join(out) + fmt.SSE_DONE
    except StreamFailed as exc:
        yield b"".join(out) + fmt.sse(ApiError(500, f"generation failed: {exc}", code="generation_failed").body())
    finally:
        fanin.close()
