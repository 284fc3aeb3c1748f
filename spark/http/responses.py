"""OpenAI's Responses and Conversations APIs, their state in SQLite (``spark.state``).

    POST   /v1/responses                       create (streamed or not); stored unless store=false
    GET    /v1/responses/{id}                  DELETE /v1/responses/{id}
    GET    /v1/responses/{id}?stream=true&starting_after=N    a background response's events again
    POST   /v1/responses/{id}/cancel           a background response's generation
    POST   /v1/responses/input_tokens          the prompt's tokens a create would send
    GET    /v1/responses/{id}/input_items
    POST   /v1/conversations                   GET / POST (update) / DELETE /v1/conversations/{id}
    GET    /v1/conversations/{id}/items        POST /v1/conversations/{id}/items
    GET    /v1/conversations/{id}/items/{item_id}    DELETE (answers the conversation, as OpenAI's)

A new turn continues ``previous_response_id`` (its chain's inputs and outputs) or a
``conversation`` (its items, to which the turn's input and output are appended when it ends;
an item deleted from it is gone from what the next turn reads).
What a client is told exists is committed first (``spark.http.response_run``). Every read, list
and delete is scoped to the caller's API key: another key's objects answer 404 as if absent.

``background: true`` answers at once (status in_progress) and generates on in the app's nursery
(``spark.http.background``): the client polls, streams (and resumes the stream), or cancels.

``include=["message.output_text.logprobs"]`` (and ``top_logprobs`` alternatives) gives each output
text, and each of its streamed deltas, the logprobs of the tokens that wrote it (``spark.http.output_tokens``);
without it none are computed.
"""

from __future__ import annotations

import threading
import time

import attrs
import trio
from quart import Blueprint, current_app, g, request

from spark.core.scheduler import PrefixPin
from spark.http import spine
from spark.http.background import RETAIN_S, BackgroundRun, BackgroundRuns
from spark.http.errors import ApiError
from spark.http.gateway import generates, log_when_done
from spark.http.params import Job, logprobs_k, sampling_params, single_job
from spark.http.response_items import (OUTPUT_TEXT_LOGPROBS, CancelRequest, ConversationRequest, ConversationUpdate,
                                       ItemsRequest, ResponsesRequest, chat_messages, chat_tools, check_calls_answered,
                                       check_include, check_metadata, check_new_items, input_items, new_id)
from spark.http.response_run import ResponseRun, sse_event
from spark.http.spine import Serving, request_body
from spark.http.structured import output_schema
from spark.http.turn import ToolChoice, TurnParser, effort_thinking
from spark.state import AsyncStore, Store, owner_of

bp = Blueprint("responses", __name__)


def install(app) -> None:
    """Serve the Responses and Conversations APIs on ``app``; the store opens at first use."""
    app.register_blueprint(bp)
    holder = app.extensions["spark_state"] = _Holder()

    async def start_background() -> None:
        app.extensions["spark_background"] = BackgroundRuns(app.nursery)

    async def stop_background() -> None:  # before the store closes: the runs store their ends
        await app.extensions["spark_background"].close()

    app.before_serving(start_background)
    app.after_serving(stop_background)
    app.after_serving(holder.close)


@attrs.define(eq=False)
class _Holder:
    """The app's store, opened once on first use (so a server that never stores creates no file)."""

    store: AsyncStore | None = None
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def open(self, config) -> AsyncStore:
        with self.lock:
            if self.store is None:
                self.store = AsyncStore(Store(config.state_path, max_age_s=config.state_max_age_s,
                                              max_bytes=config.state_max_bytes))
        return self.store

    async def close(self) -> None:
        if self.store is not None:
            await trio.to_thread.run_sync(self.store.sync.close)
            self.store = None


async def _store() -> AsyncStore:
    holder = current_app.extensions["spark_state"]
    if holder.store is not None:
        return holder.store
    config = current_app.extensions["spark"].config
    try:
        return await trio.to_thread.run_sync(holder.open, config)
    except Exception as exc:
        raise ApiError(500, f"cannot open the state store {config.state_path or '(default path)'}: {exc}",
                       code="state_unavailable") from None


def _owner() -> str:
    return owner_of(g.api_key)


def _not_found(kind: str, oid: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"{kind} {oid!r} not found", param=param, code="not_found")


# -- responses -------------------------------------------------------------------------


