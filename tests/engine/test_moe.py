"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against HF transformers, on the CPU in float32.

Small random-weight models are built and saved by transformers itself, loaded by Spark
from the saved directory, and must give transformers' greedy tokens for 8 prompts x 32
tokens; the logits' max-abs-diff is printed and bounded.
"""

from __future__ import annotations

import pytest
import tokenizers
import torch

from spark.engine.engine import Engine
from spark.engine.offline import generate
from spark.engine.sampling import SamplingParams
from spark.engine.weights import resolve_model

from .conftest import prefill_logits

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
MAX_ABS_DIFF = 1e-4
VOCAB = 384
# Shared by both families: small, but past a norm's noise (a wide init keeps the router's and the
# head's top choices apart, so that float32 rounding cannot flip a greedy token or an expert).
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, tie_word_embeddings=False)


def _qwen3_moe():
    # head_dim 32 != 64 / 4 as in real Qwen3; layer 1 dense (mlp_only_layers); top-4 of 8 not
    # renormalised (transformers' default; the published models say true, which Mixtral covers).
    return transformers.Qwen3MoeConfig(**_SHAPE, head_dim=32, num_hidden_layers=3, intermediate_size=96,
                                       moe_intermediate_size=32, num_experts=8, num_experts_per_tok=4,
                                       norm_topk_prob=False, mlp_only_layers=[1], rms_norm_eps=1e-6)


def _mixtral():
    return transformers.MixtralConfig(**_SHAPE, num_hidden_layers=2, intermediate_size=96, num_local_experts=4,
                                      num_experts_per_tok=2, rope_theta=1e6, rms_norm_eps=1e-5)


FAMILIES = {"qwen3_moe": (_qwen3_moe, "Qwen3MoeForCausalLM"), "mixtral": (_mixtral, "MixtralForCausalLM")}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(23)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1, 3, 5, 8, 13, 21, 34, 40)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, transformers model in float32, its saved directory)."""
    make_config, cls = FAMILIES[request.param]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(make_config()).float().eval()
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.save(str(directory / "tokenizer.json"))
    return request.param, model, directory


@pytest.fixture(scope="module")
def engine(saved) -> Engine:
    return Engine.load(str(saved[2]), device="cpu", dtype=torch.float32, kv_cache_tokens=4096, progress=False)


def test_config_read_from_the_saved_directory(saved):
    family, model, directory = saved
    c = resolve_model(directory).config
    hf = model.config
    assert c.arch == family and c.num_experts == (hf.num_experts if family == "qwen3_moe" else hf.num_local_experts)
    assert c.num_experts_per_tok == hf.num_experts_per_tok
    if family == "qwen3_moe":
        assert (c.moe_intermediate_size, c.norm_topk_prob, c.dense_layers, c.qk_norm) == (32, False, (1,), True)
    else:  # Mixtral's experts are intermediate_size wide, and its router always renormalises
        assert (c.moe_intermediate_size, c.norm_topk_prob, c.dense_layers) == (96, True, ())


def test_greedy_tokens_and_logits_match_transformers(saved, engine):
    family, model, _ = saved
    prompts = _prompts()
    with torch.inference_mode():
        # The mask given: generate would otherwise mask every token equal to the pad id.
        want = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    outs = generate(engine, prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    got = [[o.token_id for o in seq] for seq in outs]
    for i, (g, w) in enumerate(zip(got, want)):
        first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        assert g == w, f"prompt {i}: first divergence at token {first}"
    # Logits at the last position of each prompt and of each prompt with its 32 tokens.
    full = [p + w for p, w in zip(prompts, want)]
    diffs = []
    for batch in (prompts, full):
        spark = prefill_logits(engine, batch).double()
        with torch.inference_mode():
            ref = torch.stack([model(torch.tensor([s])).logits[0, -1] for s in batch]).double()
        diffs.append((spark - ref).abs().max().item())
    print(f"\n{family}: greedy tokens identical for {len(prompts)} prompts x {NEW_TOKENS}; logits max-abs-diff "
          f"{diffs[0]:.3g} at the prompts' ends, {diffs[1]:.3g} after the 32 tokens (logits' scale "
          f"{ref.abs().max().item():.3g})")
    assert max(diffs) < MAX_ABS_DIFF


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_packed_cpu_formats_leave_the_experts_dense(preset):
    # int4 packs attention's linears; the stacked experts and the router stay dense, in bfloat16.
    engine = Engine.load(f"dummy:{preset}", device="cpu", kv_cache_tokens=512, progress=False)
    moe = engine.model.layers[0].feed_forward
    assert moe.w13.dtype == moe.w2.dtype == moe.gate.weight.dtype == torch.bfloat16
    assert type(engine.model.layers[0].attention.wqkv).__name__ == "Int4Linear"
    outs = generate(engine, [[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o) for o in outs] == [4, 4]


def _write_moe_gguf(path, config, weights: dict[str, torch.Tensor]):
    """A GGUF as llama.cpp writes an MoE: experts stacked [E, rows, cols] under ffn_*_exps, the router
    ffn_gate_inp, Mixtral as arch "llama" with an expert count (q/k rows permuted)."""
    import numpy as np

    from tests.engine.test_weights import gguf_name, gguf_writer, permute

    arch = {"mixtral": "llama", "qwen3_moe": "qwen3moe"}[config.arch]
    module, *projs = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                      "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}[config.arch]
    w = gguf_writer(path, config, arch)
    w.add_expert_count(config.num_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in weights.items():
        t = t.numpy()
        if f".{module}." in name and ".experts." in name:
            if ".experts.0." not in name:
                continue
            layer, proj = name.split(".")[2], name.split(".")[-2]
            stacked = np.stack([weights[name.replace(".experts.0.", f".experts.{e}.")].numpy()
                                for e in range(config.num_experts)])
            kind = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")[projs.index(proj)]
            w.add_tensor(f"blk.{layer}.{kind}.weight", stacked)
            continue
        if name.endswith(f".{module}.gate.weight"):
            w.add_tensor(f"blk.{name.split('.')[2]}.ffn_gate_inp.weight", t)
            continue
        if arch == "llama" and ".q_proj." in name:
            t = permute(t, config.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = permute(t, config.num_kv_heads)
        w.add_tensor(gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_gguf_round_trip(tmp_path, preset):
    """llama.cpp's stacked experts come back as the HF names of each expert; the config as the preset's."""
    from spark.engine.weights import expected_weight_shapes, iter_weights
    from spark.engine.weights.dummy import PRESETS

    config = PRESETS[preset]
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=gen) for n, s in expected_weight_shapes(config).items()}
    path = _write_moe_gguf(tmp_path / f"{preset}.gguf", config, weights)
    source = resolve_model(path)
    assert source.config == config  # Mixtral read from a "llama" file with experts; tiny-qwen3-moe's layer 1 dense
    loaded = dict(iter_weights(source, dtype=torch.float32, progress=False))
    assert loaded.keys() == weights.keys()
    for name, t in weights.items():
        assert torch.equal(loaded[name], t), name
