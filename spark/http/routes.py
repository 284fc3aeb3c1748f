"""The OpenAI-compatible routes: health, models, metrics, chat completions, completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import attrs
import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Blueprint, Response, current_app, g

from spark.actors.messages import RequestOutput, TokenLogprob
from spark.control.served import ServedModel
from spark.control.slot import Slot
from spark.http import formatting as fmt
from spark.http import spine
from spark.http.errors import ApiError
from spark.http.fanin import FanIn, StreamFailed
from spark.http.gateway import generates
from spark.http.params import (Echo, Job, base_params, build_job, chat_turn, completion_params, echoes,
                               encode_prompts, logprobs_k, scores_only)
from spark.http.schemas import ChatRequest, CompletionRequest
from spark.http.spine import Serving, request_body
from spark.http.turn import ContentDelta, ReasoningDelta, TurnDone, TurnParser, turn_steps
from spark.recipes.schema import RESERVED_NAMES

bp = Blueprint("openai", __name__)


def _state():
    return current_app.extensions["spark"]


def _model() -> ServedModel:
    model = _state().system
    if model is None:
        raise spine.not_ready()
    return model


@bp.get("/health")
async def health():
    model = _state().system
    if model is None or not model.ready:
        raise ApiError(503, "not ready", code="not_ready", retry_after=1)
    return {"status": "ok"}


@bp.get("/metrics")
async def metrics():
    return Response(generate_latest(_model().metrics.registry), content_type=CONTENT_TYPE_LATEST)


def _slot() -> Slot:
    slot = _state().slot
    if slot is None:
        _model()  # start-up has not run: 503
    return slot


@bp.get("/v1/models")
async def list_models():
    """Every registered model name (served names and aliases) with its state: active, loading, available..."""
    cards = _slot().model_cards(_state().started_at)
    # Anthropic's list fields beside OpenAI's (one page: every model)
    return {"object": "list", "data": cards, "has_more": False, "first_id": cards[0]["id"] if cards else None,
            "last_id": cards[-1]["id"] if cards else None}


@bp.get("/v1/models/<path:name>")
async def get_model(name: str):
    card = _slot().model_card(name, _state().started_at)
    if card is None:
        if name in RESERVED_NAMES:
            _model()  # no model is active: 503
        raise ApiError(404, f"model {name!r} does not exist", param="model", code="model_not_found")
    return card


@generates(bp, "/v1/chat/completions")
async def chat_completions(serving: Serving):
    limits = serving.limits
    req = await request_body(ChatRequest)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params, kwargs = await spine.off_loop(_chat_inputs, req, limits, max_tokens)
    turn, stage = await spine.fit_turn(serving, kwargs.pop("messages"), max_tokens=max_tokens, **kwargs)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    job = build_job(rid, req, [turn.prompt.prompt_ids], turn.sampling(params), limits, api_key=g.api_key,
                    grammar=turn.grammar)
    parsers = [turn.parser() for _ in job.requests]
    head = {"id": rid, "created": int(time.time()), "model": limits.served_name}
    fanin = await spine.submit(serving, job)
    if job.stream:
        return spine.sse(_chat_events(head, job, fanin, parsers), stage)
    dones, logprobs = await _collect_turns(job, fanin, parsers)
    choices = [fmt.chat_choice(i, fmt.chat_message(done.result, reasoning=parsers[i].reasoning), done.finish_reason,
                               logprobs[i]) for i, done in enumerate(dones)]
    return spine.answer({**head, "object": "chat.completion", "choices": choices,
                         "usage": fmt.usage(job.prompt_tokens, sum(d.usage.completion_tokens for d in dones),
                                            max(d.usage.cached_tokens for d in dones))}, stage)


def _chat_inputs(req: ChatRequest, limits, max_tokens: int | None) -> tuple:
    """The request's sampling parameters and ``prepare_turn`` arguments (work that grows with the body)."""
    return base_params(req, limits, max_tokens=max_tokens, logprobs=logprobs_k(req)), chat_turn(req)


