"""Spark against HF transformers on the embedded SmolLM2 GGUF: prompt ids, greedy tokens and logits.

The golden files come from ``scripts/record_fidelity_golden.py`` (float32, greedy
32 tokens without an EOS stop, logits at the last prompt position), so in float32
on the CPU Spark must agree token for token and to a few 1e-5 in the logits.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from spark.engine.offline import generate
from spark.engine.sampling import SamplingParams

from .conftest import GOLDEN, prefill_logits

CASES = json.loads((GOLDEN / "fidelity.json").read_text())["cases"]
CASE_IDS = [f"{i}-{c['kind']}" for i, c in enumerate(CASES)]
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
MAX_ABS_DIFF = 1e-3
MIN_COSINE = 0.99999


@pytest.fixture(scope="module")
def spark_greedy(engine) -> list[list[int]]:
    """Spark's greedy tokens for every golden prompt, all 13 in one batch (batching is checked in test_engine)."""
    results = generate(engine, [c["prompt_ids"] for c in CASES], GREEDY_32)
    return [[out.token_id for out in outs] for outs in results]


@pytest.mark.parametrize("i", range(len(CASES)), ids=CASE_IDS)
def test_tokenizer_reproduces_golden_prompt_ids(engine, i):
    case = CASES[i]
    if case["kind"] == "raw":
        ids = engine.tokenizer.encode(case["text"])
    else:
        ids = engine.tokenizer.encode_chat(case["source"])
    assert ids == case["prompt_ids"]


@pytest.mark.parametrize("i", range(len(CASES)), ids=CASE_IDS)
def test_greedy_tokens_match_golden(spark_greedy, i):
    got, want = spark_greedy[i], CASES[i]["greedy_ids"]
    first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert got == want, f"first divergence at token {first}: spark {got[first:first + 4]} vs golden {want[first:first + 4]}"


def test_last_prompt_logits_match_golden(engine):
    golden = load_file(str(GOLDEN / "fidelity_logits.safetensors"))
    logits = prefill_logits(engine, [c["prompt_ids"] for c in CASES]).double()  # [13, V]
    rows = []
    for i, name in enumerate(CASE_IDS):
        ref = golden[f"case{i}"].double()
        diff = (logits[i] - ref).abs().max().item()
        cosine = torch.nn.functional.cosine_similarity(logits[i], ref, dim=0).item()
        rows.append((diff, cosine, name))
    worst_diff, worst_cos = max(rows), min(rows, key=lambda r: r[1])
    summary = (f"worst max-abs-diff {worst_diff[0]:.3g} ({worst_diff[2]}), "
               f"worst cosine 1 - {1 - worst_cos[1]:.3g} ({worst_cos[2]})")
    print(f"\nfidelity logits over {len(rows)} cases: {summary}")
    assert worst_diff[0] < MAX_ABS_DIFF and worst_cos[1] > MIN_COSINE, summary


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order: each head's two rotary halves interleaved pair by pair."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def test_a_gguf_permutation_mistake_changes_the_output(engine):
    """Re-permuting one layer's q rows (as a loader that forgot to undo it would) must break greedy fidelity."""
    case, params = CASES[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    q_rows = engine.model.layers[0].attention.wqkv.weight[: engine.config.q_size]  # a view into the fused weight
    saved = q_rows.detach().clone()
    with torch.no_grad():
        q_rows.copy_(llama_cpp_permute(saved, engine.config.num_heads))
    try:
        broken = [o.token_id for o in generate(engine, [case["prompt_ids"]], params)[0]]
    finally:
        with torch.no_grad():
            q_rows.copy_(saved)
    restored = [o.token_id for o in generate(engine, [case["prompt_ids"]], params)[0]]
    assert restored == case["greedy_ids"][:8]
    assert broken != restored
