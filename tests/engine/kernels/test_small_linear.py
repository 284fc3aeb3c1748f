import attrs
import pytest
import torch

from spark.engine.kernels import small_linear as sl
from tests.engine.kernels.conftest import assert_bf16_nearly_exact

pytestmark = pytest.mark.usefixtures("exact_bf16_in_interpreter")  # bf16 as on a GPU (conftest)


def make_inputs(m, n, k, dtype, *, prologue, residual, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * k if prologue == "gated" else k, generator=g).to(dtype)
    if prologue == "norm":
        x = x * 3.0 + 0.5  # an rms far from 1, so that a missing normalisation shows
    kwargs = {
        "norm_weight": (torch.rand(k, generator=g) + 0.5).to(dtype) if prologue == "norm" else None,
        "gated": prologue == "gated",
        "residual": torch.randn(m, n, generator=g).to(dtype) if residual else None,
    }
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return x, weight, kwargs


def assert_matches(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if actual.dtype == torch.bfloat16:
        assert_bf16_nearly_exact(actual, expected, min_exact=0.97)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("early_tile", [False, True], ids=["", "early_tile"])
@pytest.mark.parametrize("path", ["deferred", "each_step", "dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
@pytest.mark.parametrize("prologue", ["plain", "norm", "gated"])
@pytest.mark.parametrize("one_row", [False, True], ids=["", "one_row"])
def test_matches_reference(prologue, residual, dtype, path, early_tile, one_row):
    # K and N off the block sizes: a tail step along K and a partial last program along N. One row
    # takes the flat product (Config.flat_row), except on the tensor cores.
    cases = {"plain": (3, 100, 200), "norm": (8, 48, 136), "gated": (5, 72, 96)}
    m, n, k = cases[prologue]
    m = 1 if one_row else m
    x, weight, kwargs = make_inputs(m, n, k, dtype, prologue=prologue, residual=residual)
    config = sl.Config(block_n=16, block_k=64, use_dot=path == "dot", defer_reduce=path == "deferred",
                       early_tile=early_tile, flat_row=one_row)
    assert_matches(sl.small_linear_triton(x, weight, config=config, **kwargs), sl.small_linear_reference(x, weight, **kwargs))


@pytest.mark.parametrize("m", range(1, 9))
def test_every_batch_size_with_default_config(m):
    """Every M of a decode batch, through the launch shape the model would get (both kernel paths)."""
    x, weight, kwargs = make_inputs(m, 56, 384, torch.bfloat16, prologue="norm", residual=True, seed=m)
    expected = sl.small_linear_reference(x, weight, **kwargs)
    assert_matches(sl.small_linear_triton(x, weight, **kwargs), expected)


@pytest.mark.parametrize("m", [17, 40, 64])
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
def test_plain_product_of_up_to_64_rows(m, residual):
    """Past 16 rows the tensor-core tiles grow to 32 and 64 rows (the default config of
    Llama-shaped weights, tiles shrunk to this test's small K and N)."""
    x, weight, kwargs = make_inputs(m, 72, 160, torch.bfloat16, prologue="plain", residual=residual, seed=m)
    assert sl.default_config(m, 4096, 4096).use_dot and sl.default_config(m, 28672, 4096).use_dot
    config = sl.Config(block_n=32, block_k=64, use_dot=True)
    assert_matches(sl.small_linear_triton(x, weight, config=config, **kwargs), sl.small_linear_reference(x, weight, **kwargs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("m, use_dot", [(1, False), (40, True), (64, True)])
def test_split_k_partials(m, use_dot, split_k, dtype):
    """Each program's partial product over its run of K, in fp32 (N off the block size:
    a partial last program)."""
    x, weight, _ = make_inputs(m, 72, 256, dtype, prologue="plain", residual=False, seed=m + split_k)
    config = sl.Config(block_n=32, block_k=32, use_dot=use_dot, defer_reduce=False, split_k=split_k)
    partials = sl.small_linear_split_k_triton(x, weight, config)
    expected = sl.small_linear_split_k_reference(x, weight, split_k)
    assert partials.shape == (split_k, m, 72) and partials.dtype == torch.float32
    torch.testing.assert_close(partials, expected, rtol=1e-4, atol=1e-4)
    # The partials sum to the product (the unsplit kernel's, before its rounding).
    torch.testing.assert_close(partials.sum(0), x.float() @ weight.float().T, rtol=1e-4, atol=1e-4)


def test_split_config_for_few_outputs_at_33_to_64_rows():
    """Llama-3.1-8B's wo and w2 (4096 outputs) split at 64 rows; w13, the vocabulary and
    the rows with prologues do not; every chosen split is whole block_k steps."""
    for k in (4096, 14336):
        cfg = sl.split_config(64, 4096, k)
        assert cfg is not None and cfg.split_k == 2 and k % (cfg.split_k * cfg.block_k) == 0
    assert sl.split_config(33, 4096, 4096) is not None
    assert sl.split_config(16, 4096, 4096) is None and sl.split_config(1, 4096, 4096) is None
    assert sl.split_config(64, 28672, 4096) is None and sl.split_config(64, 128256, 4096) is None
    assert sl.split_config(64, 4096, 4096 + 256) is None  # K not whole steps in both halves


def test_split_k_wants_whole_block_steps_per_partition():
    x, weight, _ = make_inputs(4, 32, 96, torch.float32, prologue="plain", residual=False)
    with pytest.raises(AssertionError, match="whole block_k steps"):
        sl.small_linear_split_k_triton(x, weight, sl.Config(block_n=32, block_k=32, split_k=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [3, 40])
def test_gated_output(m, dtype):
    """silu(x @ W_gate.T) * (x @ W_up.T) in the epilogue, K off the block size (a tail step)."""
    x, weight, _ = make_inputs(m, 2 * 40, 96, dtype, prologue="plain", residual=False, seed=m)
    got = sl.small_linear_triton(x, weight, gated_output=True, config=sl.Config(block_n=16, block_k=64, use_dot=True))
    want = sl.small_linear_reference(x, weight, gated_output=True)
    assert want.shape == (m, 40)
    assert not torch.allclose(want, sl.small_linear_reference(x, weight)[:, :40], atol=1e-2)  # the gate did something
    assert_matches(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prologue", ["plain", "norm"])
def test_gated_output_on_the_one_row_path(prologue, dtype):
    """Batch 1's w13: the norm before, the gate after, products reduced every step (no tensor cores)."""
    x, weight, kwargs = make_inputs(1, 2 * 40, 96, dtype, prologue=prologue, residual=False, seed=5)
    config = sl.Config(block_n=8, block_k=64, defer_reduce=False)
    want = sl.small_linear_reference(x, weight, gated_output=True, **kwargs)
    assert want.shape == (1, 40)
    assert_matches(sl.small_linear_triton(x, weight, gated_output=True, config=config, **kwargs), want)
    assert not sl.default_config(1, 14336, 4096, norm=True, gated_output=True).use_dot
    with pytest.raises(AssertionError, match="reduces every step"):
        sl.small_linear_triton(x, weight, gated_output=True, config=attrs.evolve(config, defer_reduce=True), **kwargs)


def test_no_prologue_past_16_rows():
    x, weight, kwargs = make_inputs(17, 32, 64, torch.bfloat16, prologue="norm", residual=False)
    with pytest.raises(AssertionError, match="no prologue"):
        sl.small_linear_triton(x, weight, **kwargs)


def test_strided_input_rows():
    # x as a column slice of a wider buffer, the way a fused projection's output is split.
    x_wide, weight, kwargs = make_inputs(4, 64, 96, torch.bfloat16, prologue="gated", residual=False)
    x = torch.cat((x_wide, torch.randn(4, 40).to(torch.bfloat16)), dim=1)[:, : x_wide.shape[1]]
    assert not x.is_contiguous()
    expected = sl.small_linear_reference(x_wide, weight, **kwargs)
    assert_matches(sl.small_linear_triton(x, weight, config=sl.Config(block_n=8, block_k=32), **kwargs), expected)


def test_prologues_change_the_result():
    """Guards the test above against a reference that ignores its prologue arguments."""
    x, weight, kwargs = make_inputs(2, 32, 64, torch.float32, prologue="norm", residual=False)
    plain = sl.small_linear_reference(x, weight)
    assert not torch.allclose(plain, sl.small_linear_reference(x, weight, **kwargs), atol=1e-2)
    gate_up = torch.cat((x, x), dim=1)
    assert not torch.allclose(plain, sl.small_linear_reference(gate_up, weight, gated=True), atol=1e-2)


def test_flat_row_for_one_row_of_a_small_weight():
    assert sl.default_config(1, 960, 576, norm=True).flat_row  # SmolLM2's wqkv
    assert sl.default_config(1, 2 * 1536, 576, norm=True, gated_output=True).flat_row  # and its w13
    assert not sl.default_config(1, 4096, 4096).flat_row  # Llama-3.1-8B's wo
    # a flat config given more rows takes the [rows, outputs, K] product: the same results
    x, weight, kwargs = make_inputs(3, 40, 96, torch.float32, prologue="norm", residual=True)
    assert_matches(sl.small_linear_triton(x, weight, config=sl.Config(block_n=8, block_k=32, flat_row=True), **kwargs),
                   sl.small_linear_reference(x, weight, **kwargs))


def test_early_tile_for_small_weights_only():
    assert sl.default_config(1, 960, 576, norm=True).early_tile  # SmolLM2's wqkv
    assert not sl.default_config(1, 4096, 4096).early_tile  # Llama-3.1-8B's wo
    assert not sl.default_config(40, 2 * 96, 576, gated_output=True).early_tile
    x, weight, _ = make_inputs(3, 2 * 40, 96, torch.bfloat16, prologue="plain", residual=False)
    with pytest.raises(AssertionError, match="early tile"):
        sl.small_linear_triton(x, weight, gated_output=True,
                               config=sl.Config(block_n=16, block_k=64, use_dot=True, early_tile=True))


def test_default_config_fills_the_gpu():
    # Llama-3.1-8B's wo at batch 1: at least 2 programs for each of an H200's 132 SMs.
    cfg = sl.default_config(1, 4096, 4096)
    assert -(-4096 // cfg.block_n) >= 2 * 132 and not cfg.use_dot
    assert sl.default_config(8, 4096, 4096).use_dot


def test_folded_norm_stays_close_to_the_unfused_ops():
    """The kernel's norm (rstd on the fp32 product) against rms_norm then linear, which
    round the normalised x twice: the same outputs up to those roundings."""
    from spark.engine.kernels import norm

    x, weight, kwargs = make_inputs(4, 256, 512, torch.bfloat16, prologue="norm", residual=False)
    fused = sl.small_linear_reference(x, weight, **kwargs).float()
    unfused = torch.nn.functional.linear(norm.rms_norm_reference(x, kwargs["norm_weight"], 1e-6), weight).float()
    assert (fused - unfused).abs().max() < 0.02 * unfused.abs().max()
    assert torch.nn.functional.cosine_similarity(fused.flatten(), unfused.flatten(), dim=0) > 0.9999
