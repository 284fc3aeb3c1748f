"""The router in front of the routes: model names through the slot, upstream proxying, headers, activity.

A route that names a model declares it where it is defined, ``@generates(bp, rule)``
(``logged=False`` for one that only counts, like ``count_tokens``). Before its body runs,
the request body's ``model`` is resolved by the slot: the active model is handed to the
route as a ``spine.Serving``; an upstream recipe is proxied from here; another recipe
starts a switch and is answered 503 + ``Retry-After``; an unknown name 404. After every
response: ``X-Spark-Active-Profile`` and ``X-Spark-Served-Model``, and for a generation
one activity line and the usage counters, written when its body ends (a stream's last
byte), since only then are its tokens known. A proxied response also says the upstream's
port in ``X-Spark-Upstream-Port``.

The reserved names always mean the active model and never switch: ``sparky`` as its recipe
serves it, ``sparky-think`` with thinking on and ``sparky-fast`` with thinking off (the
request's own thinking switch, when it names one, wins). Routes Spark's engine does not
serve (``UPSTREAM_ONLY``: ``/v1/embeddings``) reach an upstream recipe all the same.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

import attrs
from quart import Blueprint, Quart, Response, current_app, g, request
from quart.wrappers.response import IterableBody

from spark.control.activity import Tally, key_id
from spark.control.slot import Refusal, Slot
from spark.control.upstream import UpstreamError, upstream_port
from spark.http.errors import ApiError
from spark.http.schemas import Prompt
from spark.http.spine import Serving, json_body, not_ready, request_body
from spark.recipes.schema import Recipe

#: The thinking switch of each reserved name that sets one.
THINKING_ALIASES = {"sparky-think": True, "sparky-fast": False}

log = logging.getLogger("spark.http")

View = Callable[[Serving], Awaitable]


@attrs.frozen(kw_only=True)
class EmbeddingsRequest:
    """``POST /v1/embeddings`` (OpenAI's): checked here, answered by an upstream recipe's server."""

    input: tuple[Prompt, ...]  # texts or token ids
    model: str | None = None
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None


#: Routes Spark's engine does not serve, proxied to the upstream recipe the body's model names:
#: ``{path: (endpoint, request class)}``.
UPSTREAM_ONLY = {"/v1/embeddings": ("gateway.embeddings", EmbeddingsRequest)}


def install(app: Quart) -> None:
    """Label every response of ``app``, log every generation (``generates``) through its slot, and
    route ``UPSTREAM_ONLY`` to upstream recipes."""
    app.after_request(functools.partial(_label, app.extensions["spark"]))
    for rule, (endpoint, _) in UPSTREAM_ONLY.items():
        app.add_url_rule(rule, endpoint=endpoint, view_func=_upstream_only, methods=["POST"])


async def _upstream_only():
    """Proxied to the upstream recipe the body's model names (Spark's engine does not serve this route)."""
    state = current_app.extensions["spark"]
    g.spark_tally = tally = Tally(endpoint=request.path, key_id=key_id(g.get("api_key")))
    await request_body(UPSTREAM_ONLY[request.path][1])  # a 400 for a body that is not one
    body = await json_body()
    if state.slot is None:
        raise not_ready()
    tally.model = body.get("model")
    try:
        recipe = state.slot.lookup(tally.model)
    except Refusal as r:
        raise refusal_error(r) from None
    _answered_by(recipe, tally)
    if recipe.engine != "upstream":
        raise ApiError(400, f"model {recipe.served_name!r} (recipe {recipe.id}) runs on Spark's engine, which does "
                            f"not serve {request.path}; name an upstream recipe's model", param="model",
                       code="model_not_supported")
    return await _proxy(state.slot, recipe, body, tally)


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
    if name in THINKING_ALIASES:
        g.json_body = body = with_thinking(request.path, body, THINKING_ALIASES[name])
    try:
        recipe = slot.route(name)
    except Refusal as r:
        raise refusal_error(r) from None
    _answered_by(recipe, tally)
    if recipe.engine == "upstream":
        return await _proxy(slot, recipe, body, tally)
    return None


def _answered_by(recipe: Recipe, tally: Tally) -> None:
    tally.recipe, tally.served_model = recipe.id, recipe.served_name
    g.spark_served = recipe.served_name
    g.spark_profile = recipe.id  # the profile that answers: an upstream one for a proxied request
    if recipe.engine == "upstream":
        g.spark_upstream_port = upstream_port(recipe)


def with_thinking(path: str, body: dict, on: bool) -> dict:
    """``body`` with thinking switched ``on`` (or off) in its API's own field, unless it sets that itself.

    Chat completions: ``chat_template_kwargs.enable_thinking`` (which vLLM and llama.cpp read too);
    Anthropic: ``thinking.type``; Responses: ``reasoning.effort: none`` to turn it off (on is its default).
    """
    if path == "/v1/chat/completions":
        kwargs = body.get("chat_template_kwargs")
        if kwargs is None or (isinstance(kwargs, dict) and "enable_thinking" not in kwargs):
            if body.get("reasoning_effort") is None:
                return {**body, "chat_template_kwargs": {**(kwargs or {}), "enable_thinking": on}}
    elif path.startswith("/v1/messages") and body.get("thinking") is None:
        return {**body, "thinking": {"type": "enabled" if on else "disabled"}}
    elif path == "/v1/responses" and not on and body.get("reasoning") is None:
        return {**body, "reasoning": {"effort": "none"}}
    return body


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
    if g.get("spark_upstream_port"):
        response.headers["X-Spark-Upstream-Port"] = str(g.spark_upstream_port)
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


def log_when_done() -> Callable[[str], None]:
    """Take this request's generation out of the line written when its response ends, for one that
    goes on after it (a background response): the function returned writes it, given its outcome."""
    tally, slot = g.get("spark_tally"), current_app.extensions["spark"].slot
    g.spark_tally = None
    if tally is None or slot is None:
        return lambda outcome: None
    return lambda outcome: _log(slot, tally, 200, outcome=outcome)


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
