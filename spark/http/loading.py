"""The port before the model: ``spark serve`` binds first, and answers 503 "loading" until the app serves.

A port already in use is then found at once (one line, exit 2) instead of after a minute of
loading, and a client polling ``/health`` meets ``{"status": "loading"}`` with the load's progress
instead of a refused connection (as llama.cpp's server does). Each connection accepted while loading
gets one answer and is closed; the listening socket is then handed to hypercorn as is, so the
connections still in its backlog are served by the app.
"""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Callable

import h11
import trio

from spark.http.errors import ApiError

RETRY_AFTER_S = 5
HEAD_TIMEOUT_S = 5.0  # a client that sends no request head in this long is dropped
MAX_HEAD_BYTES = 64 << 10


class PortInUse(ValueError):
    """The address is taken: the user picks another port (one line, exit 2)."""


def bind(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one).

    Raises:
        PortInUse: another process listens there.
        ValueError: the address cannot be bound (no such interface, no permission).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as hypercorn does: restart over TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(f"{host}:{port} is already in use (another server?): pick another with --port") from None
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(backlog)
    return sock


async def answer_while_loading(sock: socket.socket, status: Callable[[], dict]) -> None:
    """Answer every connection on ``sock`` with 503 until cancelled; ``status()`` is /health's body."""
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock.dup()))  # the dup is ours to close
    try:
        await trio.serve_listeners(lambda stream: _answer(stream, status), [listener])
    finally:
        await listener.aclose()


async def _answer(stream: trio.SocketStream, status: Callable[[], dict]) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    async with stream:
        with trio.move_on_after(HEAD_TIMEOUT_S):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    break
                return  # a protocol error, or the connection closed
            try:
                await stream.send_all(_reply(conn, event.target.decode("latin-1"), status))
            except trio.BrokenResourceError:
                pass


def _reply(conn: h11.Connection, target: str, status: Callable[[], dict]) -> bytes:
    path = target.split("?")[0]
    if path == "/health":
        body = status()
    elif path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": "overloaded_error", "message": "the model is loading; retry shortly"}}
    else:
        body = ApiError(503, "the model is loading; retry shortly", code="not_ready").body()
    data = json.dumps(body).encode()
    head = h11.Response(status_code=503, headers=[("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                                                  ("Retry-After", str(RETRY_AFTER_S)), ("Connection", "close")])
    return conn.send(head) + conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage())
