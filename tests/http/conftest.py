"""One real Spark server for the whole session: hypercorn's trio worker in a background thread,
serving the embedded default model on a free port of 127.0.0.1."""

from __future__ import annotations

import functools

import attrs
import httpx
import openai
import pytest
import torch

from spark.http.serve import serve_async
from spark.serve_config import ServeConfig
from tests.server_thread import serve_in_thread

API_KEY = "sk-spark-test"
MAX_MODEL_LEN = 512  # small, so a prompt that overflows the context is cheap to send
MAX_BODY_BYTES = 64 << 10


@attrs.define
class Server:
    url: str  # http://127.0.0.1:<port>
    model: str  # the served name
    _client: openai.OpenAI | None = None

    def client(self, **kw) -> openai.OpenAI:
        """The session's SDK client; with ``kw``, a new one (close it)."""
        if kw or self._client is None:
            client = openai.OpenAI(**{"base_url": self.url + "/v1", "api_key": API_KEY, "max_retries": 0,
                                      "timeout": 120, **kw})
            if kw:
                return client
            self._client = client
        return self._client

    def close(self) -> None:
        if self._client is not None:  # an idle keep-alive connection would hold up shutdown
            self._client.close()

    def http(self, *, auth: bool = True) -> httpx.Client:
        headers = {"Authorization": f"Bearer {API_KEY}"} if auth else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)


@pytest.fixture(scope="session")
def server():
    # One intra-op thread: the server's engine shares 2 cores with the HTTP clients of the tests,
    # and OpenMP threads that spin on a busy CPU make steps up to 20x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = ServeConfig(model="default", port=0, device="cpu", max_model_len=MAX_MODEL_LEN,
                         api_keys=(API_KEY,), max_body_bytes=MAX_BODY_BYTES, kv_cache_bytes=256 << 20,
                         default_max_tokens=24,  # the chat REPL names no max_tokens
                         weight_format="dense")  # batch-invariant: tests compare outputs across batchings
    serve = functools.partial(serve_async, config, quiet=True)
    try:
        with serve_in_thread(serve, name="spark-server") as url:
            with httpx.Client(base_url=url) as http:
                assert http.get("/health").status_code == 200
                model = http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["id"]
            running = Server(url, model)
            try:
                yield running
            finally:
                running.close()  # an idle keep-alive connection would hold up shutdown
    finally:
        torch.set_num_threads(threads)