@generates(bp, "/v1/completions")
async def completions(serving: Serving):
    limits = serving.limits
    req = await request_body(CompletionRequest)
    params = await spine.off_loop(completion_params, req, limits)
    prompts = await trio.to_thread.run_sync(encode_prompts, serving.model.tokenizer, req, limits.vocab_size)
    rid = f"cmpl-{uuid.uuid4().hex}"
    job = build_job(rid, req, prompts, params, limits, api_key=g.api_key)
    # echo: each choice's text (and logprobs) starts with its prompt's
    echo = await trio.to_thread.run_sync(echoes, serving.model.tokenizer, req, prompts) if req.echo else None
    head = {"id": rid, "created": int(time.time()), "model": limits.served_name}
    fanin = await spine.submit(serving, job)
    if job.stream:
        return spine.sse(_completion_events(head, job, fanin, echo, scores_only(req)))
    texts, logprobs, reasons, completion_tokens, cached, scored = await _collect(job, fanin, scores_only(req))
    choices = []
    for i, text in enumerate(texts):
        before = echo[i].text if echo is not None else ""  # the generated tokens' offsets start past the echo
        lp = None if logprobs[i] is None else fmt.completion_logprobs(
            logprobs[i], fmt.TextOffsets(len(before)), len(before) + len(text))
        choices.append(fmt.completion_choice(i, text, reasons[i], lp))
    if echo is not None:
        choices = [_echoed(choice, echo[i], scored[i]) for i, choice in enumerate(choices)]
    return {**head, "object": "text_completion", "choices": choices,
            "usage": fmt.usage(job.prompt_tokens, completion_tokens, cached)}


def _echoed(choice: dict, echo: Echo, scored: tuple[TokenLogprob, ...] | None) -> dict:
    """A whole completion choice with its prompt echoed before its text (and its tokens, ``scored``, before
    its logprobs)."""
    logprobs = choice["logprobs"]
    if logprobs is not None:
        logprobs = fmt.echoed_logprobs(echo.tokens, echo.text, scored, logprobs)
    return {**choice, "text": echo.text + choice["text"], "logprobs": logprobs}


# -- generation ---------------------------------------------------------------------


async def _text_pieces(fanin: FanIn) -> AsyncIterator[tuple[int, RequestOutput]]:
    """A completion's pieces; one that failed is raised as ``ApiError`` (500 generation_failed)."""
    try:
        async for i, piece in fanin:
            if piece.finish_reason == "error":
                raise ApiError.generation_failed(piece.error or "unknown error")
            yield i, piece
    except StreamFailed as exc:
        raise ApiError.generation_failed(str(exc)) from None


async def _collect(job: Job, fanin: FanIn, only_scores: bool = False):
    """Wait for every choice; returns per choice its text, logprobs (or None), finish reason; the token count,
    the cached tokens, and per choice its prompt's logprobs (or None). ``only_scores``: the generated token
    is left out (``scores_only``)."""
    n = len(job.requests)
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs = [[] if r.params.logprobs is not None else None for r in job.requests]
    reasons: list[str | None] = [None] * n
    scored: list[tuple[TokenLogprob, ...] | None] = [None] * n
    completion_tokens = cached = 0
    try:
        async with aclosing(_text_pieces(fanin)) as pieces:
            async for i, piece in pieces:
                if piece.prompt_logprobs is not None:
                    scored[i] = piece.prompt_logprobs
                if only_scores:
                    piece = _unsampled(piece)
                texts[i].append(piece.text)
                if logprobs[i] is not None:
                    logprobs[i].extend(piece.logprobs)
                if piece.finish_reason is not None:
                    reasons[i] = piece.finish_reason
                    completion_tokens += piece.num_output_tokens
                    cached = max(cached, piece.num_cached_tokens)  # (choices of one prompt: the best hit)
    finally:
        fanin.close()
    return ["".join(t) for t in texts], logprobs, reasons, completion_tokens, cached, scored


