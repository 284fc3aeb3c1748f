"""Timing GPU calls too short to time one launch at a time (used by the kernel benchmarks)."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def graph_time_us(calls: list[Callable[[], object]], reps: int = 9) -> float:
    """Median time of one call, in us, replaying all of ``calls`` back to back in one CUDA graph.

    A decode kernel at batch 1 takes a few microseconds, less than a launch from Python:
    timed one launch at a time it would measure the launcher. In a graph, as in the
    engine's decode graphs, only the GPU's own time (and the gaps between kernels) count.
    Every call runs once on a side stream first, so that Triton compiles outside the capture.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(calls))
    del graph
    return statistics.median(times)
