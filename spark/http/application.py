"""The quart-trio app: start-up (recipes, the slot, the first model), auth, shutdown.

The slot (``spark.control.slot``) lives in a task of the app's lifespan nursery
(``app.nursery``): it loads models, hosts each one's actor system, switches between
recipes, and tells this module which model the routes use (``_publish``). Without
recipe settings the server's one model is an implicit recipe, loaded at start-up
as before. The slot is closed before hypercorn exits.

Each request gets a nursery of its own for its generations (``_Connection``), open
until its response body has been sent, or the client has gone.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time

import attrs
import trio
from quart import g, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection, TrioASGILifespan
from quart_trio.wrappers import TrioRequest

from spark.control.activity import ActivityLog
from spark.control.local import LocalModel
from spark.control.local import load_engine as load
from spark.control.served import ServedModel
from spark.control.slot import Slot
from spark.control.usage import UsageCounters
from spark.core.interfaces import LoadedEngine
from spark.http import admin, anthropic, errors, gateway, openapi, portal, responses, routes
from spark.http import tokenize
from spark.http.errors import ApiError
from spark.http.fanin import Generations
from spark.http.keys import RefusalPacer, keyring
from spark.http.params import Limits
from spark.recipes.schema import Recipe
from spark.recipes.serving import catalog_for, engine_dtype, recipe_config
from spark.serve_config import ServeConfig

log = logging.getLogger("spark.http")

NEEDS_TRIO = "Spark's HTTP server needs hypercorn's trio worker: run `hypercorn -k trio spark.http:app`"
SHUTDOWN_GRACE_S = 10.0
BODY_GRACE_S = 0.05  # how long an answer given before its request's body arrived waits for that body  # for the slot (and its actor system) to close after the last request


@attrs.define(eq=False)
class SparkState:
    """What the handlers of one app share (``app.extensions["spark"]``)."""

    config: ServeConfig | None  # None: read SPARK_* variables at start-up
    engine: LoadedEngine | None = None  # loaded before start-up (a test, ``spark serve``), until the slot takes it
    system: ServedModel | None = None  # the model the routes serve; None: 503
    limits: Limits | None = None  # the active model's, with it
    slot: Slot | None = None  # once start-up made it
    startup_error: BaseException | None = None  # why start-up failed (hypercorn reports only its text)
    exit_on_startup_error: bool = False
    started_at: int = attrs.field(factory=lambda: int(time.time()))
    stopped: trio.Event = attrs.field(factory=trio.Event)
    refusals: RefusalPacer = attrs.field(factory=RefusalPacer)  # paces every 401 of this app


class _TrioOnlyLifespan(TrioASGILifespan):
    """Refuse to start under an asyncio worker, with one line instead of a 500 on every request."""

    async def __call__(self, receive, send) -> None:
        if trio.lowlevel.in_trio_run():
            return await super().__call__(receive, send)
        import asyncio

        # A SystemExit raised by a loop callback (not by this task) leaves the event loop at
        # once, skipping hypercorn's lifespan error handling and asyncio's task-exception
        # log: the process ends with this one line (multiprocessing or Python prints it).
        asyncio.get_running_loop().call_soon(_exit_needing_trio)
        await receive()  # hypercorn waits for our start-up answer; the loop stops before it
        await asyncio.Event().wait()


def _exit_needing_trio() -> None:
    raise SystemExit(NEEDS_TRIO)


class _Request(TrioRequest):
    """A request that carries its generations' owner, for ``gateway.generates`` to hand its route."""

    generations: Generations  # set by _Connection before any handler sees the request