def _usage_so_far(job: Job, piece: RequestOutput) -> dict:
    """``{"usage": ...}`` of a piece's choice so far when the stream asked for continuous usage (vLLM's
    ``continuous_usage_stats``: a client counts the tokens each chunk carries), else nothing."""
    if not job.continuous_usage:
        return {}
    return {"usage": fmt.usage(piece.num_prompt_tokens, piece.num_output_tokens, piece.num_cached_tokens)}


def _unsampled(piece: RequestOutput) -> RequestOutput:
    """A piece of a ``scores_only`` request without its generated token: it ends by length, having made none."""
    return attrs.evolve(piece, text="", token_ids=(), logprobs=(), num_output_tokens=0,
                        finish_reason=None if piece.finish_reason is None else "length", stop_string=None)


async def _collect_turns(job: Job, fanin: FanIn, parsers: list[TurnParser]):
    """Wait for every choice's ``TurnDone``; returns them and per choice its logprobs (or None).

    Raises:
        ApiError: a choice failed, or broke its tool choice.
    """
    dones: list[TurnDone | None] = [None] * len(parsers)
    logprobs = [[] if r.params.logprobs is not None else None for r in job.requests]
    try:
        async with aclosing(turn_steps(fanin, parsers)) as steps:
            async for i, piece, events in steps:
                if piece is not None and logprobs[i] is not None:
                    logprobs[i].extend(piece.logprobs)
                if events and isinstance(events[-1], TurnDone):
                    if events[-1].error is not None:
                        raise events[-1].error
                    dones[i] = events[-1]
    finally:
        fanin.close()
    return dones, logprobs


async def _chat_events(head: dict, job: Job, fanin: FanIn, parsers: list[TurnParser]) -> AsyncIterator[bytes]:
    """The chunks of a streamed chat completion; an error is an ``{"error"}`` event, then ``[DONE]``.

    The events of one piece go out in one write, and the last piece's with the usage and ``[DONE]``.
    """
    if job.include_usage:
        head = {**head, "usage": None}  # as OpenAI: every chunk has the key, only the last a value
    completion_tokens, ended, cached = 0, 0, 0
    text_chunks = {(i, kind): fmt.sse_template(fmt.chat_chunk(head, i, fmt.chat_delta(kind(fmt.SLOT))))
                   for i in range(len(job.requests)) for kind in (ContentDelta, ReasoningDelta)}
    out: list[bytes] = []
    try:
        yield b"".join(fmt.sse(fmt.chat_chunk(head, i, {"role": "assistant", "content": ""}))
                       for i in range(len(job.requests)))
        async with aclosing(turn_steps(fanin, parsers)) as steps:
            async for i, piece, events in steps:
                done = events.pop() if events and isinstance(events[-1], TurnDone) else None
                if done is not None and done.error is not None:
                    yield b"".join(out) + fmt.sse(done.error.body()) + fmt.SSE_DONE
                    return
                logprobs = piece.logprobs if job.requests[i].params.logprobs is not None else None
                if logprobs and not events:  # the parser holds its text (a tag's start), not its tokens
                    events = [ContentDelta("")]
                so_far = _usage_so_far(job, piece) if piece is not None else {}
                for k, event in enumerate(events):
                    fill = text_chunks.get((i, type(event))) if not (logprobs and k == 0 or so_far) else None
                    if fill is not None:
                        out.append(fill(event.text))
                    else:
                        out.append(fmt.sse(fmt.chat_chunk(head, i, fmt.chat_delta(event),
                                                          logprobs=logprobs if k == 0 else None) | so_far))
                if done is not None:
                    completion_tokens += done.usage.completion_tokens
                    cached = max(cached, done.usage.cached_tokens)
                    ended += 1
                    last = {"annotations": fmt.url_citations(done.result.citations)} if done.result.citations else {}
                    out.append(fmt.sse(fmt.chat_chunk(head, i, last, finish_reason=done.finish_reason)))
                if out and ended < len(parsers):
                    yield b"".join(out)
                    out.clear()
        if job.include_usage:
            out.append(fmt.sse({**head, "object": "chat.completion.chunk", "choices": [],
                                "usage": fmt.usage(job.prompt_tokens, completion_tokens, cached)}))
        yield b"".join(out) + fmt.SSE_DONE
    finally:
        fanin.close()


