"""CUDA graphs for decode steps: one per batch-size bucket, over static buffers.

A decode step of B sequences is padded up to the next captured bucket: padded
rows write no K/V (slot -1) and attend to nothing (length 0), so their output is
discarded garbage that costs no correctness. Replaying a graph replaces the
hundreds of kernel launches of an eager step with one, which is what makes
small models and batch-1 decode fast on a GPU.

Graphs are captured one bucket at a time (``capture_next``) so that the GPU
runner can interleave capture with serving: the first requests run eagerly,
then graphs take over as buckets become ready.
"""

from __future__ import annotations

import logging
import time

import torch

from spark.engine.attention import AttentionMetadata
from spark.engine.transfer import to_device

log = logging.getLogger("spark.cuda_graphs")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    """Static buffers and one graph per batch bucket for ``model``'s decode step."""

    def __init__(self, model, kv_layers, *, max_batch_size: int, max_pages_per_seq: int, device):
        self.model = model
        self.kv_layers = kv_layers
        self.buckets = [b for b in BUCKETS if b < max_batch_size] + [max_batch_size]
        self.max_batch = self.buckets[-1]
        n, w = self.max_batch, max_pages_per_seq
        # Input ids, positions and slots: rows of one buffer, so that a step fills them in one copy.
        self._rows64 = torch.zeros(3, n, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._rows64
        self.slot_mapping.fill_(-1)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._to_capture = sorted(self.buckets, reverse=True)  # largest first: later ones reuse its pool

    @property
    def complete(self) -> bool:
        return not self._to_capture

    def bucket_for(self, batch: int) -> int | None:
        """The smallest captured bucket that holds ``batch`` rows, or None."""
        ready = [b for b in self.graphs if b >= batch]
        return min(ready) if ready else None

    def capture_next(self) -> bool:
        """Capture one more bucket. Returns False when all are captured."""
        if not self._to_capture:
            return False
        b = self._to_capture.pop(0)
        t0 = time.perf_counter()
        self._reset_rows()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up: Triton compiles and autotunes outside capture
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(b)
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[b] = (graph, logits)
        log.info("captured decode graph for batch %d in %.2fs", b, time.perf_counter() - t0)
        return True

    def capture_all(self) -> None:
        while self.capture_next():
            pass

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            decode_only=True,
        )
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_layers, meta)
        return self.model.compute_logits(hidden)

    def _reset_rows(self) -> None:
        """Every row a padding row (no K/V written, nothing attended), as capture runs them."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()

    @torch.inference_mode()
    def run(self, ids, positions, slots, seq_lens, tables: list[list[int]], feeds=()) -> torch.Tensor | None:
        """Replay the graph for one decode step of ``len(ids)`` sequences.

        Args:
            feeds: ``(tokens, rows, picks)``: input ids that launched steps are still
                sampling, ``tokens[picks]`` (a device tensor, host lists of rows)
                written over ``ids[rows]`` on the device.

        Returns:
            logits ``[B, V]`` (a view into the graph's output; read it before the
            next replay), or None when no captured bucket fits.
        """
        batch = len(ids)
        bucket = self.bucket_for(batch)
        width = max(len(t) for t in tables)
        if bucket is None or width > self.block_tables.shape[1]:
            return None
        # Everything the step reads in one pinned staging buffer and one copy, the padding
        # rows included (slot -1 writes no K/V, length 0 attends to nothing): the host
        # never waits for the device here, and a step costs a handful of launches besides
        # the replay (at batch 1 of a small model the host's time per step is the limit).
        pad = bucket - batch
        values = [*ids, *[0] * pad, *positions, *[0] * pad, *slots, *[-1] * pad, *seq_lens, *[0] * pad]
        for t in tables:
            values += t
            values += [0] * (width - len(t))
        values += [0] * (pad * width)
        for _, rows, picks in feeds:
            values += rows
            values += picks
        flat = to_device(torch.tensor(values, dtype=torch.int64), self.input_ids.device)
        self._rows64[:, :bucket].copy_(flat[:3 * bucket].view(3, bucket))
        self.seq_lens[:bucket].copy_(flat[3 * bucket:4 * bucket])
        at = 4 * bucket
        self.block_tables[:bucket, :width].copy_(flat[at:at + bucket * width].view(bucket, width))
        at += bucket * width
        for tokens, rows, picks in feeds:
            n = len(rows)
            self.input_ids.index_copy_(0, flat[at:at + n], tokens.index_select(0, flat[at + n:at + 2 * n]))
            at += 2 * n
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:batch]
