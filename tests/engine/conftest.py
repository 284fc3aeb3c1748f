"""Shared engine fixtures: the embedded SmolLM2 GGUF, loaded once per session in float32 on the CPU."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from spark.engine.engine import Engine

GOLDEN = pathlib.Path(__file__).parent / "golden"
# ~5.8k tokens of context in float32: plenty for the tests, and 4x less memory to zero than the CPU default.
KV_CACHE_BYTES = 256 << 20


@pytest.fixture(scope="session")
def engine() -> Engine:
    """The default model. Tests share it: they must leave no sequence behind and restore any weight they touch."""
    return Engine.load("default", device="cpu", dtype=torch.float32, kv_cache_bytes=KV_CACHE_BYTES, progress=False)


@pytest.fixture(scope="session")
def golden() -> dict:
    """``fidelity.json``: 13 cases of prompt ids and HF transformers' greedy ids (see scripts/record_fidelity_golden.py)."""
    return json.loads((GOLDEN / "fidelity.json").read_text())


def prefill_logits(engine: Engine, prompts: list[list[int]]) -> torch.Tensor:
    """Logits [B, V] at the last position of each prompt, from one batched prefill (``offline.prefill_logits``:
    call it with no live sequence)."""
    from spark.engine.offline import prefill_logits as logits_at

    return logits_at(engine, prompts)[:, -1]
