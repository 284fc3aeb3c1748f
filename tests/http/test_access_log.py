"""``spark serve --access-log``: one line a request on stdout (it printed nothing: hypercorn made its access
logger at the WARNING level the server sets for hypercorn's own lines)."""

from __future__ import annotations

import functools

import httpx

from spark.http.serve import serve_async
from spark.serve_config import ServeConfig
from tests.server_thread import serve_in_thread


def test_the_access_log_has_a_line_a_request(capsys):
    config = ServeConfig(model="dummy:tiny-llama", port=0, device="cpu", kv_cache_bytes=16 << 20)
    with serve_in_thread(functools.partial(serve_async, config, quiet=True, access_log=True), name="spark-access-log") as url:
        assert httpx.get(url + "/v1/models").status_code == 200
        assert httpx.get(url + "/no-such-page").status_code == 404
    out = capsys.readouterr().out
    assert '"GET /v1/models 1.1" 200' in out and '"GET /no-such-page 1.1" 404' in out, out
