"""GGUF files (llama.cpp's format): config from metadata, weights dequantized to HF names and layout.

The file is memory-mapped (``gguf_header``), so a tensor is read from disk only when it is
dequantized, and only one dequantized tensor exists at a time.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import re
from typing import Any, Iterator

import gguf
import numpy as np
import torch

from spark.engine.config import ModelConfig, RopeScaling
from spark.engine.errors import ModelLoadError
from spark.engine.models import ARCHITECTURES, GGUF_ARCHS
from spark.engine.weights.gguf_header import GGUFHeader, read_header

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
# An MoE layer's experts, each stacked into one [E, rows, cols] tensor; yielded one expert at a time
# under the HF names of its family (``Architecture.moe_names``: module, gate, up, down).
_EXPERT_NAMES = {"ffn_gate_exps.weight": 1, "ffn_up_exps.weight": 2, "ffn_down_exps.weight": 3}
_ROUTER = "ffn_gate_inp.weight"
# Llama-3 frequency scaling, which llama.cpp stores as a tensor rather than as metadata.
ROPE_FREQS = "rope_freqs.weight"


def hf_name(gguf_name: str, moe_names: tuple[str, ...] = ()) -> str:
    """The HF name of a GGUF tensor; unknown names come back unchanged (and fail validation).

    A stacked expert tensor's name comes back with ``{e}`` where the expert's index goes."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m[2] in _BLOCK_NAMES:
        return f"model.layers.{m[1]}.{_BLOCK_NAMES[m[2]]}"
    if m and moe_names and m[2] == _ROUTER:
        return f"model.layers.{m[1]}.{moe_names[0]}.gate.weight"
    if m and moe_names and m[2] in _EXPERT_NAMES:
        return f"model.layers.{m[1]}.{moe_names[0]}.experts.{{e}}.{moe_names[_EXPERT_NAMES[m[2]]]}.weight"
    return gguf_name


def _arch_of(path, reader: GGUFHeader):
    """The ``Architecture`` of a file: its ``general.architecture``, or Mixtral for a "llama" with experts."""
    gguf_arch = _meta(reader, path, "general.architecture")
    if gguf_arch not in GGUF_ARCHS:
        raise ModelLoadError(path, f"unsupported architecture {gguf_arch!r} (supported GGUF archs: {', '.join(GGUF_ARCHS)})")
    if gguf_arch == "llama" and int(_meta(reader, path, "llama.expert_count", 0)) > 0:
        return ARCHITECTURES["mixtral"]
    return GGUF_ARCHS[gguf_arch]


def open_gguf(path: str | os.PathLike) -> GGUFHeader:
    """The header of ``path`` and a map of its tensors, shared between calls while the file is unchanged
    (the config reader and the weight loader read it once). The tokenizer's arrays are left out:
    the tokenizer reads them itself (``Tokenizer.from_gguf``).

    Raises:
      ModelLoadError: missing file, bad magic, truncated or corrupt header.
    """
    path = pathlib.Path(path)
    try:
        st = path.stat()
    except OSError as e:
        raise ModelLoadError(path, f"cannot read file ({e.strerror or e})") from e
    return _open_cached(str(path.resolve()), st.st_mtime_ns, st.st_size)


