"""CUDA graphs for decode steps: one per batch-size bucket, over static buffers.

A decode step of B sequences is padded up to the next captured bucket: padded
rows write no K/V (slot -1) and attend to nothing (length 0), so their output is
discarded garbage that costs no correctness. Replaying a graph replaces the
hundreds of kernel launches of an eager step with one, which is what makes
small models and batch-1 decode fast on a GPU.

Graphs are captured one bucket at a time (``capture_next``) so that the GPU
runner can interleave capture with serving: the first requests run eagerly,
then graphs take over as buckets become ready.

A step's host work is a handful of calls: one copy of a flat staging buffer (the
graph's first kernel unpacks it, ``kernels/decode_inputs.py``) and the replay. The
graph ends with the greedy tokens of every row in a ring of static rows: a batch
of plain greedy rows needs no sampler launch, and the next step reads those tokens
on the device from the ring.

An engine that speculates also gets verify graphs (``verify_rows``): a step of decode
and verify chunks, flattened into one-token rows (``verify.py``), replays the bucket of
its row count. Their rows write every K/V before any attends, since rows of one
sequence read each other's; otherwise they are decode graphs, over the same buffers,
memory pool and ring, so a verify row's greedy token (which the greedy acceptance
compares with the draft) comes from the ring like any other.
"""

from __future__ import annotations

import logging
import time

import torch

from spark.engine.attention import AttentionMetadata
from spark.engine.kernels import decode_inputs
from spark.engine.sampler import greedy_tokens
from spark.engine.transfer import upload_into

log = logging.getLogger("spark.cuda_graphs")

