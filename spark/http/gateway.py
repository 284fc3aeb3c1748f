"""The router in front of the routes: model names through the slot, upstream proxying, headers, activity.

Before a generation request (chat, completions, messages, responses) reaches its
route, the body's ``model`` is resolved by the slot: the active model goes on to
the route; an upstream recipe is proxied from here; another recipe starts a
switch and is answered 503 + ``Retry-After``; an unknown name 404. After every
response: ``X-Spark-Active-Profile`` and ``X-Spark-Served-Model``, and for a
generation one activity line and the usage counters, written when its body ends
(a stream's last byte), since only then are its tokens known.
"""

from __future__ import annotations

import functools
import json
import logging

from quart import Quart, Response, g, request
from quart.wrappers.response import IterableBody

from spark.control.activity import Tally, key_id
from spark.control.slot import Refusal, Slot
from spark.control.upstream import UpstreamError
from spark.http import params
from spark.http.errors import ApiError
from spark.recipes.schema import Recipe

log = logging.getLogger("spark.http")

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})
ROUTED_PATHS = GENERATION_PATHS | {"/v1/messages/count_tokens"}  # name a model; only generations are logged


def install(app: Quart, state) -> None:
    """Route, label and log every request of ``app`` through ``state.slot`` (once start-up made it)."""
    app.before_request(functools.partial(_route, state))
    app.after_request(functools.partial(_label, state))


def current_tally() -> Tally | None:
    """The tally of the request being handled (None outside a request, or for other routes)."""
    from quart import has_request_context

    return g.get("spark_tally") if has_request_context() else None


def refusal_error(r: Refusal) -> ApiError:
    return ApiError(r.status, r.message, param="model" if r.code.startswith("model") else None, code=r.code,
                    retry_after=r.retry_after)


async def _route(state) -> Response | None:
    slot: Slot | None = state.slot
    g.spark_tally = g.spark_served = None
    params.model_resolver.set(None)  # nothing from an earlier request on this connection's context
    if slot is None or request.method != "POST" or request.path not in ROUTED_PATHS:
        return None
    tally = Tally(endpoint=request.path, key_id=key_id(g.get("api_key")))
    if request.path in GENERATION_PATHS:
        g.spark_tally = tally
    try:
        body = json.loads(await request.get_data())
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("model"), (str, type(None))):
        return None  # the route answers 400 for a body it cannot read
    name = body.get("model")
    tally.model, tally.stream = name, bool(body.get("stream"))
    try:
        recipe = slot.route(name)
    except Refusal as r:
        raise refusal_error(r) from None
    tally.recipe, tally.served_model = recipe.id, recipe.served_name
    g.spark_served = recipe.served_name
    if recipe.engine == "upstream":
        return await _proxy(slot, recipe, body, tally)
    params.model_resolver.set(functools.partial(_still_active, slot, recipe))
    return None


def _still_active(slot: Slot, recipe: Recipe, name: str | None) -> None:
    """For ``check_model`` in the route: the name was resolved above; has a switch begun since?"""
    if slot.state != "active" or slot.active is not recipe:
        raise ApiError(503, f"the server is switching to {slot.target.served_name if slot.target else 'another model'};"
                            " retry shortly", param="model", code="model_loading", retry_after=slot.eta())


async def _proxy(slot: Slot, recipe: Recipe, body: dict, tally: Tally) -> Response:
    try:
        answer = await slot.upstreams.forward(recipe, request.path, body, tally)
    except UpstreamError as exc:
        raise ApiError(exc.status, exc.message, code="upstream_unreachable") from None
    headers = {"Retry-After": answer.retry_after} if answer.retry_after else {}
    if isinstance(answer.body, bytes):
        return Response(answer.body, status=answer.status, content_type=answer.content_type, headers=headers)
    response = Response(answer.body, status=answer.status, content_type=answer.content_type,
                        headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response.timeout = None
    return response


async def _label(state, response: Response) -> Response:
    slot: Slot | None = state.slot
    if slot is None:
        return response
    active = slot.active if slot.state == "active" else None
    response.headers["X-Spark-Active-Profile"] = active.id if active else "none"
    response.headers["X-Spark-Served-Model"] = g.get("spark_served") or (active.served_name if active else "none")
    tally = g.get("spark_tally")
    if tally is not None:
        if isinstance(response.response, IterableBody) and response.status_code == 200:
            response.response = _LoggedAtEnd(response.response, slot, tally)
        else:
            _log(slot, tally, response.status_code)
    return response


class _LoggedAtEnd(IterableBody):
    """A streamed body that logs its generation when it ends: "ok" when read to the end, else "disconnected".

    It hands out the inner body's iterator itself, so a chunk costs nothing more.
    """

    def __init__(self, body: IterableBody, slot: Slot, tally: Tally):
        self.iter, self._body, self._slot, self._tally = body.iter, body, slot, tally

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            await self._body.__aexit__(exc_type, exc, tb)
        finally:
            _log(self._slot, self._tally, 200, outcome="ok" if exc_type is None else "disconnected")


def _log(slot: Slot, tally: Tally, status: int, *, outcome: str = "ok") -> None:
    record = tally.record(status, outcome=outcome if status < 400 else "failed")
    if slot.activity is not None:
        slot.activity.append(record)
    if tally.recipe is not None and status < 400:
        slot.usage.add(tally.recipe, record["prompt_tokens"], record["completion_tokens"])
