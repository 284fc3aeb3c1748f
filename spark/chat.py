"""``spark chat``: a terminal chat with a Spark server (or one started in-process).

Commands: ``/reset`` forgets the conversation, ``/exit`` (or Ctrl-D) leaves.
Ctrl-C during a reply stops it; what arrived stays in the conversation.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Iterator

import httpx

PROMPT = "you> "


def chat(url: str | None, *, model: str = "default", api_key: str | None = None) -> int:
    """Chat in the terminal.

    Args:
      url: a Spark (or any OpenAI-compatible) server, e.g. ``http://127.0.0.1:8000``;
        None starts a server in-process on a free port.
      model: with ``url`` None, the model to serve; otherwise the model name to ask for
        ("default" asks for whatever the server serves).
      api_key: the server's Bearer key; None: ``SPARK_API_KEY``, else none.

    Returns:
      The exit status: 1 when the input was piped (no terminal) and a message failed, else 0.

    Raises:
      ValueError: the server cannot be reached or started, refuses the key, or serves no such model.
    """
    api_key = api_key if api_key is not None else os.environ.get("SPARK_API_KEY")
    if url is None:
        with _local_server(model) as local_url:
            return _repl(local_url, None, {})
    url, model = url.rstrip("/"), None if model == "default" else model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    _check_server(url, model, headers)
    return _repl(url, model, headers)


def _check_server(url: str, model: str | None, headers: dict) -> None:
    """Ask the server for its models before the first message, so that a wrong URL, key or model name is
    one line at start rather than an error after each message typed."""
    try:
        r = httpx.get(url + "/v1/models", headers=headers, timeout=10.0)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise ValueError(f"cannot reach the server at {url}: {exc}") from None
    if r.status_code == 503:  # loading its model: the first message waits for it
        return
    if r.status_code != 200:
        raise ValueError(f"{url}/v1/models: {_error_message(r)}")
    try:
        names = [card["id"] for card in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{url}/v1/models: not an OpenAI-compatible model list: {r.text[:200]}") from None
    if model is not None and model not in names:
        raise ValueError(f"the server at {url} serves no model {model!r}; it serves: {', '.join(names) or 'none'}")


def _repl(url: str, model: str | None, headers: dict) -> int:
    history: list[dict] = []
    turns = failed = 0
    print("Type a message; /reset clears the conversation, /exit leaves.")
    with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(10.0, read=None)) as http:
        while True:
            try:
                line = input(PROMPT).strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return _exit_status(turns, failed)
            if line == "/exit":
                return _exit_status(turns, failed)
            if line == "/reset":
                history.clear()
                print("(conversation cleared)")
                continue
            if not line:
                continue
            history.append({"role": "user", "content": line})
            turns += 1
            reply: list[str] = []
            try:
                for piece in _stream_reply(http, history, model):
                    reply.append(piece)
                    print(piece, end="", flush=True)
                print()
            except KeyboardInterrupt:  # leaving the stream hangs up, which cancels the request
                print(" (stopped)")
            except (httpx.HTTPError, RuntimeError) as exc:
                print(f"\n(error: {exc})")
                failed += 1
                history.pop()
                continue
            history.append({"role": "assistant", "content": "".join(reply)})


def _exit_status(turns: int, failed: int) -> int:
    """A person at a terminal saw each error as it came; a script piping messages in learns of them here."""
    if failed and not sys.stdin.isatty():
        print(f"spark: {failed} of {turns} message(s) failed", file=sys.stderr)
        return 1
    return 0


def _stream_reply(http: httpx.Client, history: list[dict], model: str | None) -> Iterator[str]:
    """The reply's text deltas, as they arrive (server-sent events)."""
    body = {"messages": history, "stream": True} | ({"model": model} if model else {})
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(_error_message(r))
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(event["error"].get("message", "generation failed"))
            for choice in event.get("choices", ()):
                if choice["delta"].get("content"):
                    yield choice["delta"]["content"]


def _error_message(r: httpx.Response) -> str:
    try:
        return f"{r.status_code}: {r.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code}: {r.text[:200]}"


@contextlib.contextmanager
def _local_server(model: str) -> Iterator[str]:
    """Serve ``model`` on a free local port from a background thread; yields its URL."""
    from spark.http.serve import serve_async, serve_in_thread
    from spark.serve_config import ServeConfig

    config = ServeConfig(model=model, host="127.0.0.1", port=0)
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(serve_in_thread(
                functools.partial(serve_async, config), name="spark-chat-server", stop_timeout=15))
        except Exception as exc:
            raise ValueError(f"cannot start the server: {exc}") from None
        yield url
