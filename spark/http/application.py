"""The quart-trio app: start-up (load the engine, open the actor system), auth, shutdown.

The actor system lives in a task of the app's lifespan nursery (``app.nursery``):
it enters ``open_system`` and waits for shutdown, so requests can reach it from
any handler and it is closed before hypercorn exits.
"""

from __future__ import annotations

import functools
import hmac
import logging
import time

import attrs
import trio
from quart import g, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGILifespan

from spark.http import errors, routes
from spark.http.errors import ApiError
from spark.http.params import Limits
from spark.serve_config import ServeConfig

log = logging.getLogger("spark.http")

NEEDS_TRIO = "Spark's HTTP server needs hypercorn's trio worker: run `hypercorn -k trio spark.http:app`"
SHUTDOWN_GRACE_S = 10.0  # for the actor system to close after the last request


@attrs.define(eq=False)
class SparkState:
    """What the handlers of one app share (``app.extensions["spark"]``)."""

    config: ServeConfig | None  # None: read SPARK_* variables at start-up
    engine: object | None = None  # given by a test, or loaded at start-up
    system: object | None = None  # the SparkSystem, once open
    limits: Limits | None = None  # set once start-up succeeded
    startup_error: BaseException | None = None  # why start-up failed (hypercorn reports only its text)
    started_at: int = attrs.field(factory=lambda: int(time.time()))
    stop: trio.Event = attrs.field(factory=trio.Event)
    stopped: trio.Event = attrs.field(factory=trio.Event)


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


def create_app(config: ServeConfig | None = None, *, engine=None) -> QuartTrio:
    """Build Spark's OpenAI-compatible app.

    Args:
      config: how to serve; None reads ``SPARK_*`` environment variables at start-up.
      engine: an already loaded ``Engine`` (tests); None loads ``config.model`` at start-up.

    Returns:
      The app, for hypercorn's trio worker (``hypercorn -k trio``) or ``spark.http.serve``.
    """
    app = QuartTrio("spark.http")
    app.asgi_lifespan_class = _TrioOnlyLifespan
    app.config["RESPONSE_TIMEOUT"] = None  # a long generation must not be cut off at 60 s
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = SHUTDOWN_GRACE_S
    if config is not None:
        app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    state = app.extensions["spark"] = SparkState(config, engine)
    app.before_serving(functools.partial(_start, app, state))
    app.after_serving(functools.partial(_stop, state))
    app.before_request(functools.partial(_authenticate, state))
    app.register_blueprint(routes.bp)
    errors.install(app)
    return app


async def _start(app: QuartTrio, state: SparkState) -> None:
    try:
        await _open(app, state)
    except BaseException as exc:
        state.startup_error = exc
        raise


async def _open(app: QuartTrio, state: SparkState) -> None:
    from spark.actors.system import open_system

    if state.config is None:
        state.config = ServeConfig.from_env()
        app.config["MAX_CONTENT_LENGTH"] = state.config.max_body_bytes
    config = state.config
    if state.engine is None:
        state.engine = await load_engine(config)
    state.system = await app.nursery.start(_run_system, open_system, state)
    system = state.system
    vocab = min(system.tokenizer.vocab_size, state.engine.config.vocab_size)
    state.limits = Limits(system.served_name, system.max_model_len, vocab, config.default_max_tokens)


async def load_engine(config: ServeConfig):
    """Load ``config.model`` in a worker thread, so the event loop keeps running.

    Raises:
        ModelLoadError: the model cannot be read.
    """
    from spark.engine.engine import Engine

    load = functools.partial(Engine.load, config.model, device=config.device, page_size=config.page_size,
                             kv_cache_bytes=config.kv_cache_bytes, max_model_len=config.max_model_len)
    return await trio.to_thread.run_sync(load, abandon_on_cancel=True)  # Ctrl-C need not wait for it


async def _run_system(open_system, state: SparkState, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    started = False
    try:
        async with open_system(state.engine, state.config) as system:
            task_status.started(system)
            started = True
            await state.stop.wait()
    except Exception:
        if not started:
            raise  # start-up fails: hypercorn reports it and exits
        # Later, the app must not die with the system's task; it answers 503 instead.
        log.exception("the actor system failed")
        state.system = None
    finally:
        state.stopped.set()


async def _stop(state: SparkState) -> None:
    state.stop.set()
    await state.stopped.wait()  # bounded: quart gave the nursery a deadline of SHUTDOWN_GRACE_S


async def _authenticate(state: SparkState) -> None:
    g.api_key = None
    keys = state.config.api_keys if state.config is not None else ()
    if not keys or not request.path.startswith("/v1/"):
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "missing API key: send it as `Authorization: Bearer <key>`", code="invalid_api_key")
    token = token.strip()
    if not any(hmac.compare_digest(token.encode(), key.encode()) for key in keys):
        raise ApiError(401, "invalid API key", code="invalid_api_key")
    g.api_key = token

