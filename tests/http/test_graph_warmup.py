"""The background warm-up of decode graphs, as a server reports it: graphs are captured only
while no step waits, their progress is on /metrics, and a capture that fails leaves the
server decoding eagerly (and says so there) instead of taking it down."""

from __future__ import annotations

import threading
import time

from tests.http.replay import ReplayEngine, qwen_like_tokenizer, replay_server
from tests.http.test_lifecycle import _metric


class CapturingEngine(ReplayEngine):
    """A replay engine with the capture interface of the real one: ``planned`` graphs, each
    taking ``capture_seconds``; capture number ``fail_at`` raises, as a failed capture would."""

    def __init__(self, *, planned: int, capture_seconds: float = 0.01, fail_at: int | None = None):
        super().__init__(qwen_like_tokenizer(), {}, default="Warm.")
        self.planned, self.capture_seconds, self.fail_at = planned, capture_seconds, fail_at
        self.captured = 0
        self.overlapped = 0  # captures that ran while a step was under way
        self._stepping = threading.Event()

    def enable_cuda_graphs(self, max_batch_size: int, verify_rows: int = 0, max_step_tokens: int | None = None) -> bool:
        return True

    def capture_next_graph(self) -> bool:
        if self.captured == self.planned:
            return False
        if self.captured == self.fail_at:
            raise RuntimeError("capture failed (out of memory)")
        self.overlapped += self._stepping.is_set()
        time.sleep(self.capture_seconds)
        self.captured += 1
        return self.captured < self.planned

    def graph_progress(self) -> tuple[int, int]:
        return self.captured, self.planned

    def step(self, plan):
        self._stepping.set()
        try:
            return super().step(plan)
        finally:
            self._stepping.clear()


def _wait_for(http, name: str, value: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(http, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


def _ask(server) -> str:
    reply = server.client().chat.completions.create(
        model="replay", messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
    return reply.choices[0].message.content


def test_graphs_are_captured_in_the_background_and_counted_on_metrics():
    engine = CapturingEngine(planned=5, capture_seconds=0.3)
    with replay_server(engine) as server, server.http() as http:
        assert _metric(http, "spark_decode_graphs_planned") == 5
        assert _metric(http, "spark_decode_graphs_captured") < 5
        assert _ask(server) == "Warm."  # served while capture goes on
        assert engine.captured < 5
        _wait_for(http, "spark_decode_graphs_captured", 5)
        assert engine.overlapped == 0  # never while a step ran
        assert _ask(server) == "Warm."


def test_a_failed_capture_leaves_the_server_decoding_eagerly():
    engine = CapturingEngine(planned=4, fail_at=2)
    with replay_server(engine) as server, server.http() as http:
        _wait_for(http, "spark_decode_graphs_captured", 2)
        assert _metric(http, "spark_decode_graphs_planned") == 4
        assert _ask(server) == "Warm."
        time.sleep(0.2)
        assert engine.captured == 2  # no retry after the failure


def test_an_engine_without_graphs_plans_none():
    with replay_server(ReplayEngine(qwen_like_tokenizer(), {})) as server, server.http() as http:
        assert _metric(http, "spark_decode_graphs_planned") == 0
        assert _metric(http, "spark_decode_graphs_captured") == 0
