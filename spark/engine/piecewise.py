"""Piecewise CUDA graphs: a step that is not decode-only, its row-wise parts replayed, its attention eager.

A step carrying a prompt chunk runs a few hundred kernels; launched one by one from Python
the host falls behind the GPU, whatever the step's size. Between two attentions, though,
everything is row-wise over the flat token batch (norms, projections, the MLP or the routed
experts, residual adds), so it can be captured once per token count. A step of T tokens is
padded to the next captured bucket ``b >= T`` and runs as L + 1 graph replays with the L
layers' attention between them:

    [embed, norm, wqkv_0] attn_0 [wo_0, add+norm, FFN_0, add+norm, wqkv_1] attn_1 ...
    attn_{L-1} [wo_{L-1}, add+norm, FFN_{L-1}, final add+norm]

Attention (rope, K/V write, the decode and prefill kernels) reads the step's metadata
(query lengths, context lengths, block tables), so it runs eagerly on the real rows
``[:T]`` only: the padded rows ``[T:b]`` never write K/V and are never attended, and as
every segment op is row-wise, what they compute (from stale rows of the buffers, always
finite) never reaches a real row. The segments hand their results over in static buffers
sized for the largest bucket: ``qkv`` to attention, ``attn`` back, and the residual stream
from segment to segment; ``hidden`` holds the last one's output.

Off a GPU the segments run uncaptured: the very functions a graph would hold, on the same
padded buffers, which is how the CPU tests check the split against the plain forward.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from spark.engine.attention import AttentionMetadata

log = logging.getLogger("spark.piecewise")

# Token counts a step is padded to: steps a quarter to a third apart above 128, where padding
# costs compute rather than launches.
BUCKETS = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048)
# Above this many tokens a step keeps the GPU busy while the host launches it (dummy 8B on an H100,
# benchmarks/step_cost.py: 256 decode rows + 2048 prompt tokens took 69.0 ms piecewise, 70.2 eager;
# + 512 took 28.6 against 36.2), while its graphs' pool would hold ~150 KB a token for good: the
# 8448-token bucket of a server with --max-prefill-tokens 8192 ran the GPU out of memory beside a
# KV cache sized from the free memory.
MAX_TOKENS = 2048


class PiecewiseGraphs:
    """Static buffers and, per token bucket, the L + 1 segment graphs of ``model``'s forward.

    Args:
        model: a ``LlamaModel`` (or a subclass: the MoE models) of one rank alone.
        max_tokens: the most tokens a step may carry (the largest bucket).
        dtype: the activations' dtype.
    """

    def __init__(self, model, *, max_tokens: int, device, dtype: torch.dtype):
        if model.tp.world_size > 1:
            raise ValueError("piecewise graphs run a model of one rank (tensor parallelism stays eager)")
        self.model = model
        self.buckets = [b for b in BUCKETS if b < max_tokens] + [max_tokens]
        n, c = self.buckets[-1], model.shard
        self.device = torch.device(device)
        zeros = functools.partial(torch.zeros, dtype=dtype, device=self.device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.residual = zeros(n, c.hidden_size)  # the residual stream, between segments
        self.qkv = zeros(n, c.q_size + 2 * c.kv_size)  # a segment's last projection, attention's input
        self.attn = zeros(n, c.q_size)  # attention's output, the next segment's input
        self.hidden = zeros(n, c.hidden_size)  # the last segment's output: the final norm's
        self.ready: dict[int, list] = {}  # bucket -> its segments: graph replays, or the functions uncaptured
        self.captures = self.device.type == "cuda"
        self._pool = torch.cuda.graph_pool_handle() if self.captures else None
        # The largest first, which sizes the shared pool that every smaller one then fits in; the
        # rest smallest first, as most steps are small.
        self._to_capture = self.buckets[-1:] + self.buckets[:-1]

    @property
    def progress(self) -> tuple[int, int]:
        """(buckets captured, buckets planned)."""
        return len(self.ready), len(self.buckets)

    def bucket_for(self, tokens: int) -> int | None:
        """The smallest ready bucket that holds ``tokens``, or None."""
        fits = [b for b in self.ready if b >= tokens]
        return min(fits) if fits else None

    def capture_next(self) -> bool:
        """Make one more bucket ready (its graphs captured, on a GPU). Returns False when all are.

        Safe beside launched steps: the segments write only this object's buffers, after the
        device's queued work."""
        if not self._to_capture:
            return False
        b = self._to_capture.pop(0)
        t0 = time.perf_counter()
        segments = [functools.partial(self.segment, i, b) for i in range(len(self.model.layers) + 1)]
        if self.captures:
            segments = self._capture(segments)
        self.ready[b] = segments
        log.info("piecewise graphs for %d tokens ready in %.2fs", b, time.perf_counter() - t0)
        return True

    def capture_all(self) -> None:
        while self.capture_next():
            pass

    def _capture(self, segments: list) -> list:
        """Each segment's graph replay, captured into the shared pool after one warm-up run."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        replays = []
        # capture_begin/end rather than ``torch.cuda.graph``, which synchronizes and empties the
        # allocator's cache at every capture: hundreds of times over all buckets' segments.
        with torch.cuda.stream(stream), torch.inference_mode():
            for segment in segments:
                segment()  # warm-up: Triton compiles and autotunes outside capture
            for segment in segments:
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self._pool)
                try:
                    segment()
                finally:
                    graph.capture_end()
                replays.append(graph.replay)
        torch.cuda.current_stream().wait_stream(stream)
        return replays

    def segment(self, i: int, b: int) -> None:
        """Segment ``i`` of bucket ``b``: from attention ``i - 1``'s output (the embedding at 0) to
        attention ``i``'s qkv (to the hidden states at the last), over rows ``[:b]``."""
        layers = self.model.layers
        if i == 0:
            x, residual = self.model.embed(self.input_ids[:b]), None
        else:
            x, residual = layers[i - 1].after_attention(self.attn[:b], self.residual[:b])
        if i == len(layers):
            self.hidden[:b].copy_(self.model.final_norm(x, residual))
            return
        qkv, residual = layers[i].before_attention(x, residual)
        self.qkv[:b].copy_(qkv)
        self.residual[:b].copy_(residual)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                meta: AttentionMetadata) -> torch.Tensor | None:
        """The model's forward of one step of T tokens (its arguments), through the smallest ready
        bucket that holds them.

        Returns:
            The hidden states [T, D], a view of a static buffer that the next call overwrites (read
            it before: the device's queue orders it), or None when no ready bucket holds T tokens.
        """
        tokens = input_ids.shape[0]
        b = self.bucket_for(tokens)
        if b is None:
            return None
        model, segments = self.model, self.ready[b]
        self.input_ids[:tokens].copy_(input_ids)  # the padded rows keep stale ids: valid, never read back
        rope = model.ops.rope(positions, model.inv_freq)
        # Every layer's attention reads the same rows of ``qkv`` and writes the same rows of ``attn``
        # (the kernels write there, no copy): their per-head views, made once a step.
        first = model.layers[0].attention
        heads = first.heads(self.qkv[:tokens])
        attn = self.attn[:tokens].view(tokens, first.num_heads, first.head_dim)
        segments[0]()
        for layer, (k_cache, v_cache), segment in zip(model.layers, kv_caches, segments[1:]):
            layer.attention.attend_heads(*heads, rope, k_cache, v_cache, meta, out=attn)
            segment()
        return self.hidden[:tokens]
