"""The CPU's compact weights: each packed module against its dense math, the runtime's choice, and the
default model in 4 bits against float32 (greedy tokens and logits), with the KV cache sized in tokens."""

from __future__ import annotations

import json

import pytest
import torch

from spark.engine.engine import CPU_KV_CACHE_TOKENS, CPU_KV_WARM_TOKENS, Engine
from spark.engine.kv_cache import KVCache
from spark.engine.models import quantized
from spark.engine.models.ops import CpuOps, TritonOps
from spark.engine.models.quantized import Int4Linear, Int8Embedding, Int8Linear, int8_rows
from spark.engine.models.runtime import Runtime
from spark.engine.offline import generate
from spark.engine.sampling import SamplingParams
from spark.engine.weights import default_model_path
from spark.engine.weights.dummy import PRESETS

from .conftest import GOLDEN, prefill_logits

needs_int4 = pytest.mark.skipif(bool(quantized.missing_ops("int4")), reason="this torch lacks the 4-bit CPU ops")


def q4_1_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A weight as a Q4_1 GGUF holds it: groups of 32 along K, each ``q * d + m`` with q in 0..15 (both ends used)."""
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 1e-3
    m = -7.5 * d + torch.randn(n, k // 32, 1, generator=gen) * 0.01
    return (q * d + m).reshape(n, k)


@needs_int4
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_linear_holds_a_q4_1_weight_and_multiplies_by_it(rows):
    gen = torch.Generator().manual_seed(0)
    w = q4_1_weight(96, 128, gen)
    lin = Int4Linear(w)
    assert lin.packed.dtype == torch.uint8 and lin.packed.numel() == 96 * 128 // 2
    x = torch.randn(rows, 128, generator=gen).bfloat16()
    # The groups come back but for the rounding of their scale and zero to bf16 (8 bits of mantissa).
    dequant = lin(torch.eye(128).bfloat16()).float().t()  # [N, K]
    assert (dequant - w).abs().max() <= 2 ** -7 * w.abs().max()
    expected = x.float() @ w.t()
    assert (lin(x).float() - expected).abs().max() <= 0.01 * expected.abs().max()


def test_int8_rows_share_the_embedding_and_the_head():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=gen)
    rows, scale = int8_rows(w)
    assert ((rows.float() * scale[:, None]) - w).abs().max() <= scale.max() / 2 + 1e-6
    emb, head = Int8Embedding(rows, scale, torch.bfloat16), Int8Linear(rows, scale)
    ids = torch.tensor([3, 0, 63])
    assert emb(ids).dtype == torch.bfloat16
    torch.testing.assert_close(emb(ids).float(), w[ids], atol=scale.max().item(), rtol=0.01)
    x = torch.randn(2, 32, generator=gen).bfloat16()
    expected = x.float() @ w.t()
    assert (head(x).float() - expected).abs().max() <= 0.02 * expected.abs().max()


def test_the_runtime_chooses_the_cpu_weights_once():
    cpu = Runtime.for_device("cpu")
    assert isinstance(cpu.ops, CpuOps)
    if quantized.missing_ops("int4"):
        assert (cpu.weight_format, cpu.dtype) == ("dense", torch.float32)  # the clean fallback
    else:
        assert (cpu.weight_format, cpu.dtype, cpu.load_dtype) == ("int4", torch.bfloat16, torch.float32)
    # A dtype asks for dense weights in it; a GPU keeps its kernels and dense bf16.
    assert Runtime.for_device("cpu", torch.float32).weight_format == "dense"
    assert Runtime.for_device("cpu", torch.bfloat16).weight_format == "dense"
    gpu = Runtime.for_device("cuda")
    assert isinstance(gpu.ops, TritonOps) and (gpu.weight_format, gpu.dtype) == ("dense", torch.bfloat16)
    with pytest.raises(ValueError, match="CPU only"):
        Runtime.for_device("cuda", weight_format="int4")
    with pytest.raises(ValueError, match="unknown weight format"):
        Runtime.for_device("cpu", weight_format="int3")
    if not quantized.missing_ops("int4"):
        with pytest.raises(ValueError, match="compute in torch.bfloat16"):
            Runtime.for_device("cpu", torch.float32, "int4")


@needs_int4
@pytest.mark.parametrize("fmt, packed", [("int4", Int4Linear), ("int8", Int8Linear)])
def test_a_packed_dummy_model_keeps_what_the_kernels_cannot_take_dense(fmt, packed):
    # tiny-qwen2: q/k/v with biases stay dense (the kernels take none), the rest is packed.
    engine = Engine.load("dummy:tiny-qwen2", device="cpu", weight_format=fmt, kv_cache_tokens=256, progress=False)
    block = engine.model.layers[0]
    assert isinstance(block.attention.wqkv, torch.nn.Linear) and block.attention.wqkv.weight.dtype == torch.bfloat16
    assert isinstance(block.attention.wo, packed) and isinstance(block.feed_forward.w13, packed)
    assert isinstance(engine.model.tok_embeddings, Int8Embedding) and isinstance(engine.model.output, Int8Linear)
    assert engine.model.output.rows is engine.model.tok_embeddings.rows  # tied: one table
    assert engine.model.inv_freq.dtype == torch.float32
    out = generate(engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0]) == 4


def test_the_kv_cache_is_sized_in_tokens():
    c = PRESETS["smollm2-135m"]
    engine = Engine.load("dummy:tiny-llama", device="cpu", dtype=torch.float32, kv_cache_tokens=100, progress=False)
    assert engine.num_pages == 1 + 7  # 100 tokens in pages of 16, and the allocator's scratch page
    assert engine.new_page_allocator().num_total * engine.page_size >= 100
    default = Engine(engine.model, tokenizer=engine.tokenizer)
    assert default.num_pages == 1 + CPU_KV_CACHE_TOKENS // 16
    with pytest.raises(ValueError, match="not both"):
        Engine(engine.model, kv_cache_tokens=64, kv_cache_bytes=1 << 20)
    assert c.kv_bytes_per_token(2) * CPU_KV_CACHE_TOKENS < 800 << 20  # SmolLM2 in bf16: ~755 MB at most
    # What the prefix cache keeps resident past what live sequences need: at 2048 tokens (47 MB) it grew a
    # server serving 8 streams by ~10 MB past their need, of a 4x-the-GGUF budget (393 MB) (issue 19).
    assert c.kv_bytes_per_token(2) * CPU_KV_WARM_TOKENS <= 12 << 20


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon"))


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads /proc")
def test_a_cpu_kv_cache_is_resident_as_far_as_it_is_written():
    c = PRESETS["smollm2-135m"]
    before = _rss_anon()
    cache = KVCache(c, num_pages=1 + 16384 // 16, page_size=16, dtype=torch.bfloat16, device="cpu")  # 377 MB
    assert _rss_anon() - before < 16 << 20
    for k, v in cache.layers:  # 64 tokens of every layer written
        k[1:5].fill_(1.0)
        v[1:5].fill_(1.0)
    assert _rss_anon() - before < 32 << 20  # 64 * 23 KB = 1.5 MB, in whole pages of memory
    assert not cache.storage[:, :, 5:].any()


@pytest.fixture(scope="module")
def int4_engine() -> Engine:
    return Engine.load("default", device="cpu", weight_format="int4", kv_cache_tokens=8192, progress=False)


@needs_int4
def test_the_default_model_in_4_bits_is_about_its_file_size(int4_engine):
    model = int4_engine.model
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    assert nbytes <= default_model_path().stat().st_size  # 90 MB of a 98 MB GGUF


@needs_int4
def test_the_default_model_in_4_bits_agrees_with_float32(engine, int4_engine):
    """The 13 golden prompts, greedy 16 tokens and the last prompt position's logits, int4 against
    the float32 path (the dequantized GGUF). On 2026-12-02: 174 of 208 greedy tokens agree, 11 of
    13 prompts all 16 (over 32 tokens dense bfloat16 agrees about as often: bf16 activations
    dominate), the logits' cosine is at least 0.9993 (max |diff| 1.1), and the top token is the same
    at every prompt's end; the test asks it only where float32's two best are 0.25 apart (one
    prompt's are 0.08 apart). On 2026-12-03, on an AMD EPYC with AVX512-BF16 (torch takes other bf16
    kernels there): the same 174 of 208, max |diff| 1.0, but a min cosine of 0.9960, hence 0.995."""
    cases = json.loads((GOLDEN / "fidelity.json").read_text())["cases"]
    prompts = [c["prompt_ids"] for c in cases]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [[o.token_id for o in r] for r in generate(engine, prompts, params)]
    got = [[o.token_id for o in r] for r in generate(int4_engine, prompts, params)]
    same = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y))
    first_divergence = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), 16) for x, y in zip(got, want)]
    ref, logits = prefill_logits(engine, prompts).double(), prefill_logits(int4_engine, prompts).double()
    cosine = torch.nn.functional.cosine_similarity(logits, ref, dim=-1)
    best = ref.topk(2, dim=-1).values
    clear = best[:, 0] - best[:, 1] > 0.25
    print(f"\nint4 vs float32: {same}/{16 * len(prompts)} greedy tokens agree, first divergence per prompt "
          f"{first_divergence}; logits max |diff| {(logits - ref).abs().max():.3f}, min cosine {cosine.min():.5f}")
    assert torch.equal(logits.argmax(-1)[clear], ref.argmax(-1)[clear]) and clear.sum() >= 10
    assert same >= 0.7 * 16 * len(prompts)
    assert cosine.min() >= 0.995


@needs_int4
def test_packing_as_loaded_gives_the_weights_packing_after_loading_gave(engine, int4_engine):
    """Each linear packed as its last tensor arrives, and the int8 rows made in blocks: the packed model is
    bit for bit the float32 model packed whole (so its outputs are those of the dense-then-pack load)."""
    import copy

    whole = quantized.pack_model(copy.deepcopy(engine.model), "int4", torch.bfloat16).state_dict()
    streamed = int4_engine.model.state_dict()
    assert whole.keys() == streamed.keys()
    for name, t in whole.items():
        assert t.dtype == streamed[name].dtype and torch.equal(t, streamed[name]), name


@needs_int4
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads /proc")
def test_loading_the_default_model_peaks_well_below_its_float32_size_and_leaves_nothing_behind():
    """The peak resident memory of ``Engine.load("default")`` on the CPU, over what the imports left, in a
    process of its own. It was ~870 MB (the float32 model, 538 MB, whole before packing, and gguf's
    float32 intermediates), then ~480 MB (gguf's reader: ~500k objects for the vocabulary's strings);
    now ~320 MB (the embedding twice in float32, the file's pages).

    And the anonymous memory left once the engine is dropped (issue 19's 4x the GGUF): 22.5 MB with
    gguf's reader, whose freed objects' Python arenas the model's objects, made while they lived,
    pinned (a server kept them all its life); 6.4 MB since the header is walked without it."""
    import subprocess
    import sys

    code = (
        "import ctypes, gc, json\n"
        "def vm(key): return next(int(l.split()[1]) << 10 for l in open('/proc/self/status') if l.startswith(key))\n"
        "def settled(key): gc.collect(); ctypes.CDLL(None).malloc_trim(0); return vm(key)\n"
        "from spark.engine.engine import Engine\n"
        "import gguf, tokenizers  # the load's own imports, before the baseline\n"
        "before, anon = vm('VmRSS'), settled('RssAnon')\n"
        "Engine.load('default', device='cpu', kv_cache_tokens=1024, progress=False)\n"
        "print(json.dumps({'before': before, 'peak': vm('VmHWM'), 'anon_left': settled('RssAnon') - anon}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.splitlines()[-1])
    print(f"\nload: {m['before'] >> 20} MB before, peak {m['peak'] >> 20} MB, {m['anon_left'] >> 20} MB anon left")
    assert m["peak"] - m["before"] < 400 << 20
    assert m["anon_left"] < 12 << 20
