"""A test server in a background thread: the one way the suite starts and stops one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from spark.http.serve import serve_in_thread as serve_in_background


@contextlib.contextmanager
def serve_in_thread(serve, *, name: str, timeout: float = 300) -> Iterator[str]:
    """``spark.http.serve.serve_in_thread`` with a start-up deadline, failing the test when
    the server's thread outlives its shutdown."""
    with serve_in_background(serve, name=name, timeout=timeout, must_stop=True) as url:
        yield url
