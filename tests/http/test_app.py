"""The app's error handling and auth, through quart's test client (no server, no model)."""

from __future__ import annotations

from spark.http import create_app
from spark.serve_config import ServeConfig


def _app(**config):
    app = create_app(ServeConfig(model="dummy:unused", **config))

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret internals")

    return app


async def test_not_ready_is_503_json():
    client = _app().test_client()  # start-up never ran: no system yet
    r = await client.get("/health")
    assert r.status_code == 503 and (await r.get_json())["error"]["code"] == "not_ready"
    r = await client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"


async def test_unexpected_exception_is_500_json_without_details():
    r = await _app().test_client().get("/boom")
    body = await r.get_json()
    assert r.status_code == 500 and body["error"]["type"] == "server_error"
    assert "secret internals" not in body["error"]["message"]


async def test_routing_errors_are_json():
    client = _app().test_client()
    r = await client.get("/v2/anything")
    assert r.status_code == 404 and "/v2/anything" in (await r.get_json())["error"]["message"]
    r = await client.put("/health")
    assert r.status_code == 405 and (await r.get_json())["error"]["code"] == "method_not_allowed"


async def test_keys_guard_v1_only_and_only_when_configured():
    open_client = _app().test_client()
    assert (await open_client.get("/v1/models")).status_code == 503  # reached the route: no key needed
    guarded = _app(api_keys=("k1", "k2")).test_client()
    assert (await guarded.get("/v1/models")).status_code == 401
    assert (await guarded.get("/v1/models", headers={"Authorization": "Bearer k3"})).status_code == 401
    assert (await guarded.get("/v1/models", headers={"Authorization": "bearer k2"})).status_code == 503
    assert (await guarded.get("/health")).status_code == 503  # not 401
