"""Loading a model into an ``Engine``: resolve the source, build the model on its device from the
streamed weights (this rank's slice under tensor parallelism), the tokenizer, then the engine and its
KV cache. ``Engine.load`` calls it.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

import attrs
import torch

from spark.engine.device import IdleCoreThreads, checked_device, default_device, give_back_freed_heap, map_large_blocks
from spark.engine.models import model_class
from spark.engine.models.runtime import Runtime, build_model
from spark.engine.parallel import SINGLE, TensorParallel
from spark.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from spark.engine.engine import Engine

log = logging.getLogger("spark.engine")


def load_engine(
    cls,
    model: str | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    page_size: int = 16,
    kv_cache_bytes: int | None = None,
    kv_cache_tokens: int | None = None,
    max_model_len: int | None = None,
    weight_format: str | None = None,
    adapt_cpu_threads: bool = False,
    dummy_config=None,
    progress: bool = True,
    tp: TensorParallel = SINGLE,
    kv_dtype: str = "auto",
    kv_calibration: bool = True,
) -> "Engine":
    """Load ``model`` ("default", a .gguf path, an HF directory or "dummy[:preset]") and build an engine.

    Args:
        cls: the engine's class (``Engine``), built from the loaded model.
        dtype: of the activations and the KV cache; the device's default when None (bfloat16 on a GPU;
          on the CPU the weight format's, float32 for dense weights).
        kv_cache_bytes, kv_cache_tokens: the KV cache's size, one or neither; by default 90% of the
          GPU memory free after loading, or ``engine.CPU_KV_CACHE_TOKENS`` tokens on the CPU.
        weight_format: "dense", or on the CPU "int4" (4-bit groups of 32, bfloat16 activations) or
          "int8" (int8 rows, bfloat16 activations); None: "int4" on the CPU unless ``dtype`` is
          given, dense elsewhere (see ``Runtime.for_device`` and ``models/quantized.py``).
        adapt_cpu_threads: on the CPU, let torch's threads follow the cores other processes leave
          idle, set before each step (``device.IdleCoreThreads``); else they stay as they are.
        tp: this rank's tensor-parallel group (``parallel.join``): the engine then holds this rank's
          slice of the model, on ``tp.device``; ``spark.engine.ranks`` starts and drives the ranks.
        kv_dtype: the KV cache's: "auto" (``dtype``) or "fp8" (e4m3 with per-head scales: twice the
          tokens in the same bytes).
        kv_calibration: an fp8 cache's scales from one short prefill (``kv_calibration.py``), else 1.0.

    Raises:
        ModelLoadError: the model cannot be read; its message names the file and the problem.
        ValueError: a weight format this device or torch cannot run, or one at odds with ``dtype``.
    """
    from spark.engine.weights import iter_weights, resolve_model

    source = resolve_model(model, dummy_config=dummy_config)
    source.config.shard(tp.world_size)  # a model the ranks cannot split fails before it loads
    if tp.device is not None:
        device = tp.device
    device = checked_device(device) if device is not None else default_device()
    runtime = attrs.evolve(Runtime.for_device(device, dtype, weight_format), tp=tp)
    t0 = time.perf_counter()
    if runtime.device.type == "cpu":
        map_large_blocks()
    select = None
    if tp.world_size > 1:
        select = functools.partial(model_class(source.config.arch).weight_slice, source.config, tp)
    weights = iter_weights(source, dtype=runtime.load_dtype, device=runtime.device, progress=progress,
                           select=select)
    net = build_model(source.config, runtime, weights)
    tokenizer = Tokenizer.for_source(source)
    if source.kind == "gguf":
        from spark.engine.weights import gguf

        gguf.forget_readers()
    if runtime.device.type == "cpu":
        give_back_freed_heap()
    log.info("loaded %s (%s) on %s, %s weights, in %.1fs", source.path or "dummy", source.kind, runtime.device,
             runtime.weight_format, time.perf_counter() - t0)
    engine = cls(net, tokenizer=tokenizer, page_size=page_size, kv_cache_bytes=kv_cache_bytes,
                 kv_cache_tokens=kv_cache_tokens, max_model_len=max_model_len, kv_dtype=kv_dtype)
    if kv_dtype == "fp8" and kv_calibration:
        from spark.engine import kv_calibration as calibration

        t0 = time.perf_counter()
        tokens = calibration.calibration_tokens(engine)
        scales = calibration.calibrate(engine, tokens)
        log.info("fp8 KV scales from a %d-token prefill in %.1fs: K %s, V %s", len(tokens), time.perf_counter() - t0,
                 sorted(set(scales[:, 0].flatten().tolist())), sorted(set(scales[:, 1].flatten().tolist())))
    if adapt_cpu_threads and runtime.device.type == "cpu":
        engine.threads = IdleCoreThreads()
    return engine