# Graph steps whose greedy tokens stay on the device: a launched step may read the tokens
# of any step still in flight, so the engine keeps fewer than this many in flight.
RING_ROWS = 4
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    """Static buffers and one graph per batch bucket for ``model``'s decode step."""

    def __init__(self, model, kv_layers, *, max_batch_size: int, max_pages_per_seq: int, device,
                 verify_rows: int = 0):
        self.model = model
        self.kv_layers = kv_layers
        self.buckets = [b for b in BUCKETS if b < max_batch_size] + [max_batch_size]
        self.max_batch = self.buckets[-1]
        # A verify step has 2 rows at least (a token and a draft); none below 2: no verify graphs.
        self.verify_buckets = [b for b in BUCKETS if 2 <= b < verify_rows] + [verify_rows] if verify_rows >= 2 else []
        n, w = max(self.max_batch, verify_rows), max_pages_per_seq
        self.device = torch.device(device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        # The host's one copy a step lands here; host-side feeds add two rows of n after the tables.
        self.staged = torch.zeros(decode_inputs.table_offset(n) + n * w + 2 * n, dtype=torch.int64, device=device)
        self.ring = torch.zeros(RING_ROWS, n, dtype=torch.int64, device=device)  # greedy tokens of recent steps
        self.fed = torch.zeros(n, dtype=torch.int64, device=device)  # ids fed from tokens outside the ring
        self._ring_index = torch.zeros(n, dtype=torch.int64, device=device)  # where each row's token goes
        self._next_ring_row = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        # (rows, verify) largest first, later ones reuse its pool; decode graphs first, which every step uses.
        self._to_capture = ([(b, False) for b in sorted(self.buckets, reverse=True)]
                            + [(b, True) for b in sorted(self.verify_buckets, reverse=True)])

    @property
    def complete(self) -> bool:
        return not self._to_capture

    @property
    def progress(self) -> tuple[int, int]:
        """(buckets captured, buckets planned), verify graphs included."""
        return len(self.graphs) + len(self.verify_graphs), len(self.buckets) + len(self.verify_buckets)

    def bucket_for(self, batch: int, verify: bool = False) -> int | None:
        """The smallest captured bucket (of verify graphs, if ``verify``) that holds ``batch`` rows, or None."""
        ready = [b for b in (self.verify_graphs if verify else self.graphs) if b >= batch]
        return min(ready) if ready else None

    def capture_next(self) -> bool:
        """Capture one more bucket. Returns False when all are captured.

        Nothing may be in flight: capture writes a ring row."""
        if not self._to_capture:
            return False
        b, verify = self._to_capture.pop(0)
        t0 = time.perf_counter()
        self._stage_padding(b)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up: Triton compiles and autotunes outside capture
                self._forward(b, verify)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(b, verify)
        if self._pool is None:
            self._pool = graph.pool()
        (self.verify_graphs if verify else self.graphs)[b] = (graph, logits)
        log.info("captured %s graph for %d rows in %.2fs", "verify" if verify else "decode", b,
                 time.perf_counter() - t0)
        return True

    def capture_all(self) -> None:
        while self.capture_next():
            pass

    def unpack(self, b: int) -> None:
        """Spread the staging buffer into rows ``[:b]`` of the step's buffers: a graph's first kernel."""
        unpack = (decode_inputs.unpack_decode_inputs_triton if self.device.type == "cuda"
                  else decode_inputs.unpack_decode_inputs_reference)
        unpack(self.staged, b, self.ring, self.fed, self.input_ids, self.positions, self.slot_mapping,
               self.seq_lens, self.block_tables, self._ring_index)

    def _forward(self, b: int, verify: bool = False) -> torch.Tensor:
        """The captured forward of ``b`` rows: decode rows, or verify rows (K/V written before attending)."""
        self.unpack(b)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            decode_only=True,
            writes_first=verify,
        )
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_layers, meta)
        logits = self.model.compute_logits(hidden)
        # Every step's argmax, wanted or not: a few microseconds of the GPU, against a
        # sampler's launches from the host for the plain greedy batches that use it.
        greedy_tokens(logits, into=(self.ring, self._ring_index[:b]))
        return logits

    def _stage_padding(self, b: int) -> None:
        """A staging buffer of ``b`` padding rows (no K/V written, nothing attended), as capture runs them."""
        rows = torch.tensor([[0], [0], [-1], [0], [decode_inputs.FEED_AS_SENT]]).expand(5, b).reshape(-1)
        self.staged[: decode_inputs.table_offset(b)].copy_(torch.cat([torch.zeros(2, dtype=torch.int64), rows]))

    def ring_offset(self, tokens: torch.Tensor) -> int | None:
        """Where ``tokens`` (a step's tokens) start in the flattened ring, or None when they live elsewhere."""
        start = self.ring.data_ptr()
        ptr = tokens.data_ptr()
        if tokens.device != self.ring.device or tokens.dtype != self.ring.dtype or tokens.dim() != 1:
            return None
        if not start <= ptr < start + self.ring.numel() * self.ring.element_size() or tokens.stride(0) != 1:
            return None
        return (ptr - start) // self.ring.element_size()

    @torch.inference_mode()
    def run(self, ids, positions, slots, seq_lens, tables: list[list[int]], feeds=(), verify: bool = False):
        """Replay the graph for one decode step of ``len(ids)`` sequences.

        Args:
            verify: the rows are a verify step's (``verify.decode_rows``): replay a verify graph.
            feeds: ``(tokens, rows, picks)``: input ids that launched steps are still
                sampling, ``tokens[picks]`` (a device tensor, host lists of rows)
                in place of ``ids[rows]``. Tokens in the ring are read by the graph;
                others are copied in first.

        Returns:
            ``(logits [B, V], greedy tokens [B])``, views into static buffers: the
            logits are valid until the next replay, the tokens (a ring row) for
            ``RING_ROWS - 1`` replays more. None when no captured bucket fits.
        """
        batch = len(ids)
        bucket = self.bucket_for(batch, verify)
        width = max(len(t) for t in tables)
        if bucket is None or width > self.block_tables.shape[1]:
            return None
        ring_row = self._next_ring_row
        self._next_ring_row = (ring_row + 1) % RING_ROWS
        pad = bucket - batch
        feed = [decode_inputs.FEED_AS_SENT] * bucket
        host_fed = []  # (tokens, rows, picks) fed through self.fed
        for tokens, rows, picks in feeds:
            base = self.ring_offset(tokens)
            if base is None:
                host_fed.append((tokens, rows, picks))
                for r in rows:
                    feed[r] = decode_inputs.FEED_FROM_FED
            else:
                for r, p in zip(rows, picks):
                    feed[r] = base + p
        # Everything the step reads in one pinned staging buffer and one copy, the padding
        # rows included: the host never waits for the device here, and the graph unpacks it.
        values = [width, ring_row, *ids, *[0] * pad, *positions, *[0] * pad, *slots, *[-1] * pad,
                  *seq_lens, *[0] * pad, *feed]
        for t in tables:
            values += t
            values += [0] * (width - len(t))
        values += [0] * (pad * width)
        at = len(values)
        for _, rows, picks in host_fed:
            values += rows
            values += picks
        upload_into(self.staged, values)
        for tokens, rows, picks in host_fed:
            n = len(rows)
            self.fed.index_copy_(0, self.staged[at:at + n], tokens.index_select(0, self.staged[at + n:at + 2 * n]))
            at += 2 * n
        graph, logits = (self.verify_graphs if verify else self.graphs)[bucket]
        graph.replay()
        return logits[:batch], self.ring[ring_row, :batch]