class _Connection(TrioASGIHTTPConnection):
    """Hypercorn's trio worker's connection, with a nursery per request around its handler and body.

    When the request ends, every generation it started is closed (``Generations``): even one
    whose response body never started, as when the client leaves before the first byte.

    A response that starts before the request's body has arrived (a 404, 405 or 401 answered from
    the headers alone) says ``Connection: close``: the rest of the body is still on the wire, and
    a client that reused the connection would wait forever for an answer to bytes hypercorn
    takes for the body. The response's last message is sent shielded, because hypercorn closes
    (or recycles) the connection inside that call, and the client's disconnect it reports there
    cancels this request's nursery: unshielded, the close was cut off and the socket stayed open.
    """

    async def __call__(self, receive, send) -> None:
        self._body_received = trio.Event()
        if not _announces_body(self.scope):
            self._body_received.set()

        async def receive_noting_the_end():
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                self._body_received.set()
            return message

        await super().__call__(receive_noting_the_end, functools.partial(self._send, send))

    async def _send(self, send, message) -> None:
        if message["type"] == "http.response.start" and not self._body_received.is_set():
            with trio.move_on_after(BODY_GRACE_S):  # a body sent with its headers is only not read yet
                await self._body_received.wait()
        if message["type"] == "http.response.start" and not self._body_received.is_set():
            headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            with trio.CancelScope(shield=True):
                await send(message)
            return
        await send(message)

    async def handle_request(self, nursery: trio.Nursery, request: _Request, send) -> None:
        async with trio.open_nursery() as generations:
            request.generations = Generations(generations)
            try:
                await super().handle_request(nursery, request, send)
            finally:
                request.generations.close()


def _announces_body(scope) -> bool:
    """Whether the request's headers say a body follows (a length above 0, or chunks)."""
    for name, value in scope["headers"]:
        name = name.lower()
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"0", b"")):
            return True
    return False


def create_app(config: ServeConfig | None = None, *, engine: LoadedEngine | None = None,
               exit_on_startup_error: bool = False) -> QuartTrio:
    """Build Spark's OpenAI-compatible app.

    Args:
      config: how to serve; None reads ``SPARK_*`` environment variables at start-up.
      engine: an already loaded engine (tests, ``spark serve``); None loads ``config.model`` at start-up.
      exit_on_startup_error: a start-up that fails ends the process with one line and status 2 (under
        the ``hypercorn`` command, which would print its traceback and exit 0).

    Returns:
      The app, for hypercorn's trio worker (``hypercorn -k trio``) or ``spark.http.serve``.
    """
    app = QuartTrio("spark.http")
    app.asgi_lifespan_class = _TrioOnlyLifespan
    app.asgi_http_class = _Connection
    app.request_class = _Request
    app.config["RESPONSE_TIMEOUT"] = None  # a long generation must not be cut off at 60 s
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = SHUTDOWN_GRACE_S
    if config is not None:
        app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    state = app.extensions["spark"] = SparkState(config, engine, exit_on_startup_error=exit_on_startup_error)
    app.before_serving(functools.partial(_start, app, state))
    app.after_serving(functools.partial(_stop, state))
    app.before_request(functools.partial(_authenticate, state))
    gateway.install(app)
    app.register_blueprint(routes.bp)
    app.register_blueprint(tokenize.bp)  # /tokenize, /detokenize (vLLM's)
    app.register_blueprint(admin.bp)
    errors.install(app)
    anthropic.install(app)  # /v1/messages*, with Anthropic-shaped errors
    responses.install(app)  # /v1/responses*, /v1/conversations*, and their SQLite store
    app.register_blueprint(openapi.bp)  # GET /openapi.json, generated from the request classes
    app.register_blueprint(portal.bp)  # GET /: the web portal (static files that call the APIs above)
    return app


async def _start(app: QuartTrio, state: SparkState) -> None:
    try:
        await _open(app, state)
    except BaseException as exc:
        state.startup_error = exc
        state.stopped.set()  # nothing to stop
        if state.exit_on_startup_error and isinstance(exc, Exception):
            _exit_with_one_line(exc)
        raise


def _exit_with_one_line(exc: BaseException) -> None:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    print(f"spark: {exc}", file=sys.stderr, flush=True)
    os._exit(2)  # hypercorn would go on to print its wrapper's traceback and exit 0