async def _completion_events(head: dict, job: Job, fanin: FanIn, echo: list[Echo] | None = None,
                             only_scores: bool = False) -> AsyncIterator[bytes]:
    """The chunks of a streamed completion: one write per piece, the last with the usage and ``[DONE]``;
    with ``echo``, a first chunk per choice holds its prompt (once its first piece brings the prompt's
    logprobs, when scored); ``only_scores``: the generated token is left out (``scores_only``)."""
    head = {**head, "object": "text_completion"} | ({"usage": None} if job.include_usage else {})
    offsets = [fmt.TextOffsets() for _ in job.requests]  # text_offset of each choice's tokens
    sent = [0] * len(job.requests)  # the characters of each choice's text sent so far
    text_chunks = [fmt.sse_template({**head, "choices": [fmt.completion_choice(i, fmt.SLOT, None, None)]})
                   for i in range(len(job.requests))]
    completion_tokens, ended, cached = 0, 0, 0
    out: list[bytes] = []
    unscored = set()  # choices whose echo waits for their prompt's logprobs (on their first piece)
    try:
        if echo is not None:
            for i, prompt in enumerate(echo):
                offsets[i] = fmt.TextOffsets(len(prompt.text))
                sent[i] = len(prompt.text)
                if job.requests[i].params.prompt_logprobs is not None:
                    unscored.add(i)
                else:
                    out.append(fmt.sse({**head, "choices": [fmt.completion_choice(i, prompt.text, None, None)]}))
            if out:
                yield b"".join(out)
                out.clear()
        async with aclosing(_text_pieces(fanin)) as pieces:
            async for i, piece in pieces:
                if i in unscored:
                    unscored.discard(i)
                    out.append(fmt.sse({**head, "choices": [fmt.completion_choice(
                        i, echo[i].text, None, fmt.echoed_logprobs(echo[i].tokens, echo[i].text,
                                                                   piece.prompt_logprobs))]}))
                if only_scores:
                    piece = _unsampled(piece)
                so_far = _usage_so_far(job, piece)
                sent[i] += len(piece.text)
                if job.requests[i].params.logprobs is not None:
                    # held text (a stop string's start) is sent later: only the end bounds the offsets
                    end = sent[i] if piece.finish_reason is not None else None
                    logprobs = fmt.completion_logprobs(piece.logprobs, offsets[i], end)
                    if piece.text or piece.logprobs:
                        out.append(fmt.sse({**head, "choices": [fmt.completion_choice(i, piece.text, None,
                                                                                       logprobs)], **so_far}))
                elif piece.text:
                    out.append(text_chunks[i](piece.text) if not so_far else fmt.sse(
                        {**head, "choices": [fmt.completion_choice(i, piece.text, None, None)], **so_far}))
                if piece.finish_reason is not None:
                    completion_tokens += piece.num_output_tokens
                    cached = max(cached, piece.num_cached_tokens)
                    ended += 1
                    out.append(fmt.sse({**head, "choices": [fmt.completion_choice(i, "", piece.finish_reason,
                                                                                   None)]}))
                if out and ended < len(job.requests):
                    yield b"".join(out)
                    out.clear()
        if job.include_usage:
            out.append(fmt.sse({**head, "choices": [], "usage": fmt.usage(job.prompt_tokens, completion_tokens,
                                                                          cached)}))
        yield b"".join(out) + fmt.SSE_DONE
    except ApiError as exc:  # a choice failed: its text so far, then the error, and the stream's end
        yield b"".join(out) + fmt.sse(exc.body()) + fmt.SSE_DONE
    finally:
        fanin.close()
