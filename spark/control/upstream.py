"""The upstream proxy: a recipe served by an external OpenAI-compatible server, reached through Spark.

The request body goes on with the upstream's model name and the recipe's sampling
defaults; the client's Authorization never does (the upstream's key comes from the
environment variable the recipe names). Answers come back with ``model`` rewritten
to the recipe's served name and their token usage tallied. A stream is relayed
event by event; to count its tokens Spark asks the upstream for a usage chunk,
and drops that chunk again when the client did not ask for one.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import attrs

from spark.control.activity import Tally
from spark.recipes.schema import Recipe

# httpx is imported where an upstream is used: a server without upstream recipes (a local model's)
# would hold its 115 modules, ~5 MB resident, for nothing.
if TYPE_CHECKING:
    import httpx

log = logging.getLogger("spark.control")

PREFLIGHT_TIMEOUT_S = 10.0
_USAGE_PATHS = ("/v1/chat/completions", "/v1/completions")  # where stream_options.include_usage exists


class UpstreamError(Exception):
    """The upstream cannot be reached; ``status`` is what the client gets (502 or 504)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@attrs.frozen
class Relayed:
    """An upstream answer, ready to hand to the client."""

    status: int
    content_type: str
    body: bytes | AsyncIterator[bytes]
    retry_after: str | None = None


class Upstreams:
    """One HTTP client per upstream recipe, made on first use and closed by ``aclose``."""

    def __init__(self) -> None:
        self._clients: dict[str, httpx.AsyncClient] = {}

    def client(self, recipe: Recipe) -> httpx.AsyncClient:
        import httpx
        client = self._clients.get(recipe.id)
        if client is None:
            up = recipe.upstream
            headers = {}
            key = os.environ.get(up.api_key_env) if up.api_key_env else None
            if key:
                headers["Authorization"] = f"Bearer {key}"
            client = httpx.AsyncClient(base_url=up.base_url.rstrip("/"), headers=headers,
                                       timeout=httpx.Timeout(up.timeout_s, connect=10.0))
            self._clients[recipe.id] = client
        return client

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    async def preflight(self, recipe: Recipe) -> None:
        """``GET /models`` on the upstream.

        Raises:
            UpstreamError: it does not answer 200.
        """
        import httpx
        try:
            r = await self.client(recipe).get("/models", timeout=PREFLIGHT_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise UpstreamError(502, _unreachable(recipe, exc)) from None
        if r.status_code != 200:
            raise UpstreamError(502, f"upstream {recipe.id} answered GET /models with {r.status_code}")

    async def forward(self, recipe: Recipe, path: str, body: dict, tally: Tally) -> Relayed:
        """Send ``body`` to the upstream's ``path`` (``/v1/...``) and relay its answer.

        Raises:
            UpstreamError: the upstream cannot be reached.
        """
        import httpx
        body = {**recipe.sampling.defaults(), **body, "model": recipe.model}
        stream = bool(body.get("stream"))
        drop_usage = False
        if stream and path in _USAGE_PATHS:
            options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
            drop_usage = not options.get("include_usage")
            body["stream_options"] = {**options, "include_usage": True}
        client = self.client(recipe)
        request = client.build_request("POST", _upstream_path(recipe, path), json=body)
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            status = 504 if isinstance(exc, httpx.TimeoutException) else 502
            raise UpstreamError(status, _unreachable(recipe, exc)) from None
        content_type = response.headers.get("content-type", "application/json")
        retry_after = response.headers.get("retry-after")
        if stream and response.status_code == 200 and content_type.startswith("text/event-stream"):
            return Relayed(200, content_type, _relay_events(response, tally, recipe.served_name, drop_usage),
                           retry_after)
        try:
            data = await response.aread()
        except httpx.HTTPError as exc:
            raise UpstreamError(502, _unreachable(recipe, exc)) from None
        finally:
            await response.aclose()
        if response.status_code == 200:
            data = _rewrite(data, tally, recipe.served_name)
        return Relayed(response.status_code, content_type, data, retry_after)


def upstream_port(recipe: Recipe) -> int:
    """The port the upstream of ``recipe`` listens on (``X-Spark-Upstream-Port``)."""
    import httpx
    url = httpx.URL(recipe.upstream.base_url)
    return url.port or (443 if url.scheme == "https" else 80)


def _upstream_path(recipe: Recipe, path: str) -> str:
    """Where ``path`` of Spark's is on the upstream: ``/v1/x`` under its base URL (which ends in /v1),
    any other path (``/tokenize``) at the root of its host, as vLLM and llama.cpp serve them."""
    import httpx
    if path.startswith("/v1/"):
        return path.removeprefix("/v1")
    return str(httpx.URL(recipe.upstream.base_url).copy_with(path=path, query=None))


def _unreachable(recipe: Recipe, exc: Exception) -> str:
    return f"upstream {recipe.id} at {recipe.upstream.base_url} is unreachable: {type(exc).__name__}: {exc}"


def _rewrite(data: bytes, tally: Tally, served_name: str) -> bytes:
    try:
        obj = json.loads(data)
    except ValueError:
        return data
    if not isinstance(obj, dict):
        return data
    _take_usage(obj, tally)
    if "model" in obj:
        obj["model"] = served_name
    return json.dumps(obj, ensure_ascii=False).encode()


def _take_usage(obj: dict, tally: Tally) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
        completion = usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
        tally.set_usage(prompt, completion)


async def _relay_events(response: httpx.Response, tally: Tally, served_name: str,
                        drop_usage: bool) -> AsyncIterator[bytes]:
    import httpx
    buffer = b""
    try:
        async for chunk in response.aiter_bytes():
            buffer += chunk.replace(b"\r\n", b"\n")
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                event = _relay_event(event, tally, served_name, drop_usage)
                if event is not None:
                    yield event + b"\n\n"
        if buffer.strip():
            yield buffer
    except httpx.HTTPError as exc:
        log.warning("upstream stream broke: %s", exc)
        message = f"the upstream stream broke: {type(exc).__name__}"
        yield b"data: " + json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                                "code": "upstream_failed"}}).encode() + b"\n\n"
    finally:
        await response.aclose()


def _relay_event(event: bytes, tally: Tally, served_name: str, drop_usage: bool) -> bytes | None:
    lines = event.split(b"\n")
    for i, line in enumerate(lines):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            continue
        try:
            obj = json.loads(payload)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        _take_usage(obj, tally)
        if drop_usage and obj.get("choices") == [] and obj.get("usage"):
            return None  # the usage chunk Spark asked for, not the client
        if drop_usage and "usage" in obj:
            del obj["usage"]
        if "model" in obj:
            obj["model"] = served_name
        lines[i] = b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    return b"\n".join(lines)