@generates(bp, "/v1/responses")
async def create_response(serving: Serving):
    req = await request_body(ResponsesRequest)
    check_include(req.include)
    check_metadata(req.metadata)
    params = sampling_params(serving.limits, {"temperature": req.temperature, "top_p": req.top_p},
                             max_tokens=req.max_output_tokens, param="max_output_tokens", logprobs=logprobs_k(req))
    owner = _owner()
    if req.background and req.store is False:
        raise ApiError(400, "a background response is stored: background=true needs store=true", param="background")
    # store=false needs the store only to read what it continues: a stateless server makes no file
    store = await _store() if req.store is not False or _continues(req) else None
    history, conversation_id, items, messages, turn_kwargs = await _turn_inputs(req, owner, store)
    truncation = _truncation(req.truncation)
    turn, stage = await spine.fit_turn(serving, messages, max_tokens=req.max_output_tokens,
                                       compact=truncation == "auto", **turn_kwargs)
    rid, prompt = new_id("resp"), turn.prompt.prompt_ids
    # what the next turn extends (previous_response_id, the conversation) stays cached a while
    pins = (PrefixPin(rid, serving.model.config.prefix_pin_ttl_s),) if req.store is not False or conversation_id else ()
    job = single_job(rid, prompt, turn.sampling(params), serving.limits, stream=bool(req.stream), api_key=g.api_key,
                     pins=pins, grammar=turn.grammar, speculative=req.speculative, tbt_ms=req.tbt_ms, param="input")
    head = _response_head(rid, req, serving.model.served_name, conversation_id, stage, truncation)
    tokenizer = serving.model.tokenizer
    count = None if tokenizer is None else (lambda text: len(tokenizer.encode(text)))
    run = ResponseRun(head, items, len(prompt), owner, store if req.store is not False else None, conversation_id,
                      store, count_tokens=count)
    if req.background:
        return await _start_background(serving, job, run, turn.parser(), stage)
    fanin = await spine.submit(serving, job)
    if job.stream:
        await run.begin(fanin)
        return spine.sse(run.sse(fanin, turn.parser()), stage)
    final = await run.collect(fanin, turn.parser())
    return final, 200, spine.stage_headers(stage)


@generates(bp, "/v1/responses/input_tokens", logged=False)  # names a model, generates nothing
async def count_input_tokens(serving: Serving):
    """The prompt's tokens that a create with this body would send (OpenAI's ``responses.input_tokens``)."""
    req = await request_body(ResponsesRequest)
    store = await _store() if _continues(req) else None
    _, _, _, messages, turn_kwargs = await _turn_inputs(req, _owner(), store)
    # as rendered, not compacted: a client counts to learn whether it must shorten the input itself
    turn = await spine.render_turn(serving, messages, **turn_kwargs)
    return {"object": "response.input_tokens", "input_tokens": len(turn.prompt.prompt_ids)}


async def _turn_inputs(req: ResponsesRequest, owner: str, store: AsyncStore | None):
    """What a turn renders: the history it continues, its conversation, its new items (checked against
    the history), the chat messages of both, and the rest of ``prepare_turn``'s arguments."""
    history, conversation_id = await _history(req, owner, store)
    items = await spine.off_loop(input_items, req.input)
    if not items and not history:
        raise ApiError(400, "input must hold at least one item", param="input")
    check_new_items(history, items)
    check_calls_answered(history, items)
    enable, budget = effort_thinking((req.reasoning or {}).get("effort"), param="reasoning.effort")
    turn_kwargs = dict(tools=chat_tools(req.tools), tool_choice=_tool_choice(req.tool_choice),
                       parallel_tool_calls=req.parallel_tool_calls is not False, enable_thinking=enable,
                       thinking_budget=budget,
                       output_schema=output_schema((req.text or {}).get("format"), param="text.format"))
    return history, conversation_id, items, chat_messages(req.instructions, history + items), turn_kwargs


async def _start_background(serving: Serving, job: Job, run: ResponseRun, parser: TurnParser, stage: str | None):
    """Submit the job in the app's nursery, store the response, and answer: the response as it is
    now, or the stream of its events (which a hang-up stops following, and nothing more)."""
    runs = _background_runs()
    fanin = await spine.submit_job(serving.model, job, runs.nursery, tally=serving.tally)
    await run.begin(fanin)
    run.background = BackgroundRun(run.owner)
    runs.start(run.head["id"], run.background, run.stream_events(fanin, parser), log_when_done())
    if job.stream:
        return spine.sse(_sse_events(run.background.follow()), stage)
    return run.head, 200, spine.stage_headers(stage)


def _background_runs() -> BackgroundRuns:
    return current_app.extensions["spark_background"]


async def _sse_events(events):
    async for event in events:
        yield sse_event(event)


def _continues(req: ResponsesRequest) -> bool:
    """Whether the turn continues stored items (``_history`` reads the store): a previous response or a
    conversation given at all, even an empty id (a 404, not a turn without history)."""
    return req.previous_response_id is not None or req.conversation is not None


