"""A core kept busy by another process, for benchmarks that measure Spark beside other work."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time


@contextlib.contextmanager
def busy_core(busy: bool):
    """A process spinning on one core while the block runs (nothing when ``busy`` is false)."""
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # let it reach its loop
        yield
    finally:
        spinner.kill()
        spinner.wait()
