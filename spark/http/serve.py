"""Run the app under hypercorn's trio worker, programmatically (``spark serve``).

    python -m spark.http.serve        # configured from SPARK_* variables
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import signal
import sys
import threading
from collections.abc import Iterator

import hypercorn.trio
import trio
from hypercorn.config import Config as HypercornConfig

from spark import gc_tuning
from spark.core.interfaces import LoadedEngine
from spark.engine import progress
from spark.http import loading
from spark.http.application import create_app, load_engine
from spark.serve_config import ServeConfig

STARTUP_TIMEOUT_S = 3600  # loading a large model can take minutes
GRACEFUL_TIMEOUT_S = 5  # open streams get this long after Ctrl-C
LISTEN_BACKLOG = 2048  # connections waiting to be accepted (the kernel caps it at net.core.somaxconn)


def hypercorn_config(config: ServeConfig, *, access_log: bool = False) -> HypercornConfig:
    """Hypercorn's settings for ``config``: bind, quiet logs, a start-up timeout that fits a model load."""
    hc = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    # A logger of our own: from a "-" target hypercorn would make one at its loglevel (WARNING, below),
    # which drops every access line (they are INFO).
    hc.accesslog = _access_logger() if access_log else None
    hc.errorlog = "-"
    hc.loglevel = "WARNING"  # hypercorn's own "Running on" line would repeat ours
    hc.startup_timeout = STARTUP_TIMEOUT_S
    hc.graceful_timeout = GRACEFUL_TIMEOUT_S
    # Hundreds of clients connecting at once overflow hypercorn's default accept queue (100): the
    # kernel drops their handshakes, which come back a second later or as connection resets.
    hc.backlog = LISTEN_BACKLOG
    return hc


def _access_logger() -> logging.Logger:
    """One line a request on stdout, as hypercorn formats its access log."""
    logger = logging.getLogger("spark.access")
    logger.handlers = [logging.StreamHandler(sys.stdout)]
    logger.handlers[0].setFormatter(logging.Formatter("%(asctime)s %(message)s", "[%Y-%m-%d %H:%M:%S %z]"))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