async def _history(req: ResponsesRequest, owner: str, store: AsyncStore | None) -> tuple[list[dict], str | None]:
    """The items a new turn continues, and the conversation it belongs to."""
    if req.previous_response_id is not None and req.conversation is not None:
        raise ApiError(400, "previous_response_id and conversation cannot both be given", param="conversation")
    if req.previous_response_id is not None:
        rid = req.previous_response_id
        previous = await store.get_response(owner, rid)
        if previous is None:
            raise _not_found("previous response", rid, "previous_response_id")
        if previous["status"] == "in_progress":
            raise ApiError(400, f"previous response {rid!r} is still in progress", param="previous_response_id")
        return await store.response_history(owner, rid), None
    if req.conversation is not None:
        cid = req.conversation if isinstance(req.conversation, str) else req.conversation.get("id")
        page = await store.conversation_items(owner, cid) if isinstance(cid, str) else None
        if page is None:
            raise _not_found("conversation", str(cid), "conversation")
        return page[0], cid
    return [], None


def _truncation(truncation: str | None) -> str:
    """``auto`` (compact what outgrows the context) or ``disabled`` (refuse it: 400 context_length_exceeded).
    Omitted, it is ``auto``, not OpenAI's ``disabled``: compaction is what Spark serves every API by default."""
    if truncation not in (None, "auto", "disabled"):
        raise ApiError(400, f"truncation must be auto or disabled, got {truncation!r}", param="truncation")
    return truncation or "auto"


def _tool_choice(choice: str | dict | None) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto")
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        return ToolChoice(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return ToolChoice.named(choice["name"])
    raise ApiError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                   param="tool_choice")


def _response_head(rid: str, req: ResponsesRequest, model: str, conversation_id: str | None,
                   stage: str | None, truncation: str) -> dict:
    """The response object as it is while generating (status in_progress, no output yet)."""
    head = {"id": rid, "object": "response", "created_at": round(time.time(), 3), "status": "in_progress",
            "model": model, "output": [], "error": None, "incomplete_details": None, "usage": None,
            "instructions": req.instructions, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
            "top_p": req.top_p, "top_logprobs": req.top_logprobs, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "store": req.store is not False,
            "conversation": {"id": conversation_id} if conversation_id else None, "metadata": req.metadata or {},
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "text": req.text or {"format": {"type": "text"}}, "truncation": truncation,
            "background": req.background is True,
            "user": req.user}
    return spine.with_stage(head, stage)


@bp.get("/v1/responses/<rid>")
async def get_response(rid: str):
    include = _include_args()
    response = await (await _store()).get_response(_owner(), rid)
    if response is None:
        raise _not_found("response", rid)
    if request.args.get("stream", "false").lower() == "true":
        return spine.sse(_sse_events(_background_run(response).follow(_starting_after())))
    return _shown(response, include)


def _background_run(response: dict) -> BackgroundRun:
    """The run of a background response whose events are still kept.

    Raises:
      ApiError: 400 for a response that is not a background one, or whose events are gone.
    """
    rid = response["id"]
    _check_background(response, "a background response's events can be streamed again; retrieve it without stream",
                      param="stream")
    run = _background_runs().get(_owner(), rid)
    if run is None:
        raise ApiError(400, f"the events of response {rid!r} are no longer kept (they are for "
                            f"{RETAIN_S / 60:.0f} minutes after it ends, and not across a restart); "
                            "retrieve it without stream", param="stream")
    return run


def _check_background(response: dict, only: str, param: str | None = None) -> None:
    """A 400 for a response not created with background=true, saying what ``only`` a background one allows."""
    if not response.get("background"):
        raise ApiError(400, f"response {response['id']!r} was not created with background=true: only {only}",
                       param=param)


def _starting_after() -> int:
    value = request.args.get("starting_after", "-1")
    try:
        return int(value)
    except ValueError:
        raise ApiError(400, f"starting_after must be an integer, got {value!r}", param="starting_after") from None


@bp.post("/v1/responses/<rid>/cancel")
async def cancel_response(rid: str):
    """Cancel a background response's generation (a finished one is answered as it is, as OpenAI's)."""
    await spine.optional_request_body(CancelRequest)  # a 400 for a body that is not an object
    store, owner = await _store(), _owner()
    response = await store.get_response(owner, rid)
    if response is None:
        raise _not_found("response", rid)
    _check_background(response, "a background response can be cancelled")
    if await _background_runs().cancel(owner, rid):
        response = await store.get_response(owner, rid)
    return _shown(response, include=())


def _shown(response: dict, include) -> dict:
    """A stored response as a read shows it: its texts' logprobs only where ``include`` asks for them."""
    if OUTPUT_TEXT_LOGPROBS not in include:  # stored with the text; shown where asked for, as OpenAI's
        response = {**response, "output": [_without_logprobs(item) for item in response.get("output", [])]}
    return response


