"""The model's kernel choices agree: TritonOps (in the interpreter) and CpuOps against TorchOps.

Kernel choice lives in the ``Runtime`` rather than in ``x.is_cuda``, so the GPU path
of the whole model (the fused decode attention, the mixed-step split, the one-row
block, the 33-64-row small-linear kernel with split-K) runs on the CPU here.
"""

import os

# Before anything can JIT a kernel: @triton.jit picks interpreter or compiler when it
# runs, and spark's kernels are only decorated at their first launch.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from spark.engine.attention import AttentionMetadata, leading_single_rows
from spark.engine.kernels import norm, small_linear
from spark.engine.kv_cache import KVCache
from spark.engine.models.ops import CpuOps, TorchOps, TritonOps
from spark.engine.models.runtime import Runtime, build_model
from spark.engine.weights import iter_weights, resolve_model
from tests.engine.kernels.conftest import dot_of_values

PAGE = 4


def _model(source, ops, dtype, num_seqs=3):
    runtime = Runtime(torch.device("cpu"), dtype, ops)
    net = build_model(source.config, runtime, iter_weights(source, dtype=dtype, device="cpu", progress=False))
    return net, KVCache(source.config, 8 * num_seqs, PAGE, dtype, torch.device("cpu"))


def _step(chunks, decode_only, writes_first=False):
    """(positions, meta) of a step of chunks (seq, first position, tokens); seq b owns pages 8b..8b+7."""
    slots, qsl, lens, tables, positions = [], [0], [], [], []
    for b, start, n in chunks:
        table = list(range(8 * b, 8 * b + 8))
        positions += range(start, start + n)
        slots += [table[p // PAGE] * PAGE + p % PAGE for p in range(start, start + n)]
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
        tables.append(table)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        decode_only=decode_only, max_query_len=max(n for _, _, n in chunks), num_single=leading_single_rows(qsl),
        writes_first=writes_first,
    )
    return torch.tensor(positions), meta


# Prefill of two prompts; a mixed step (a decode first, then a chunk); a decode-only
# batch (the fused rope + write + attend launch); one row (the fused one-row block).
STEPS = [([(0, 0, 6), (1, 0, 3)], False), ([(0, 6, 1), (1, 3, 4)], False),
         ([(0, 7, 1), (1, 7, 1), (2, 0, 1)], True), ([(1, 8, 1)], True)]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral"])
def test_triton_ops_match_torch_ops_step_by_step(preset):
    source = resolve_model(f"dummy:{preset}")
    ref, ref_cache = _model(source, TorchOps(), torch.float32)
    fused, fused_cache = _model(source, TritonOps(), torch.float32)
    # Qwen2's biases keep the unfused block; an MoE block has a one-row form of its own (moe_one_row_triton).
    assert fused.one_row is not source.config.attention_bias
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for chunks, decode_only in STEPS:
            positions, meta = _step(chunks, decode_only)
            ids = torch.randint(0, source.config.vocab_size, positions.shape, generator=gen)
            expected = ref(ids, positions, ref_cache.layers, meta)  # [T, D]
            torch.testing.assert_close(fused(ids, positions, fused_cache.layers, meta), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral"])
def test_cpu_ops_match_torch_ops_step_by_step(preset, dtype):
    """The CPU's ops (one-call norm, five-op rotation, the batched decode attention with its
    padding mask) against the references, through prefill, mixed, decode and one-row steps."""
    source = resolve_model(f"dummy:{preset}")
    ref, ref_cache = _model(source, TorchOps(), dtype)
    cpu, cpu_cache = _model(source, CpuOps(), dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for chunks, decode_only in STEPS:
            positions, meta = _step(chunks, decode_only)
            ids = torch.randint(0, source.config.vocab_size, positions.shape, generator=gen)
            expected = ref(ids, positions, ref_cache.layers, meta).float()
            got = cpu(ids, positions, cpu_cache.layers, meta).float()
            if dtype == torch.float32:
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            else:  # the norm rounds once where the reference rounds twice: a few bf16 ulps
                assert (got - expected).abs().max() <= 0.03 * expected.abs().max()
        # The decode steps wrote the same K/V into the same slots.
        torch.testing.assert_close(cpu_cache.storage.float(), ref_cache.storage.float(),
                                   rtol=0 if dtype == torch.float32 else 0.02, atol=1e-5 if dtype == torch.float32 else 0.05)


@pytest.mark.parametrize("ops", [TritonOps, CpuOps])
def test_an_fp8_cache_step_by_step(ops):
    """TritonOps (the fused decode kernel, the rope + write kernel, prefill) and CpuOps (bytes moved by
    index ops) against TorchOps with fp8 caches of per-head scales: the same K/V bits stored, the same
    hidden states up to the rounding of a few stored values."""
    from spark.engine.kernels.fp8 import FP8

    source = resolve_model("dummy:tiny-llama")
    ref, _ = _model(source, TorchOps(), torch.float32)
    other, _ = _model(source, ops(), torch.float32)
    ref_cache, other_cache = (KVCache(source.config, 24, PAGE, FP8, torch.device("cpu")) for _ in range(2))
    for cache in (ref_cache, other_cache):
        cache.scales.copy_(torch.linspace(0.01, 0.05, cache.scales.numel()).view(cache.scales.shape))
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for chunks, decode_only in STEPS:
            positions, meta = _step(chunks, decode_only)
            ids = torch.randint(0, source.config.vocab_size, positions.shape, generator=gen)
            expected = ref(ids, positions, ref_cache.layers, meta)
            got = other(ids, positions, other_cache.layers, meta)
            assert (got - expected).abs().max() <= 1e-2 * expected.abs().max()
    same = (other_cache.storage.view(torch.uint8) == ref_cache.storage.view(torch.uint8)).float().mean()
    assert same > 0.99


def test_small_row_kernel_path_of_a_wide_model(bf16_rounds_to_nearest, monkeypatch):
    """40 decode rows of a 2048-wide bf16 model: wo and w2 split over K, the gate in w13's epilogue."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot_of_values)
    config = dict(arch="llama", vocab_size=256, hidden_size=2048, intermediate_size=2048, num_layers=1,
                  num_heads=16, num_kv_heads=4, head_dim=128)
    source, rows = resolve_model("dummy", dummy_config=config), 40
    assert small_linear.beats_cublas(rows, 2048, torch.bfloat16) and small_linear.split_config(rows, 2048, 2048)
    outs = []
    for ops in (TorchOps(), TritonOps()):
        net, cache = _model(source, ops, torch.bfloat16, num_seqs=rows)
        positions, meta = _step([(b, 0, 1) for b in range(rows)], True)
        with torch.inference_mode():
            outs.append(net(torch.arange(rows), positions, cache.layers, meta).float())
    expected, got = outs
    # bf16 products summed in another order, through one block: within a couple of ulps of the largest value.
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


def test_head_of_one_row_takes_the_small_row_kernel(bf16_rounds_to_nearest, monkeypatch):
    """A 2048-wide bf16 head: one row in the small-row kernel (batch-1 decode), its scores in fp32, two rows
    in F.linear; the scores the reference's up to the order of the fp32 sums."""
    launches, real = [], small_linear.small_linear_triton

    def counted(x, weight, **kw):
        launches.append(x.shape[0])
        return real(x, weight, **kw)

    monkeypatch.setattr(small_linear, "small_linear_triton", counted)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 2048, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, 2048, generator=gen).to(torch.bfloat16)
    for rows in (1, 2):
        got = TritonOps.head(x[:rows], weight)
        expected = TorchOps.head(x[:rows].float(), weight.float())
        assert got.shape == (rows, 300) and got.dtype == (torch.float32 if rows == 1 else torch.bfloat16)
        assert (got.float() - expected).abs().max() <= 0.01 * expected.abs().max()
        # fp32 scores that are bf16 values: what the projection and a cast give
        assert torch.equal(got.float(), got.to(torch.bfloat16).float())
    assert launches == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_norms_are_the_references_bit_for_bit(dtype):
    """CpuOps' norms (``F.rms_norm`` without the weight, then the weight's product) round as the reference."""
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 8, 65):
        x = (torch.randn(rows, 576, generator=gen) * 4).to(dtype)
        residual = torch.randn(rows, 576, generator=gen).to(dtype)
        weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
        assert torch.equal(CpuOps.rms_norm(x, weight, 1e-5), norm.rms_norm_reference(x, weight, 1e-5))
        got, ref = CpuOps.add_rms_norm(x, residual, weight, 1e-5), norm.add_rms_norm_reference(x, residual, weight, 1e-5)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