def forget_readers() -> None:
    """Drop the shared headers: a loaded model needs its file no more, and a header's map holds
    the pages of the file it touched (for SmolLM2-135M, 93 MB)."""
    _open_cached.cache_clear()


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFHeader:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(path, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return read_header(path)
    except Exception as e:  # a damaged file fails in many ways
        raise ModelLoadError(path, f"truncated or corrupt GGUF file ({type(e).__name__}: {e})") from e


def _meta(reader: GGUFHeader, path, key: str, default: Any = ...) -> Any:
    if key not in reader.metadata:
        if default is ...:
            raise ModelLoadError(path, f"GGUF metadata lacks {key}")
        return default
    value = reader.metadata[key]
    if isinstance(value, list):  # per-layer values (head counts); Spark needs them uniform
        if not value or any(v != value[0] for v in value):
            raise ModelLoadError(path, f"{key} varies per layer ({value[:4]}...), which Spark does not support")
        value = value[0]
    return value


def _f32(value: float) -> float:
    """GGUF stores these as float32: take the shortest decimal that round-trips (1e-5, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def config_from_gguf(path: str | os.PathLike) -> ModelConfig:
    """Read a ``ModelConfig`` from a GGUF file's metadata (and tensor list).

    Raises:
      ModelLoadError: unreadable file, unsupported architecture or rope scaling, missing metadata.
    """
    reader = open_gguf(path)
    arch = _arch_of(path, reader)
    gguf_arch = _meta(reader, path, "general.architecture")

    def meta(key: str, default: Any = ...) -> Any:
        return _meta(reader, path, f"{gguf_arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    if int(meta("attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(path, "attention.value_length differs from key_length, which Spark does not support")
    if int(meta("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(path, "partial rotary embedding (rope.dimension_count != head_dim) is not supported")
    vocab = meta("vocab_size", None)
    if vocab is None:
        embd = tensors.get("token_embd.weight")
        tokens = reader.array_lengths.get("tokenizer.ggml.tokens")
        if embd is None and tokens is None:
            raise ModelLoadError(path, "GGUF has neither a vocab size, token_embd.weight nor a token list")
        vocab = int(embd.shape[1]) if embd is not None else tokens
    rope_theta = _f32(meta("rope.freq_base", 10000.0))

    scaling_type = meta("rope.scaling.type", "none")
    if scaling_type != "none" and float(meta("rope.scaling.factor", 1.0)) != 1.0:
        raise ModelLoadError(path, f"unsupported rope scaling type {scaling_type!r}")
    rope_scaling = None
    if ROPE_FREQS in tensors:
        factors = gguf.quants.dequantize(tensors[ROPE_FREQS].data, tensors[ROPE_FREQS].tensor_type)
        rope_scaling = rope_scaling_from_factors(path, np.asarray(factors, np.float64).ravel(), rope_theta, head_dim)

    eos = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):  # llama.cpp stops on all of them
        tok = _meta(reader, path, f"tokenizer.ggml.{key}", None)
        if tok is not None and int(tok) not in eos:
            eos.append(int(tok))
    bos = _meta(reader, path, "tokenizer.ggml.bos_token_id", None)
    return ModelConfig(
        arch=arch.name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm=arch.qk_norm,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        **_moe_fields(meta, arch, tensors),
    )


def _moe_fields(meta, arch, tensors) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a mixture of experts (none for a dense family). llama.cpp
    renormalises Qwen3-MoE's top-k weights unless the file says otherwise; a layer with no router is dense."""
    experts = int(meta("expert_count", 0))
    if not arch.moe_names or not experts:
        return {}
    layers = int(meta("block_count"))
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(meta("expert_used_count")),
        moe_intermediate_size=int(meta("expert_feed_forward_length", meta("feed_forward_length"))),
        norm_topk_prob=arch.norm_topk_prob or bool(meta("expert_weights_norm", True)),
        dense_layers=tuple(i for i in range(layers) if f"blk.{i}.{_ROUTER}" not in tensors),
    )


