"""A request answered from its headers alone (404, 405, 401) never wedges its connection (issue 27.9).

Either the answer says ``Connection: close`` and the socket really closes, or the connection answers
the next request on it. Raw sockets, because an SDK would hide which of the two happened.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import pytest

from tests.http import fuzzing
from tests.http.conftest import API_KEY

BODY = b'{"model": "m", "prompt": "hi"}'
AUTH = b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
EARLY_ANSWERS = [
    (b"PATCH /v1/responses/x", AUTH, 405),
    (b"POST /health", b"", 405),
    (b"POST /v1/nonexistent", AUTH, 404),
    (b"PUT /metrics", b"", 405),
    (b"POST /v1/chat/completions", b"", 401),  # no key
    (b"POST /v1/completions", b"Authorization: Bearer wrong\r\n", 401),
]


def _head(line: bytes, headers: bytes) -> bytes:
    return (line + b" HTTP/1.1\r\nHost: t\r\n" + headers
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY))


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.settimeout(5)
    return sock


def _read_answer(sock: socket.socket) -> tuple[bytes, bool]:
    """One answer, and whether it said ``Connection: close``."""
    head, body = fuzzing.read_answer(sock)
    return head + b"\r\n\r\n" + body, b"connection: close" in head.lower()


@pytest.mark.parametrize("line,headers,status", EARLY_ANSWERS, ids=[e[0].decode() for e in EARLY_ANSWERS])
def test_answer_before_the_body_closes_the_connection(server, line, headers, status):
    with _connect(server.url) as sock:
        sock.sendall(_head(line, headers))  # the body is held back: the answer comes from the headers
        answer, close = _read_answer(sock)
        assert answer.startswith(b"HTTP/1.1 %d" % status), answer[:200]
        assert close, answer[:400]
        time.sleep(0.1)
        try:
            sock.sendall(BODY)
        except (BrokenPipeError, ConnectionResetError):
            return  # closed already, as promised
        assert fuzzing.closes(sock), "said Connection: close, but the socket stayed open"


@pytest.mark.parametrize("line,headers,status", EARLY_ANSWERS, ids=[e[0].decode() + f" {e[2]}" for e in EARLY_ANSWERS])
def test_answer_after_the_body_keeps_the_connection(server, line, headers, status):
    with _connect(server.url) as sock:
        sock.sendall(_head(line, headers) + BODY)  # all at once: the body is there, if not read
        answer, close = _read_answer(sock)
        assert answer.startswith(b"HTTP/1.1 %d" % status), answer[:200]
        assert not close, answer[:400]
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        health, _ = _read_answer(sock)
        assert health.startswith(b"HTTP/1.1 200") and b'"ok"' in health
