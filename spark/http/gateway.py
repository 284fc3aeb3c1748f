"""The router in front of the routes: model names through the slot, upstream proxying, headers, activity.

A route that names a model declares it where it is defined, ``@generates(bp, rule)``
(``logged=False`` for one that only counts, like ``count_tokens``). Before its body runs,
the request body's ``model`` is resolved by the slot: the active model is handed to the
route as a ``spine.Serving``; an upstream recipe is proxied from here; another recipe
starts a switch and is answered 503 + ``Retry-After``; an unknown name 404. After every
response: ``X-Spark-Active-Profile`` and ``X-Spark-Served-Model``, and for a generation
one activity line and the usage counters, written when its body ends (a stream's last
byte), since only then are its tokens known.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

from quart import Blueprint, Quart, Response, current_app, g, request
from quart.wrappers.response import IterableBody

from spark.control.activity import Tally, key_id
from spark.control.slot import Refusal, Slot
from spark.control.upstream import UpstreamError
from spark.http.errors import ApiError
from spark.http.spine import Serving, json_body, not_ready
from spark.recipes.schema import Recipe

log = logging.getLogger("spark.http")

View = Callable[[Serving], Awaitable]


def install(app: Quart) -> None:
    """Label every response of ``app``, and log every generation (``generates``), through its slot."""
    app.after_request(functools.partial(_label, app.extensions["spark"]))


def generates(bp: Blueprint, rule: str, *, logged: bool = True) -> Callable[[View], View]:
    """Declare ``POST rule`` on ``bp`` a route that names a model: the decorated view is called with the
    ``Serving`` its body's model resolved to (or never, when the request is proxied or refused).

    Args:
      logged: its generations go to the activity log and the usage counters.
    """

    def declare(view: View) -> View:
        @functools.wraps(view)
        async def routed():
            state = current_app.extensions["spark"]
            tally = Tally(endpoint=request.path, key_id=key_id(g.get("api_key")))
            g.spark_tally = tally if logged else None  # what _label logs
            proxied = await _route(state.slot, tally)
            if proxied is not None:
                return proxied
            model, limits = state.system, state.limits  # read together, with no await since the slot routed
            if model is None:
                raise not_ready()
            return await view(Serving(model, limits, g.spark_tally, request.generations))

        bp.post(rule)(routed)
        return view

    return declare


def refusal_error(r: Refusal) -> ApiError:
    return ApiError.refused(r, param="model" if r.code.startswith("model") else None)


async def _route(slot: Slot | None, tally: Tally) -> Response | None:
    """Resolve the body's model; a proxied response, or None to go on to the route (it answers 400 for a
    body it cannot read, and 503 when no model is active)."""
    if slot is None:
        return None
    try:
        body = await json_body()
    except ApiError:
        body = None  # the route answers its 400
    if not isinstance(body, dict) or not isinstance(body.get("model"), (str, type(None))):
        return None
    name = body.get("model")
    tally.model, tally.stream = name, bool(body.get("stream"))
    try:
        recipe = slot.route(name)
    except Refusal as r:
        raise refusal_error(r) from None
    tally.recipe, tally.served_model = recipe.id, recipe.served_name
    g.spark_served = recipe.served_name
    g.spark_profile = recipe.id  # the profile that answers: an upstream one for a proxied request
    if recipe.engine == "upstream":
        return await _proxy(slot, recipe, body, tally)
    return None


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
    response.headers["X-Spark-Active-Profile"] = g.get("spark_profile") or (active.id if active else "none")
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
    if log.isEnabledFor(logging.INFO):  # one line per generation, at --log-level INFO
        log.info("%s %s %d %s: %d prompt + %d generated tokens in %.2f s%s", record["endpoint"],
                 record["served_model"] or record["model"], status, record["outcome"], record["prompt_tokens"],
                 record["completion_tokens"], record["latency_s"], " (stream)" if record["stream"] else "")
    if slot.activity is not None:
        slot.activity.append(record)
    if tally.recipe is not None and status < 400:
        slot.usage.add(tally.recipe, record["prompt_tokens"], record["completion_tokens"])
