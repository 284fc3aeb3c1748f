"""Weight loading: the embedded GGUF, GGUF files written here, HF directories, dummy weights, and bad input."""

from __future__ import annotations

import itertools
import json
import logging
import math
import time

import attrs
import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from spark.engine.config import ModelConfig, RopeScaling
from spark.engine.errors import ModelLoadError
from spark.engine.weights import ModelSource, expected_weight_shapes, iter_weights, resolve_model
from spark.engine.weights.dummy import PRESETS, dummy_config, iter_dummy_tensors

Q = gguf.GGMLQuantizationType

# HF -> GGUF names, written out independently of the loader's own table.
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows of llama-arch models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) * 0.1 for n, s in expected_weight_shapes(config).items()}


def gguf_writer(path, config: ModelConfig, arch: str) -> gguf.GGUFWriter:
    """A writer to ``path`` holding ``config``'s shape keys as llama.cpp names them (head sizes only
    where they are not hidden / heads)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    if config.head_dim != config.hidden_size // config.num_heads:
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    return w


def write_gguf(path, config: ModelConfig, weights: dict[str, np.ndarray], *, arch: str | None = None,
               qtype=lambda name: Q.F32, rope_freqs: np.ndarray | None = None, vocab_key: bool = False,
               raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] = {}):
    """Write a GGUF as llama.cpp would: metadata, q/k rows permuted for llama, chosen tensor types.

    ``raw`` holds tensors already in GGUF byte form (stored as is, after ``weights``).
    """
    arch = arch or {"mistral": "llama"}.get(config.arch, config.arch)
    w = gguf_writer(path, config, arch)
    if vocab_key:
        w.add_vocab_size(config.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, t in weights.items():
        if arch == "llama" and ".q_proj." in name:
            t = permute(t, config.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = permute(t, config.num_kv_heads)
        q = qtype(name) if t.ndim == 2 else Q.F32
        if q in (Q.F32, Q.F16, Q.I32):
            w.add_tensor(gguf_name(name), t.astype({Q.F32: np.float32, Q.F16: np.float16, Q.I32: np.int32}[q]))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(t, q), raw_dtype=q)
    for name, (data, q) in raw.items():
        w.add_tensor(gguf_name(name), data, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(spec, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return dict(iter_weights(resolve_model(spec), dtype=dtype, progress=False))


def llama3_factors(theta, head_dim, factor, low, high, orig):
    """The rope_freqs tensor llama.cpp's converter writes for Llama-3 scaling."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


# --- the embedded model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def embedded() -> ModelSource:
    return resolve_model(None)


def test_embedded_config(embedded):
    c = embedded.config
    assert embedded.kind == "gguf" and embedded.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (c.arch, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5 and c.rope_scaling is None and c.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_ids, c.max_position_embeddings) == (1, (2,), 8192)
    assert resolve_model("default") == embedded


def test_embedded_weights(embedded):
    expected = expected_weight_shapes(embedded.config)
    seen, n_params, t0 = [], 0, time.perf_counter()
    for name, t in iter_weights(embedded, dtype=torch.float32, progress=False):  # one tensor alive at a time
        assert tuple(t.shape) == expected[name] and t.dtype == torch.float32, name
        magnitude = t.abs().sum()  # one pass: finite iff every element is, positive iff any is nonzero
        assert torch.isfinite(magnitude) and magnitude > 0, name
        if name == "model.norm.weight":  # the final norm, not a projection, landed here
            assert 1 < t.mean() < 3
        seen.append(name)
        n_params += t.numel()
    print(f"embedded GGUF loaded and checked in float32 in {time.perf_counter() - t0:.2f}s")
    assert sorted(seen) == sorted(expected) and "lm_head.weight" not in seen
    assert n_params == 134_515_008
    first = list(itertools.islice(iter_weights(embedded, dtype=torch.bfloat16, progress=False), 3))
    assert all(t.dtype == torch.bfloat16 for _, t in first)