async def serve_async(config: ServeConfig, *, engine: LoadedEngine | None = None, access_log: bool = False,
                      shutdown_trigger=None, quiet: bool = False, settle_gc: bool = False,
                      task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve until ``shutdown_trigger`` returns (by default: SIGINT or SIGTERM).

    Args:
      config: what to serve and where (port 0 picks a free port).
      engine: an already loaded engine; None loads ``config.model``.
      access_log: log every request to stdout.
      shutdown_trigger: an async callable whose return starts a graceful shutdown.
      quiet: do not print the "Spark serving" line.
      settle_gc: once serving, tune the garbage collector for it (``spark.gc_tuning``):
        for a process that does nothing else.
      task_status: started with the server's URL once it listens.

    Raises:
      Exception: what made start-up fail, e.g. ``ModelLoadError``.
    """
    sock = loading.bind(config.host, config.port, LISTEN_BACKLOG)  # a port in use fails here, before any load
    owns_engine = engine is None
    state = None
    try:
        if engine is None:  # here rather than at ASGI start-up, so that a load error reaches the caller as is
            failure = None
            async with trio.open_nursery() as answering:
                answering.start_soon(loading.answer_while_loading, sock, functools.partial(_loading_status, config))
                try:
                    engine = await load_engine(config)  # the start-up recipe's (None: no spark recipe at start)
                except Exception as exc:  # raised as is below, not in the nursery's group
                    failure = exc
                answering.cancel_scope.cancel()
            if failure is not None:
                raise failure
        app = create_app(config, engine=engine)
        state = app.extensions["spark"]
        if shutdown_trigger is None and threading.current_thread() is threading.main_thread():
            shutdown_trigger = functools.partial(_drain_on_signal, state, config.shutdown_grace_s, quiet)
        hc = hypercorn_config(config, access_log=access_log)
        hc.bind = [f"fd://{sock.detach()}"]  # hypercorn's from now on, connections in the backlog with it
        serve = functools.partial(hypercorn.trio.serve, app, hc, shutdown_trigger=shutdown_trigger)
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve)
            if state.startup_error is not None:  # start-up failed; hypercorn goes on to listen all the same
                nursery.cancel_scope.cancel()
                return
            url = binds[0]
            if settle_gc:
                gc_tuning.settle()
            if not quiet:
                served = state.limits.served_name if state.limits else "no model yet (name a recipe's model to load it)"
                print(f"Spark serving {served} on {url}", flush=True)
            task_status.started(url)
        if not quiet and state.startup_error is None:
            print("Spark stopped", flush=True)
    finally:
        sock.close()  # a no-op once detached
        if owns_engine and engine is not None:  # the slot closed it already, unless start-up failed first
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(engine.close)  # an engine process exits, its GPU memory with it
        if state is not None and state.startup_error is not None:  # the real error, not hypercorn's wrapper
            raise state.startup_error from None


def _loading_status(config: ServeConfig) -> dict:
    """``/health`` while the model loads: what loads, and how far it got when that is known here."""
    status = {"status": "loading", "model": config.resolved_served_name()}
    load = progress.current()
    if load is not None and load.unit == "B":
        status["progress"] = {"loaded_bytes": load.done, "total_bytes": load.total, "what": load.desc}
    elif load is not None:  # the warm-up, in steps
        status["progress"] = {"done": load.done, "total": load.total, "unit": load.unit, "what": load.desc}
    return status


def serve(config: ServeConfig, *, access_log: bool = False) -> None:
    """Serve ``config`` until Ctrl-C (``spark serve``)."""
    trio.run(functools.partial(serve_async, config, settle_gc=True, access_log=access_log))


@contextlib.contextmanager
def serve_in_thread(serve, *, name: str, timeout: float | None = None, stop_timeout: float = 30.0,
                    must_stop: bool = False) -> Iterator[str]:
    """Run ``serve(shutdown_trigger=..., task_status=...)`` (``serve_async``, say) under trio in a
    thread of its own; yield the URL it reports through ``task_status.started``.

    A start-up error ``serve`` raises is raised here, out of the nurseries' wrapping.
    Leaving the block stops it and waits up to ``stop_timeout`` for the thread.

    Args:
      timeout: seconds to wait for start-up (None: as long as the model takes to load).
      must_stop: raise ``RuntimeError`` when the thread outlives ``stop_timeout``.
    """
    started: queue.Queue = queue.Queue()

    async def main() -> None:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(serve, shutdown_trigger=stop.wait))
            started.put((url, trio.lowlevel.current_trio_token(), stop))

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # start-up failed: hand it to the caller
            started.put(exc)

    thread = threading.Thread(target=run, daemon=True, name=name)
    thread.start()
    got = started.get(timeout=timeout)
    while isinstance(got, BaseExceptionGroup) and len(got.exceptions) == 1:
        got = got.exceptions[0]
    if isinstance(got, BaseException):
        raise got
    url, token, stop = got
    try:
        yield url
    finally:
        trio.from_thread.run_sync(stop.set, trio_token=token)
        thread.join(timeout=stop_timeout)
        if must_stop and thread.is_alive():
            raise RuntimeError(f"{name} did not shut down")


async def _drain_on_signal(state, grace_s: float, quiet: bool) -> None:
    """Return once SIGINT or SIGTERM came and the open streams were drained: hypercorn keeps serving
    meanwhile, and every generating route answers 503, so clients hear why; a second signal cuts
    the streams at once."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            break
        slot = state.slot
        if slot is None or slot.model is None:
            return
        if not quiet:
            print(f"Spark stopping: {slot.model.open_streams} open stream(s) get up to {grace_s:g} s to finish "
                  "(again to stop now)", flush=True)
        done = slot.shut_down(grace_s=grace_s)
        async with trio.open_nursery() as nursery:
            async def cut_on_a_second_signal() -> None:
                async for _ in signals:
                    slot.cut_short()
                    return

            nursery.start_soon(cut_on_a_second_signal)
            await done.wait()
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    serve(ServeConfig.from_env())