def _without_logprobs(item: dict) -> dict:
    if item.get("type") != "message":
        return item
    return {**item, "content": [{**part, "logprobs": []} if "logprobs" in part else part
                                for part in item.get("content", [])]}


def _include_args() -> list[str]:
    """A GET's ``include`` values (the SDK sends ``include[]``), checked as a create's."""
    include = request.args.getlist("include[]") + request.args.getlist("include")
    check_include(include)
    return include


@bp.delete("/v1/responses/<rid>")
async def delete_response(rid: str):
    await _background_runs().cancel(_owner(), rid)  # a live one: else its end, stored later, would bring it back
    if not await (await _store()).delete_response(_owner(), rid):
        raise _not_found("response", rid)
    model = current_app.extensions["spark"].system
    if model is not None:
        model.unpin(rid)  # its prefix need not stay cached
    return {"id": rid, "object": "response.deleted", "deleted": True}


@bp.get("/v1/responses/<rid>/input_items")
async def list_input_items(rid: str):
    after, limit, order = _page_args()
    page = await (await _store()).response_input_items(_owner(), rid, after=after, limit=limit, order=order)
    if page is None:
        raise _not_found("response", rid)
    return _list(*page)


def _page_args() -> tuple[str | None, int, str]:
    """A list's ``after``, ``limit`` and ``order``; its ``include`` values (the SDK sends ``include[]``) are
    checked as a create's: what they name is stored with the items already."""
    _include_args()
    args = request.args
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc, got {order!r}", param="order")
    try:
        limit = int(args.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be an integer in [1, 100], got {args.get('limit')!r}", param="limit")
    return args.get("after"), limit, order


def _list(items: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


# -- conversations -----------------------------------------------------------------------


@bp.post("/v1/conversations")
async def create_conversation():
    req = await spine.optional_request_body(ConversationRequest)
    items = input_items(req.items or [], param="items")
    check_new_items((), items, param="items")
    conversation = {"id": new_id("conv"), "object": "conversation", "created_at": int(time.time()),
                    "metadata": check_metadata(req.metadata)}
    await (await _store()).create_conversation(_owner(), conversation, items)
    return conversation


@bp.get("/v1/conversations/<cid>")
async def get_conversation(cid: str):
    conversation = await (await _store()).get_conversation(_owner(), cid)
    if conversation is None:
        raise _not_found("conversation", cid)
    return conversation


@bp.post("/v1/conversations/<cid>")
async def update_conversation(cid: str):
    metadata = check_metadata((await request_body(ConversationUpdate)).metadata)
    conversation = await (await _store()).update_conversation(_owner(), cid, metadata)
    if conversation is None:
        raise _not_found("conversation", cid)
    return conversation


@bp.delete("/v1/conversations/<cid>")
async def delete_conversation(cid: str):
    if not await (await _store()).delete_conversation(_owner(), cid):
        raise _not_found("conversation", cid)
    return {"id": cid, "object": "conversation.deleted", "deleted": True}


@bp.get("/v1/conversations/<cid>/items")
async def list_conversation_items(cid: str):
    after, limit, order = _page_args()
    page = await (await _store()).conversation_items(_owner(), cid, after=after, limit=limit, order=order)
    if page is None:
        raise _not_found("conversation", cid)
    return _list(*page)


@bp.post("/v1/conversations/<cid>/items")
async def add_conversation_items(cid: str):
    items = input_items((await request_body(ItemsRequest)).items, param="items")
    store = await _store()
    page = await store.conversation_items(_owner(), cid)
    if page is None:
        raise _not_found("conversation", cid)
    check_new_items(page[0], items, param="items")
    if not await store.append_conversation_items(_owner(), cid, items):
        raise _not_found("conversation", cid)
    return _list(items, False)


@bp.get("/v1/conversations/<cid>/items/<item_id>")
async def get_conversation_item(cid: str, item_id: str):
    return await _on_item("conversation_item", cid, item_id)


@bp.delete("/v1/conversations/<cid>/items/<item_id>")
async def delete_conversation_item(cid: str, item_id: str):
    return await _on_item("delete_conversation_item", cid, item_id)  # the conversation, as OpenAI's


async def _on_item(verb: str, cid: str, item_id: str) -> dict:
    """What the store's ``verb`` on one conversation item gives, or the item's 404 when it gives None."""
    store = await _store()
    found = await getattr(store, verb)(_owner(), cid, item_id)
    if found is None:
        raise await _item_not_found(store, cid, item_id)
    return found


async def _item_not_found(store: AsyncStore, cid: str, item_id: str) -> ApiError:
    """The 404 of a conversation item: it names the conversation when that is what is missing."""
    if await store.get_conversation(_owner(), cid) is None:
        return _not_found("conversation", cid)
    return _not_found("item", item_id)