# --- GGUF written here ----------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
def test_gguf_round_trip_f32(tmp_path, preset):
    """Weights come back exactly: llama-arch q/k rows un-permuted, Qwen's left alone."""
    config = attrs.evolve(dummy_config(preset), rope_scaling=None)
    weights = random_weights(config)
    path = write_gguf(tmp_path / "m.gguf", config, weights)
    source = resolve_model(path)
    assert source.kind == "gguf"
    got = source.config
    assert got.arch == ("llama" if preset == "tiny-mistral" else config.arch)
    assert attrs.evolve(got, arch=config.arch, eos_token_ids=config.eos_token_ids) == config
    loaded = load(path)
    assert set(loaded) == set(weights)
    for name, w in weights.items():
        assert torch.equal(loaded[name], torch.from_numpy(w)), name


@pytest.mark.parametrize("qtype, tol", [(Q.F16, 1e-3), (Q.BF16, 1e-2), (Q.Q8_0, 1e-2), (Q.Q4_0, 0.15), (Q.Q4_1, 0.15)])
def test_gguf_quantized_close_to_original(tmp_path, qtype, tol):
    config = dummy_config("tiny-mistral")
    weights = random_weights(config, seed=1)
    path = write_gguf(tmp_path / "q.gguf", config, weights, qtype=lambda n: qtype)
    loaded = load(path)
    for name, w in weights.items():
        err = (loaded[name] - torch.from_numpy(w)).abs()
        assert err.max() <= tol * np.abs(w).max(), (name, err.max())
        assert err.mean() <= tol * np.abs(w).mean(), (name, err.mean())


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_gguf_k_quants_dequantize(tmp_path, qtype):
    """K-quants (which gguf cannot quantize) come back as gguf.quants.dequantize reads them, un-permuted."""
    config = ModelConfig(arch="llama", vocab_size=32, hidden_size=256, intermediate_size=256, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=64)
    weights = random_weights(config)
    raw = {}  # random K-quant blocks whose f16 scales are small and finite
    rng = np.random.default_rng(0)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    scale_at = {Q.Q4_K: slice(0, 4), Q.Q5_K: slice(0, 4), Q.Q6_K: slice(size - 2, size)}[qtype]
    for name, w in weights.items():
        if w.ndim == 2:
            b = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
            halves = (scale_at.stop - scale_at.start) // 2
            b[..., scale_at] = np.full(b.shape[:2] + (halves,), 0.01, np.float16).view(np.uint8)
            raw[name] = b.reshape(w.shape[0], -1)
    norms = {n: w for n, w in weights.items() if n not in raw}
    path = write_gguf(tmp_path / "k.gguf", config, norms, raw={n: (b, qtype) for n, b in raw.items()})
    loaded = load(path)
    assert set(loaded) == set(weights)
    for name, b in raw.items():
        want = gguf.quants.dequantize(b, qtype)
        got = loaded[name].numpy()
        if ".q_proj." in name or ".k_proj." in name:
            got = permute(got, 4 if ".q_proj." in name else 2)
        assert np.isfinite(want).all() and np.array_equal(got, want), name


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    # Real Llama 3.1 parameters: the tensor maps back to exactly the HF config values.
    big = attrs.evolve(dummy_config("tiny-llama"), head_dim=128, hidden_size=512, rope_theta=500000.0)
    factors = llama3_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    path = write_gguf(tmp_path / "l3.gguf", big, {}, rope_freqs=factors, vocab_key=True)
    assert resolve_model(path).config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    # Other thresholds are fitted; what must match is the per-frequency factors.
    tiny = dummy_config("tiny-llama")
    s = tiny.rope_scaling
    factors = llama3_factors(tiny.rope_theta, 16, s.factor, s.low_freq_factor, s.high_freq_factor,
                             s.original_max_position_embeddings)
    path = write_gguf(tmp_path / "t.gguf", tiny, random_weights(tiny), rope_freqs=factors)
    got = resolve_model(path).config.rope_scaling
    refit = llama3_factors(tiny.rope_theta, 16, got.factor, got.low_freq_factor, got.high_freq_factor,
                           got.original_max_position_embeddings)
    np.testing.assert_allclose(refit, factors, rtol=1e-5)
    assert "rope_freqs.weight" not in load(path)


# --- HF directories -------------------------------------------------------------------------

