"""What one decode layer of an MoE model launches at batch 1, in order, counted on the CPU.

    TRITON_INTERPRET=1 python benchmarks/moe_launches.py [--preset tiny-qwen3-moe] [--context 128]

A CUDA graph replays exactly what the eager step launches, and at batch 1 each launch costs
a few microseconds of drain and fill on the GPU (the MoE step is a chain of small kernels),
so the list of launches of one sparse layer is the thing to shrink. The model runs with the
GPU's ops (``TritonOps``; kernels in Triton's interpreter) through a prompt of ``--context - 1``
tokens and then one decode step, during which it records

- Triton launches (``kernel[grid](...)``), by kernel name;
- torch ops that run a kernel on a GPU (``mm``, ``add``, ``copy_``, ...): every aten op but
  those that only make a tensor or a view (``attention_launches.NO_KERNEL``); the cuBLAS
  GEMV behind ``nn.Linear`` counts as one.

in the order they run inside the first sparse layer, and the totals of the whole step. The
kernels' shapes of the tiny preset differ from the real model's, not their number (except
the decode attention's split-reduce, which depends on the context: hence ``--context``).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's spark

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from attention_launches import NO_KERNEL, op_name  # noqa: E402  (a sibling: benchmarks/ is the script's directory)


class Recorder(TorchDispatchMode):
    """Every kernel-running aten op and Triton launch, in order, tagged with the layer it ran in."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[int | None, str]] = []
        self.layer: int | None = None
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            name = op_name(func, args, out)
            aliased = isinstance(out, torch.Tensor) and args and out is args[0]  # e.g. ``.float()`` of fp32
            if name not in NO_KERNEL and not aliased:
                self.events.append((self.layer, "aten:" + name))
        return out


PAGE = 16


def _one_sequence(start: int, tokens: int, pages: int):
    """(positions, meta) of one sequence's step of ``tokens`` from position ``start``, pages 0.. in a row."""
    from spark.engine.attention import AttentionMetadata, leading_single_rows

    qsl = [0, tokens]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(start, start + tokens), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([start + tokens], dtype=torch.int32),
        block_tables=torch.arange(pages, dtype=torch.int32)[None], decode_only=tokens == 1, max_query_len=tokens,
        num_single=leading_single_rows(qsl), writes_first=False)
    return torch.arange(start, start + tokens), meta


def record_decode_step(preset: str, context: int, dummy_config: dict | None = None) -> tuple[Recorder, object]:
    """(the recorder of one batch-1 decode step at ``context`` tokens, the model)."""
    from triton.runtime.interpreter import InterpretedFunction

    from spark.engine.models.ops import TritonOps
    from spark.engine.weights import resolve_model
    from spark.engine.kv_cache import KVCache
    from spark.engine.weights import iter_weights
    from spark.engine.models.runtime import Runtime, build_model

    source = resolve_model(f"dummy:{preset}") if dummy_config is None else resolve_model(
        "dummy", dummy_config=dummy_config)
    runtime = Runtime(torch.device("cpu"), torch.float32, TritonOps())
    model = build_model(source.config, runtime, iter_weights(source, dtype=torch.float32, device="cpu", progress=False))
    pages = -(-context // PAGE)
    cache = KVCache(source.config, pages, PAGE, torch.float32, torch.device("cpu"))
    recorder = Recorder()
    run = InterpretedFunction.run

    def recorded_run(self, *a, **kw):
        recorder.events.append((recorder.layer, "triton:" + self.__name__))
        recorder.paused = True  # the interpreter's own tensor traffic is no launch of ours
        try:
            return run(self, *a, **kw)
        finally:
            recorder.paused = False

    for index, layer in enumerate(model.layers):
        def tagged(module, args, index=index):
            recorder.layer = index

        def untagged(module, args, output):
            recorder.layer = None

        layer.register_forward_pre_hook(tagged)
        layer.register_forward_hook(untagged)
        # The one-row block calls no layer's forward: tag it around ``block_one_row`` too.
    block_one_row = getattr(model.ops, "block_one_row", None)
    if block_one_row is not None:
        def tagged_one_row(block, *a, **kw):
            recorder.layer = list(model.layers).index(block)
            try:
                return block_one_row(block, *a, **kw)
            finally:
                recorder.layer = None

        model.ops.block_one_row = tagged_one_row
    InterpretedFunction.run = recorded_run
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            positions, meta = _one_sequence(0, context - 1, pages)
            ids = torch.randint(0, source.config.vocab_size, positions.shape, generator=gen)
            model(ids, positions, cache.layers, meta)
            positions, meta = _one_sequence(context - 1, 1, pages)
            recorder.events.clear()
            with recorder:
                model(ids[:1], positions, cache.layers, meta)
    finally:
        InterpretedFunction.run = run
    return recorder, model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-qwen3-moe")
    ap.add_argument("--context", type=int, default=128, help="tokens of the sequence, the decoded one included")
    args = ap.parse_args()
    recorder, model = record_decode_step(args.preset, args.context)
    config = model.config
    sparse = next(i for i in range(config.num_layers) if config.is_sparse(i))
    dense = [i for i in range(config.num_layers) if not config.is_sparse(i)]
    layer_events = [name for layer, name in recorder.events if layer == sparse]
    print(json.dumps({
        "preset": args.preset, "context": args.context, "layers": config.num_layers,
        "sparse_layer": sparse, "sparse_layer_launches": len(layer_events), "sparse_layer_order": layer_events,
        "dense_layer_launches": (sum(1 for layer, _ in recorder.events if layer == dense[0]) if dense else None),
        "outside_layers": [name for layer, name in recorder.events if layer is None],
        "step_launches": len(recorder.events),
    }))


if __name__ == "__main__":
    main()