def llama3_factors(s: RopeScaling, rope_theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors [head_dim // 2] that Llama-3 scaling applies (what llama.cpp stores)."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    medium = 1.0 / ((1 - smooth) / s.factor + smooth)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, s.factor, medium))


def rope_scaling_from_factors(path, factors: np.ndarray, rope_theta: float, head_dim: int) -> RopeScaling | None:
    """Recover Llama-3 ``RopeScaling`` from llama.cpp's ``rope_freqs`` tensor.

    Only the two wavelength thresholds matter (``original_max / low`` and
    ``original_max / high``), so ``original_max_position_embeddings`` is fixed
    at Llama-3's 8192 and the two factors are fitted to the smooth band: there
    ``1/f = (1-s)/factor + s`` with ``s`` linear in the frequency. The result
    is checked by recomputing the factors.
    """
    if factors.shape != (head_dim // 2,):
        raise ModelLoadError(path, f"{ROPE_FREQS} has shape {factors.shape}, expected ({head_dim // 2},)")
    if np.allclose(factors, 1.0):
        return None
    factor, orig = float(factors.max()), 8192
    candidates = [RopeScaling(factor, 1.0, 4.0, orig)]  # Llama 3.1/3.2/3.3 all use these
    x = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / (2 * math.pi)  # 1/wavelen
    band = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if band.sum() >= 2 and factor > 1:
        s = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(x[band], s, 1)  # s = a * x + b = (x - 1/low_wavelen) / (1/high_wavelen - 1/low_wavelen)
        if a > 0:
            candidates.append(RopeScaling(factor, float(-b / a * orig), float((1 - b) / a * orig), orig))
    for cand in candidates:
        if cand.high_freq_factor > cand.low_freq_factor and np.allclose(
            llama3_factors(cand, rope_theta, head_dim), factors, rtol=1e-4
        ):
            return cand
    raise ModelLoadError(path, f"{ROPE_FREQS} does not follow Llama-3 rope scaling; Spark cannot use it")


def check_types(path, reader: GGUFHeader) -> None:
    """Fail early, before any weight is loaded, on a tensor type ``gguf.quants`` cannot dequantize."""
    probed = set()
    for t in reader.tensors:
        if t.tensor_type in probed:
            continue
        probe = t.data if t.data.ndim < 2 else t.data[:1]  # one row is enough to know
        try:
            gguf.quants.dequantize(probe, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(path, f"tensor {t.name} has type {t.tensor_type.name}, which cannot be dequantized") from e
        probed.add(t.tensor_type)


def gguf_tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """HF name -> HF shape of every weight in the file (the rope factors tensor excluded)."""
    reader = open_gguf(path)
    check_types(path, reader)
    moe_names = _arch_of(path, reader).moe_names
    shapes = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        name, shape = hf_name(t.name, moe_names), tuple(reversed(t.shape))
        if "{e}" in name:  # [E, rows, cols]: one [rows, cols] tensor per expert
            shapes.update((name.format(e=e), shape[1:]) for e in range(shape[0]))
        else:
            shapes[name] = shape
    return shapes


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (pairs interleaved per head) back to HF's halves.

    Its converter stores rows as [head, pair, 2] where HF has [head, 2, pair]
    (reshape to (n_head, 2, rows/n_head/2, ...) then swapaxes(1, 2)); the
    inverse swaps the same two axes back.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Rows dequantized at once: gguf.quants works on a whole array and keeps every group's float32
# output alive until it concatenates them, so a tensor is fed to it in blocks of about this many
# bytes of output (1 MB), each written straight into the tensor being yielded.
_BLOCK_BYTES = 1 << 20


def iter_gguf_tensors(
    path: str | os.PathLike, config: ModelConfig, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, CPU tensor in ``dtype`` and HF layout), one tensor at a time, in file order.

    A tensor is dequantized in row blocks into its own preallocated output, so loading costs
    about one tensor in ``dtype`` on top of the map, not several float32 copies of it. Rows are
    independent in every GGML type (a row is a whole number of blocks), so the values are the
    same as dequantizing it whole and then casting to ``dtype``.
    """
    reader = open_gguf(path)
    permuted = reader.get("general.architecture") == "llama"
    moe_names = _arch_of(path, reader).moe_names
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        name = hf_name(t.name, moe_names)
        shape = tuple(reversed(t.shape))
        # [rows, row bytes or elements]: the header's array has every dimension but the last as rows.
        raw = t.data.reshape(-1, t.data.shape[-1])
        order = None  # llama.cpp's q/k row order, undone as the rows are written
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            order = _unpermuted_rows(shape[0], config.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            order = _unpermuted_rows(shape[0], config.num_kv_heads)
        try:
            if "{e}" in name:  # stacked experts [E, rows, cols], one at a time
                rows = raw.shape[0] // shape[0]
                for e in range(shape[0]):
                    yield name.format(e=e), _dequantized(raw[e * rows:(e + 1) * rows], t.tensor_type, shape[1:], dtype)
                continue
            w = _dequantized(raw, t.tensor_type, shape, dtype, order)
        except Exception as e:
            raise ModelLoadError(path, f"cannot dequantize tensor {t.name} ({t.tensor_type.name}): {e}") from e
        yield name, w


def _unpermuted_rows(rows: int, n_head: int) -> np.ndarray:
    """Where each of llama.cpp's q/k rows goes in HF's order (the inverse of ``_unpermute``'s row map)."""
    return np.argsort(_unpermute(np.arange(rows), n_head))


def _dequantized(raw: np.ndarray, qtype, shape: tuple[int, ...], dtype: torch.dtype,
                 order: np.ndarray | None = None) -> torch.Tensor:
    """``raw`` [rows, row bytes] of GGML type ``qtype`` as a ``dtype`` tensor of ``shape``, in blocks of rows.

    ``order``: row ``order[i]`` of the result is row ``i`` of ``raw`` (None: the same order)."""
    out = torch.empty(shape, dtype=dtype)
    if out.dim() == 1:  # a norm or a bias: one row, small
        flat = _f32_rows(raw, qtype).view(-1)
        return out.copy_(flat) if order is None else out.index_copy_(0, torch.from_numpy(order), flat.to(dtype))
    rows = out.view(raw.shape[0], -1)  # [rows, cols]
    step = max(1, _BLOCK_BYTES // (4 * rows.shape[1]))
    for start in range(0, raw.shape[0], step):
        block = _f32_rows(raw[start:start + step], qtype).view(-1, rows.shape[1])
        if order is None:
            rows[start:start + block.shape[0]].copy_(block)  # a cast where dtype is not float32
        else:
            rows.index_copy_(0, torch.from_numpy(order[start:start + block.shape[0]]), block.to(dtype))
    return out


def _f32_rows(raw: np.ndarray, qtype) -> torch.Tensor:
    """Rows of the map, dequantized to a float32 tensor (F32's come back as a view of the read-only map)."""
    rows = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32)
    return torch.from_numpy(rows if rows.flags.writeable else rows.copy())