def hf_config_json(c: ModelConfig, **extra) -> dict:
    return {"model_type": c.arch, "hidden_act": "silu", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
            "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_ids[0], **extra}


def write_hf(directory, config: ModelConfig, weights: dict[str, np.ndarray], *, shards: int = 2, **extra):
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config_json(config, **extra)))
    tensors = {n: torch.from_numpy(w).to(torch.bfloat16) for n, w in weights.items()}
    names = list(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for i, file in enumerate(files):
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


def test_hf_sharded_dir_loads(tmp_path):
    config = dummy_config("tiny-qwen2")
    d = tmp_path / "qwen2"
    tensors = write_hf(d, config, random_weights(config), attention_bias=False)  # Qwen2 configs omit it
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    source = resolve_model(d)
    assert source.kind == "hf" and source.config == attrs.evolve(config, eos_token_ids=(2, 7))
    loaded = load(d)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], t.float()), name


def test_hf_config_variants(tmp_path):
    c = dummy_config("tiny-qwen3")
    write_hf(tmp_path / "q3", c, random_weights(c), shards=1)
    assert resolve_model(tmp_path / "q3").config == c  # head_dim 32 != 64 / 4, qk_norm on
    c = dummy_config("tiny-llama")
    s = attrs.asdict(c.rope_scaling)
    write_hf(tmp_path / "l", c, {}, rope_scaling={"rope_type": "llama3", **s}, eos_token_id=[2, 9])
    assert resolve_model(tmp_path / "l").config == attrs.evolve(c, eos_token_ids=(2, 9))
    write_hf(tmp_path / "y", c, {}, rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported rope_scaling 'yarn'"):
        resolve_model(tmp_path / "y")


# --- bad input --------------------------------------------------------------------------------

def assert_load_error(spec, file_name: str, match: str = ""):
    with pytest.raises(ModelLoadError) as info:
        load(spec)
    assert file_name in str(info.value) and match in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


@pytest.fixture
def small_gguf(tmp_path):
    config = attrs.evolve(dummy_config("tiny-llama"), num_layers=1, rope_scaling=None)
    return write_gguf(tmp_path / "small.gguf", config, random_weights(config)), config


def test_missing_path(tmp_path):
    assert_load_error(tmp_path / "nope.gguf", "nope.gguf", "no such file")


def test_bad_magic_and_corrupt_gguf(tmp_path, small_gguf):
    path, _ = small_gguf
    (tmp_path / "noise.gguf").write_bytes(np.random.default_rng(0).bytes(4096))
    assert_load_error(tmp_path / "noise.gguf", "noise.gguf", "not a GGUF")
    (tmp_path / "garbage.gguf").write_bytes(b"GGUF" + np.random.default_rng(1).bytes(4096))
    assert_load_error(tmp_path / "garbage.gguf", "garbage.gguf", "corrupt")
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert_load_error(tmp_path / "empty.gguf", "empty.gguf")
    data = path.read_bytes()
    for cut in (10, 200, len(data) // 2, len(data) - 4):  # in the header, the tensor infos, the data
        (tmp_path / f"cut{cut}.gguf").write_bytes(data[:cut])
        assert_load_error(tmp_path / f"cut{cut}.gguf", f"cut{cut}.gguf")


@pytest.mark.parametrize("bad_type", [Q.I32, Q.Q8_1])
def test_unsupported_gguf_tensor_type(tmp_path, bad_type):
    config = attrs.evolve(dummy_config("tiny-qwen3"), num_layers=1)
    weights = random_weights(config)
    if bad_type == Q.Q8_1:  # gguf cannot write Q8_1 values either: store zero blocks of the right size
        up = "model.layers.0.mlp.up_proj.weight"
        raw = {up: (np.zeros((128, 64 // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8), Q.Q8_1)}
        path = write_gguf(tmp_path / "t.gguf", config, {n: w for n, w in weights.items() if n != up}, raw=raw)
    else:
        path = write_gguf(tmp_path / "t.gguf", config, weights, qtype=lambda n: bad_type if "up_proj" in n else Q.F32)
    assert_load_error(path, path.name, f"ffn_up.weight has type {bad_type.name}")


def test_unsupported_architecture(tmp_path):
    config = attrs.evolve(dummy_config("tiny-llama"), num_layers=1, rope_scaling=None)
    path = write_gguf(tmp_path / "g.gguf", config, {}, arch="gpt2")
    assert_load_error(path, "g.gguf", "unsupported architecture 'gpt2'")
    write_hf(tmp_path / "hf", config, {}, model_type="gpt_neox")
    assert_load_error(tmp_path / "hf", "config.json", "unsupported model_type 'gpt_neox'")


def test_gguf_missing_extra_and_misshapen_tensors(tmp_path):
    config = attrs.evolve(dummy_config("tiny-qwen2"), num_layers=1)
    w = random_weights(config)
    short = {n: t for n, t in w.items() if n != "model.layers.0.self_attn.k_proj.bias"}
    assert_load_error(write_gguf(tmp_path / "a.gguf", config, short), "a.gguf", "k_proj.bias is missing")
    assert_load_error(write_gguf(tmp_path / "b.gguf", config, {**w, "model.layers.1.mlp.up_proj.weight": w[
        "model.layers.0.mlp.up_proj.weight"]}), "b.gguf", "unexpected tensor model.layers.1.mlp.up_proj.weight")
    bad = {**w, "model.norm.weight": np.ones(32, np.float32)}
    assert_load_error(write_gguf(tmp_path / "c.gguf", config, bad), "c.gguf", "model.norm.weight has shape (32,)")


def test_hf_bad_directories(tmp_path):
    config = attrs.evolve(dummy_config("tiny-llama"), num_layers=1)
    (tmp_path / "empty").mkdir()
    assert_load_error(tmp_path / "empty", "empty/config.json", "missing")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(hf_config_json(config)))
    assert_load_error(tmp_path / "noweights", "noweights", "no *.safetensors")
    weights = random_weights(config)
    write_hf(tmp_path / "shard", config, weights)
    (tmp_path / "shard" / "model-00002-of-00002.safetensors").unlink()
    assert_load_error(tmp_path / "shard", "model-00002-of-00002.safetensors", "missing")
    write_hf(tmp_path / "short", config, {n: w for n, w in weights.items() if n != "lm_head.weight"})
    assert_load_error(tmp_path / "short", "short", "lm_head.weight is missing")
    write_hf(tmp_path / "extra", config, {**weights, "model.layers.0.mlp.bias": np.zeros(4, np.float32)})
    assert_load_error(tmp_path / "extra", "extra", "unexpected tensor model.layers.0.mlp.bias")
    write_hf(tmp_path / "corrupt", config, weights, shards=1)
    shard = tmp_path / "corrupt" / "model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    assert_load_error(tmp_path / "corrupt", "model-00001-of-00001.safetensors", "cannot read safetensors")


def test_bad_dummy_specs():
    assert_load_error("dummy:nope", "dummy:nope", "unknown dummy preset")
    assert_load_error("dummy", "dummy", "needs dummy_config")
    with pytest.raises(ModelLoadError, match="invalid dummy_config"):
        resolve_model("dummy", dummy_config={"arch": "llama", "vocab_size": 8})


def test_model_load_error_is_one_line():
    e = ModelLoadError("/m/x.gguf", "bad magic")
    assert (str(e), e.path, e.problem) == ("/m/x.gguf: bad magic", "/m/x.gguf", "bad magic")


# --- dummy weights ----------------------------------------------------------------------------

def test_dummy_weights_deterministic_nonzero_and_shaped():
    source = resolve_model("dummy:tiny-qwen3")
    a = dict(iter_weights(source, dtype=torch.bfloat16, progress=False))
    b = dict(iter_weights(source, dtype=torch.bfloat16, progress=False))
    other = dict(iter_weights(attrs.evolve(source, dummy_seed=1), dtype=torch.bfloat16, progress=False))
    shapes = expected_weight_shapes(source.config)
    backwards = dict(iter_dummy_tensors(dict(reversed(shapes.items())), seed=0, dtype=torch.bfloat16, device="cpu"))
    assert list(a) == list(shapes)
    for name, t in a.items():
        assert tuple(t.shape) == shapes[name] and t.dtype == torch.bfloat16
        assert torch.equal(t, b[name]) and torch.equal(t, backwards[name]) and not torch.equal(t, other[name])
        assert (t != 0).all(), name
        mean = t.float().mean().item()
        assert (0.9 < mean < 1.1) if "norm" in name else (abs(mean) < 0.02 and t.float().std() < 0.05), name


def test_dummy_presets_have_real_sizes():
    params = {n: sum(math.prod(s) for s in expected_weight_shapes(c).values()) for n, c in PRESETS.items()}
    assert params["llama-3.1-8b"] == 8_030_261_248
    assert params["mistral-7b"] == 7_248_023_552
    assert params["qwen2.5-0.5b"] == 494_032_768
    assert params["smollm2-135m"] == 134_515_008
    assert 590e6 < params["qwen3-0.6b"] < 600e6
    assert params["qwen3-30b-a3b"] == 30_532_122_624
    assert params["mixtral-8x7b"] == 46_702_792_704
    d = resolve_model("dummy", dummy_config=attrs.asdict(PRESETS["tiny-llama"], recurse=True))
    assert d.config == PRESETS["tiny-llama"] and d.kind == "dummy" and d.path is None


def test_progress_logs_every_tenth(caplog):
    with caplog.at_level(logging.INFO, logger="spark.load"):
        list(iter_weights(resolve_model("dummy:tiny-llama"), dtype=torch.float32))
    lines = [r.getMessage() for r in caplog.records if r.name == "spark.load"]
    assert 2 <= len(lines) <= 10 and lines[-1].startswith("loading dummy weights:") and "(100%)" in lines[-1]


def test_progress_counts_the_bytes_on_disk(caplog, monkeypatch):
    # The embedded 93 MB Q4_1 file showed as its 538 MB of float32 (issue 19.3).
    from spark.engine import progress
    from spark.engine.weights import default_model_path

    seen = []
    monkeypatch.setattr(progress.LoadProgress, "advance",
                        lambda self, n: (seen.append((self.total, n)), setattr(self, "done", self.done + n)))
    list(iter_weights(resolve_model("default"), dtype=torch.float32))
    size = default_model_path().stat().st_size
    assert seen and all(total == size for total, _ in seen)
    assert abs(sum(n for _, n in seen) - size) <= len(seen)  # rounding of each tensor's share at most


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_tensors_dequantized_in_row_blocks_equal_whole_ones(tmp_path, monkeypatch, qtype, dtype):
    """Blocks of 3 rows (a 2 KB budget) into one output give what dequantizing each tensor whole, undoing
    llama.cpp's q/k order and casting gave: every type's rows are separate, the row order comes back."""
    from spark.engine.weights import gguf as spark_gguf

    config = dummy_config("tiny-llama")
    weights = random_weights(config, seed=2)
    path = write_gguf(tmp_path / "b.gguf", config, weights, qtype=lambda n: qtype)
    reader = gguf.GGUFReader(path)
    want = {}
    for t in reader.tensors:
        name, shape = spark_gguf.hf_name(t.name), tuple(reversed(t.shape.tolist()))
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        if ".q_proj." in name or ".k_proj." in name:
            w = spark_gguf._unpermute(w, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        want[name] = torch.from_numpy(w.copy()).to(dtype)
    monkeypatch.setattr(spark_gguf, "_BLOCK_BYTES", 3 * 4 * config.hidden_size)
    got = dict(spark_gguf.iter_gguf_tensors(path, config, dtype))
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == dtype and torch.equal(got[name], w), name


def test_the_gguf_header_is_what_ggufs_reader_reads_less_the_tokenizers_arrays():
    """``gguf_header.read_header`` against ``gguf.GGUFReader`` on the default model: every tensor's name,
    type, shape and bytes; every metadata value, but the tokenizer's arrays only as their lengths (the
    reader makes ~500k objects of them, which left ~16 MB resident in a server: issue 19)."""
    from spark.engine.weights import default_model_path
    from spark.engine.weights.gguf_header import read_header

    path = default_model_path()
    reader, header = gguf.GGUFReader(path), read_header(path)
    assert [(t.name, t.tensor_type, tuple(t.shape.tolist())) for t in reader.tensors] == \
        [(t.name, t.tensor_type, t.shape) for t in header.tensors]
    for a, b in zip(reader.tensors, header.tensors):
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries for the file's counts
            continue
        if key.startswith("tokenizer.") and field.types[0] == gguf.GGUFValueType.ARRAY:
            assert key not in header.metadata and header.array_lengths[key] == len(field.data), key
        else:
            assert header.metadata[key] == field.contents(), key
    assert header.array_lengths["tokenizer.ggml.tokens"] == 49152
