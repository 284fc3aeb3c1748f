"""A real Spark server in a background thread (hypercorn's trio worker on a free port of 127.0.0.1),
for the control-plane tests: ``with running_server(config) as server: ...``."""

from __future__ import annotations

import contextlib
import functools

import attrs
import httpx
import hypercorn.trio
import openai
import trio

from spark.http.application import create_app
from spark.http.serve import hypercorn_config
from spark.serve_config import ServeConfig
from tests.server_thread import serve_in_thread


@attrs.define
class RunningServer:
    url: str
    config: ServeConfig
    state: object  # the app's SparkState: tests read the slot from it
    root: object = None  # a test's own place for its files
    _clients: list = attrs.Factory(list)  # closed at shutdown: an idle keep-alive connection would delay it

    def close_clients(self) -> None:
        for client in self._clients:
            client.close()

    @property
    def slot(self):
        return self.state.slot

    def client(self, key: str | None = None, **kw) -> openai.OpenAI:
        key = key or (self.config.api_keys[0] if self.config.api_keys else "none")
        client = openai.OpenAI(base_url=self.url + "/v1", api_key=key, **{"max_retries": 0, "timeout": 60, **kw})
        self._clients.append(client)
        return client

    def http(self, key: str | None = None) -> httpx.Client:
        key = key or self.config.admin_key or (self.config.api_keys[0] if self.config.api_keys else None)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@contextlib.contextmanager
def running_server(config: ServeConfig):
    """Serve ``config`` on a free port until the block ends; a start-up error raises here."""
    config = attrs.evolve(config, port=0)
    app = create_app(config)
    state = app.extensions["spark"]

    async def serve(*, shutdown_trigger, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            hypercorn_serve = functools.partial(hypercorn.trio.serve, app, hypercorn_config(config),
                                                shutdown_trigger=shutdown_trigger)
            binds = await nursery.start(hypercorn_serve)
            if state.startup_error is not None:  # hypercorn listens even when the app's start-up failed
                nursery.cancel_scope.cancel()
            else:
                task_status.started(binds[0])
        if state.startup_error is not None:  # raised out here, not wrapped in the nursery's group
            raise state.startup_error

    with serve_in_thread(serve, name="spark-control-server") as url:
        running = RunningServer(url, config, state)
        try:
            yield running
        finally:
            running.close_clients()