async def _open(app: QuartTrio, state: SparkState) -> None:
    """Read the recipes, make the slot, and bring the start-up recipe up through it (preflight included)."""
    if state.config is None:
        state.config = ServeConfig.from_env()
        app.config["MAX_CONTENT_LENGTH"] = state.config.max_body_bytes
    config = state.config
    catalog, initial = catalog_for(config)
    for problem in catalog.problems:
        log.warning("recipe skipped: %s", problem)
    if (config.rate_limit_rps or config.rate_limit_tpm) and not config.api_keys:
        log.warning("rate limits count per API key: with no --api-key (SPARK_API_KEYS) they limit nothing")
    activity = None
    if config.activity_log_path:
        activity = ActivityLog(config.activity_log_path, max_bytes=config.activity_log_max_bytes,
                               max_age_s=config.activity_log_max_age_s)
    state.slot = Slot(catalog, config, publish=functools.partial(_publish, state), engine=state.engine,
                      activity=activity, usage=UsageCounters(config.usage_path))
    state.engine = None  # the slot's now: it releases it with its model
    await app.nursery.start(_run_slot, state, initial)


async def load_engine(config: ServeConfig) -> LoadedEngine | None:
    """Load the engine of the recipe active at start (without recipes: ``config.model``) in a worker
    thread; None when that recipe is not a spark one (or there is none).

    ``spark serve`` calls it before the server listens, so that a bad recipe or a load error reaches
    the caller as is; the slot then takes the engine over (``create_app(config, engine=...)``).

    Raises:
        ValueError: ``config.recipe`` is unknown or invalid.
        ModelLoadError: the model cannot be read.
    """
    _, initial = catalog_for(config)
    if initial is None or initial.engine != "spark":
        return None
    model, dummy = initial.load_spec()
    return await load(recipe_config(config, initial), model=model, dummy_config=dummy, dtype=engine_dtype(initial))


def _publish(state: SparkState, model: LocalModel | None) -> None:
    """The slot's model changed: the routes use ``model`` (None: 503) from now on."""
    state.system, state.limits = model, (Limits.of(model) if model is not None else None)


async def _run_slot(state: SparkState, initial: Recipe | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    try:
        await state.slot.run(initial, task_status=task_status)  # a failure before started fails start-up
    finally:
        state.stopped.set()


async def _stop(state: SparkState) -> None:
    if state.slot is not None:
        state.slot.stop()
    await state.stopped.wait()  # bounded: quart gave the nursery a deadline of SHUTDOWN_GRACE_S


# Routes outside /v1 that spend the model's tokenizer: keyed too when keys are set (vLLM leaves them
# open; here a server with keys answers no model work to a caller without one).
KEYED_OUTSIDE_V1 = ("/tokenize", "/detokenize")


async def _authenticate(state: SparkState) -> None:
    g.api_key = None
    keys = state.config.api_keys if state.config is not None else ()
    if not keys or not (request.path.startswith("/v1/") or request.path in KEYED_OUTSIDE_V1):
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    # Anthropic's clients send their key as x-api-key, to /v1/messages and to /v1/models alike: it is
    # taken on every path, and under /v1/messages over an Authorization header.
    if request.headers.get("x-api-key", "").strip() and (request.path.startswith(anthropic.PREFIX) or not token.strip()):
        scheme, token = "bearer", request.headers["x-api-key"]
    ring = keyring(tuple(keys))
    # A refusal here is answered before the body is read: _Connection closes the connection when that
    # body has not arrived yet, and keeps it when it came with the headers (a flood of bad keys then
    # costs no reconnects).
    if scheme.lower() != "bearer" or not token.strip():
        await state.refusals.pace(state.config.refusals_per_s)
        raise ApiError(401, "missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`",
                       code="invalid_api_key")
    token = token.strip()
    if token not in ring:
        await state.refusals.pace(state.config.refusals_per_s)
        raise ApiError(401, "invalid API key", code="invalid_api_key")
    g.api_key = token

