"""A test server in a background thread: the one way the suite starts and stops one."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from spark.http.serve import serve_in_thread as serve_in_background


@contextlib.contextmanager
def serve_in_thread(serve, *, name: str, timeout: float = 300) -> Iterator[str]:
    """``spark.http.serve.serve_in_thread`` with a start-up deadline, checking on the way out
    that the server's thread is gone."""
    with serve_in_background(serve, name=name, timeout=timeout) as url:
        yield url
    assert not any(t.name == name and t.is_alive() for t in threading.enumerate()), f"{name} did not shut down"
