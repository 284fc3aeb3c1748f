"""What the acceptance scripts share: a ``spark serve`` subprocess, its /metrics, its memory, their verdict.

A ``SparkServer`` runs ``python -m spark.cli serve --port 0`` (the kernel picks a free port; the URL is
read back from the "Spark serving ... on URL" line) in a session of its own, with every path it
writes (state, activity log, usage counters, its captured stdout and stderr) in a temporary
directory, and is ready once ``GET /health`` answers 200.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

REPO = pathlib.Path(__file__).resolve().parents[2]
SERVED_RE = re.compile(r"Spark serving .* on (http://\S+)")


class SparkServer:
    """One ``spark serve`` process. ``start`` again (after ``kill`` or ``stop``) reuses the same directory,
    state file and environment, on a new port.

    Args:
      env: ``SPARK_*`` variables on top of the defaults (state, activity and usage paths in ``workdir``).
      workdir: where the files go; a fresh temporary directory by default (removed by ``close``).
      log_level: ``spark --log-level``.
      model: ``--model``.
      cpu_threads: ``--cpu-threads`` (1: the machine's two cores are shared).
    """

    def __init__(self, env: dict[str, str] | None = None, *, workdir: str | None = None, log_level: str = "INFO",
                 model: str = "default", cpu_threads: int = 1, ready_timeout: float = 180.0):
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="spark-accept-")
        self.dir = pathlib.Path(workdir or self._tmp.name)
        self.state_path = str(self.dir / "state.sqlite3")
        self.activity_path = str(self.dir / "activity.jsonl")
        self.usage_path = str(self.dir / "usage.json")
        self.env = {"SPARK_STATE_PATH": self.state_path, "SPARK_ACTIVITY_LOG_PATH": self.activity_path,
                    "SPARK_USAGE_PATH": self.usage_path, **(env or {})}
        self.argv = [sys.executable, "-m", "spark.cli", "--log-level", log_level, "serve", "--model", model,
                     "--port", "0", "--cpu-threads", str(cpu_threads)]
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.starts = 0
        self.ready_s = 0.0  # how long the last start took

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_path(self, start: int | None = None) -> pathlib.Path:
        return self.dir / f"server-{self.starts if start is None else start}.log"

    def start(self) -> "SparkServer":
        """Start the server and wait for /health 200. Raises ``RuntimeError`` (with the log's tail) if it cannot."""
        self.starts += 1
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env}
        t0 = time.monotonic()
        with open(self.log_path(), "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = t0 + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            match = SERVED_RE.search(self.log_path().read_text(errors="replace"))
            if match:
                self.url = match[1]
                break
            time.sleep(0.2)
        else:
            self.kill()
            raise RuntimeError(f"the server did not start in {self.ready_timeout:.0f} s:\n{self.log_tail()}")
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while http.get("/health").status_code != 200:
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"/health never answered 200:\n{self.log_tail()}")
                time.sleep(0.2)
        self.ready_s = time.monotonic() - t0
        return self

    def kill(self) -> None:
        """SIGKILL the server's whole session (an engine process too, if it has one) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL after ``timeout``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "SparkServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def log_text(self) -> str:
        """Everything every start of this server wrote to stdout and stderr."""
        return "".join(self.log_path(i).read_text(errors="replace") for i in range(1, self.starts + 1)
                       if self.log_path(i).exists())

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path().read_text(errors="replace")[-n:] if self.log_path().exists() else ""

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of ``GET /metrics`` (``spark_requests_running`` and so on)."""
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def rss_bytes(self) -> int:
        """Resident memory of the server process and its descendants (from /proc)."""
        return sum(rss_of(pid) for pid in process_tree(self.pid))


def parse_metrics(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            samples[name] = float(value)
    return samples


def process_tree(pid: int) -> list[int]:
    pids, i = [pid], 0
    while i < len(pids):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pids[i]}/task"):
                with open(f"/proc/{pids[i]}/task/{task}/children") as f:
                    pids.extend(int(p) for p in f.read().split())
        i += 1
    return pids


def rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def percentile(values, q: float) -> float | None:
    values = sorted(values)
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def verdict(summary: dict, checks: dict[str, bool]) -> int:
    """Print ``summary`` with its ``checks`` and ``passed`` as JSON; the exit status (0: every check passed)."""
    summary = {**summary, "checks": checks, "passed": all(checks.values())}
    print(json.dumps(summary, indent=2, default=_rounded))
    return 0 if summary["passed"] else 1


def _rounded(value):
    return str(value)


def round3(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
