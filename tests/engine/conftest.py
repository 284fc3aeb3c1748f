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
    """Logits [B, V] at the last position of each prompt, from one batched prefill through ``engine.model``.

    Builds the ``AttentionMetadata`` the way ``Engine.step`` does, on pages of a private
    allocator, so it overwrites whatever those pages held: call it with no live sequence.
    """
    from spark.engine.attention import AttentionMetadata

    allocator, page_size = engine.new_page_allocator(), engine.page_size
    ids, positions, slots, qsl, tables = [], [], [], [0], []
    for b, prompt in enumerate(prompts):
        table = allocator.allocate(b, len(prompt))
        tables.append(table)
        ids += prompt
        positions += range(len(prompt))
        slots += [table[p // page_size] * page_size + p % page_size for p in range(len(prompt))]
        qsl.append(qsl[-1] + len(prompt))
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32),
        block_tables=torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        decode_only=False,
    )
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(ids), torch.tensor(positions), engine.kv_cache.layers, meta)  # [T, D]
        return engine.model.compute_logits(hidden[torch.tensor(qsl[1:]) - 1])  # [B, V]
