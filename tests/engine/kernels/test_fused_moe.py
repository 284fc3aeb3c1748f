import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from spark.engine.kernels import fused_moe as fm  # noqa: E402
from tests.engine.kernels.conftest import assert_bf16_nearly_exact, dot_of_values  # noqa: E402


@pytest.fixture(autouse=True)
def exact_bf16_in_interpreter(bf16_rounds_to_nearest, monkeypatch):
    """bf16 casts rounded to nearest and bf16 `tl.dot` multiplying numbers, as on a GPU (conftest)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot_of_values)


def make_moe(tokens, experts, k, hidden, inter, dtype=torch.float32, *, used=None, seed=0):
    """x [T, D], w13 [E, 2I, D], w2 [E, D, I], weights [T, k], ids [T, k] drawn from ``used`` experts
    (default all), with repeats allowed within a token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    used = torch.arange(experts) if used is None else torch.tensor(used)
    ids = used[torch.randint(0, len(used), (tokens, k), generator=g)]
    weights = torch.rand(tokens, k, generator=g)
    return x, w13, w2, weights, ids


def naive(x, w13, w2, weights, ids):
    """Token by token, pick by pick, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            w = w13[ids[t, j]].double()
            h = x[t].double() @ w.T
            out[t] += weights[t, j].double() * (w2[ids[t, j]].double() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


def test_route_renormalised_top_k_is_a_softmax_over_the_selected_logits():
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    weights, ids = fm.route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids), -1))  # Mixtral's form
    plain, same = fm.route(logits, 2, renormalize=False)
    assert torch.equal(ids, same) and torch.allclose(plain, torch.softmax(logits, -1).gather(1, ids))


@pytest.mark.parametrize("experts, k, renormalize", [(8, 2, True), (128, 8, False), (6, 3, True), (4, 1, False)])
def test_route_triton_matches_route(experts, k, renormalize):
    logits = (3 * torch.randn(9, experts, generator=torch.Generator().manual_seed(experts))).to(torch.bfloat16)
    weights, ids = fm.route_triton(logits, k, renormalize)
    want_w, want_i = fm.route(logits, k, renormalize)
    assert torch.equal(ids.long(), want_i)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("used", [None, [1, 6]])  # all experts, or most with zero tokens
def test_reference_matches_naive(used):
    x, w13, w2, weights, ids = make_moe(7, 8, 3, 32, 24, used=used)
    torch.testing.assert_close(fm.fused_moe_reference(x, w13, w2, weights, ids).double(),
                               naive(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def check_alignment(sorted_slots, block_expert, ids, num_experts, block):
    """Every slot once, in a block of its expert; blocks of one expert ascending; padding and tail marked."""
    flat = ids.reshape(-1)
    n = flat.numel()
    rows, blocks = fm.aligned_sizes(n, num_experts, block)
    assert sorted_slots.shape == (rows,) and block_expert.shape == (blocks,)
    real = sorted_slots < n
    assert sorted(sorted_slots[real].tolist()) == list(range(n))
    assert (sorted_slots[~real] == n).all()
    owner = block_expert.long().repeat_interleave(block)
    assert (owner[real] == flat[sorted_slots[real].long()]).all()
    used = block_expert[block_expert >= 0]
    assert (used[1:] >= used[:-1]).all()  # experts in order, each run of blocks contiguous
    assert int((block_expert >= 0).sum()) == sum(-(-c // block) for c in torch.bincount(flat, minlength=num_experts).tolist())


@pytest.mark.parametrize("tokens, experts, k, used", [
    (1, 8, 2, None), (1, 128, 8, None), (9, 8, 2, [0, 7]), (40, 16, 4, None), (5, 6, 3, [2])])
def test_align_triton_matches_reference(tokens, experts, k, used):
    ids = make_moe(tokens, experts, k, 16, 16, used=used)[4]
    want = fm.align_reference(ids, experts, 16)
    check_alignment(*want, ids, experts, 16)
    got = fm.align_triton(ids, experts, 16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# (tokens, experts, top-k, D, I, experts in use): decode's 1 token; a widths below one tile and
# not a multiple of it; experts with no token; one expert taking every pick, repeats within a token.
SHAPES = [(1, 8, 2, 64, 32, None), (5, 8, 4, 96, 48, [0, 3, 5]), (17, 4, 2, 64, 80, None), (6, 8, 3, 32, 16, [4])]


@pytest.mark.parametrize("tokens, experts, k, hidden, inter, used", SHAPES)
def test_triton_matches_reference_fp32(tokens, experts, k, hidden, inter, used):
    # The grouped GEMMs called directly: at 1 token the dispatch would take the GEMVs.
    x, w13, w2, weights, ids = make_moe(tokens, experts, k, hidden, inter, used=used, seed=tokens)
    out = fm.fused_moe_grouped_triton(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, fm.fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_triton_bf16():
    x, w13, w2, weights, ids = make_moe(6, 8, 2, 64, 32, torch.bfloat16, seed=3)
    assert fm.moe_path(6, 2, 8) == "grouped"
    out, ref = fm.fused_moe_triton(x, w13, w2, weights, ids), fm.fused_moe_reference(x, w13, w2, weights, ids)
    # The reference rounds gate/up to bf16 before the silu; the kernel keeps them in fp32.
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert (out.float() - naive(x, w13, w2, weights, ids).float()).abs().max() < 5e-2


def test_many_slots_align_by_sort(monkeypatch):
    # Past _ALIGN_IN_ONE_PROGRAM slots the torch alignment runs: the same layout, the same output.
    monkeypatch.setattr(fm, "_ALIGN_IN_ONE_PROGRAM", 8)
    x, w13, w2, weights, ids = make_moe(12, 8, 2, 32, 16, seed=5)
    torch.testing.assert_close(fm.fused_moe_triton(x, w13, w2, weights, ids),
                               fm.fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # numpy's max, by design here
def test_route_of_a_nan_row_stays_inside_the_experts():
    # A replayed decode graph's padded rows may carry NaN: their picks must still index real experts.
    logits = torch.randn(3, 8)
    logits[1] = float("nan")
    weights, ids = fm.route_triton(logits, 2, True)
    assert ((ids >= 0) & (ids < 8)).all()
    assert torch.equal(ids[[0, 2]].long(), fm.route(logits[[0, 2]], 2, True)[1])


# Both families' expert shapes scaled down (experts, top-k, D, I): Qwen3-MoE's many experts, top-8
# and an I of 3 x 2^n (768 = 3 x 256); Mixtral's 8 experts, top-2 and a wide I (14336 = 7 x 2^11),
# its D not a power of 2 here so that the gate/up's one K step is masked.
QWEN3_MOE_SMALL = (32, 8, 128, 96)
MIXTRAL_SMALL = (8, 2, 192, 448)
# Small blocks: the K loops take several steps (gate/up 128 / 32, 192 / 64), the down's last one
# ragged (96 / 64, 448 / 128), and a last column block partial (the gate/up's 96 outputs in blocks
# of 64, the down's 192 in blocks of 128).
SMALL_BLOCKS = dict(gate_up=dict(BLOCK_N=64, BLOCK_K=32, num_warps=2),
                    down=dict(BLOCK_N=64, BLOCK_K=64, num_warps=4))
SMALL_BLOCKS_MIXTRAL = dict(gate_up=dict(BLOCK_N=64, BLOCK_K=64, num_warps=2),
                            down=dict(BLOCK_N=128, BLOCK_K=128, num_warps=4))


@pytest.mark.parametrize("tokens", [1, 2, 4])
@pytest.mark.parametrize("shape", [QWEN3_MOE_SMALL, MIXTRAL_SMALL], ids=["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("small_blocks", [False, True])
def test_gemv_matches_reference_fp32(tokens, shape, small_blocks):
    experts, k, hidden, inter = shape
    config = (SMALL_BLOCKS if shape == QWEN3_MOE_SMALL else SMALL_BLOCKS_MIXTRAL) if small_blocks else None
    x, w13, w2, weights, ids = make_moe(tokens, experts, k, hidden, inter, seed=tokens)
    out = fm.fused_moe_gemv_triton(x, w13, w2, weights, ids.to(torch.int32), config)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, fm.fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 2, 4])
@pytest.mark.parametrize("shape", [QWEN3_MOE_SMALL, MIXTRAL_SMALL], ids=["qwen3_moe", "mixtral"])
def test_gemv_bf16_rounds_as_the_reference(tokens, shape):
    # Gate and up rounded before the SwiGLU, each pick's product before its weight, as the
    # reference: only the order of fp32 sums differs.
    experts, k, hidden, inter = shape
    x, w13, w2, weights, ids = make_moe(tokens, experts, k, hidden, inter, torch.bfloat16, seed=tokens)
    assert_bf16_nearly_exact(fm.fused_moe_gemv_triton(x, w13, w2, weights, ids),
                             fm.fused_moe_reference(x, w13, w2, weights, ids), min_exact=0.98)


def test_gemv_repeated_expert_within_a_token():
    # A token may pick one expert twice (the reference allows it): both picks count.
    x, w13, w2, weights, ids = make_moe(2, 8, 4, 64, 32, used=[5], seed=9)
    torch.testing.assert_close(fm.fused_moe_gemv_triton(x, w13, w2, weights, ids),
                               fm.fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_gemv_token_does_not_depend_on_its_batch():
    # One program per token and output block, the picks summed in one order: a token's bits are
    # the same alone and in a batch (batch-invariant within the GEMV path).
    x, w13, w2, weights, ids = make_moe(4, *QWEN3_MOE_SMALL, torch.bfloat16, seed=4)
    batch = fm.fused_moe_gemv_triton(x, w13, w2, weights, ids)
    for t in range(4):
        alone = fm.fused_moe_gemv_triton(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1])
        assert torch.equal(alone, batch[t:t + 1])


@pytest.mark.parametrize("tokens, k, experts, path", [
    (1, 8, 128, "gemv"), (4, 8, 128, "gemv"), (8, 8, 128, "grouped"), (64, 8, 128, "grouped"),  # Qwen3-MoE
    (1, 2, 8, "gemv"), (2, 2, 8, "gemv"), (3, 2, 8, "grouped"), (64, 2, 8, "grouped"),  # Mixtral
])
def test_moe_path_by_the_shapes(tokens, k, experts, path):
    assert fm.moe_path(tokens, k, experts) == path


@pytest.mark.parametrize("tokens, path", [(1, "gemv"), (2, "gemv"), (8, "grouped")])
def test_fused_moe_triton_dispatches_by_token_count(monkeypatch, tokens, path):
    taken = []
    for name in ("gemv", "grouped"):
        real = getattr(fm, f"fused_moe_{name}_triton")
        monkeypatch.setattr(fm, f"fused_moe_{name}_triton",
                            lambda *a, name=name, real=real: taken.append(name) or real(*a))
    x, w13, w2, weights, ids = make_moe(tokens, *MIXTRAL_SMALL[:2], 64, 32, seed=tokens)
    out = fm.fused_moe_triton(x, w13, w2, weights, ids)
    assert taken == [path]
    torch.testing.assert_close(out, fm.fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def make_one_row(tokens, shape, dtype, seed):
    """(h [T, D], norm weight [D], router [E, D], w13, w2, top-k) of ``shape`` (experts, top-k, D, I); a router
    wide enough that the kernel's and the reference's logits pick the same experts."""
    experts, k, hidden, inter = shape
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype)
    norm_weight = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    router = (4 * torch.randn(experts, hidden, generator=g) / hidden**0.5).to(dtype)
    _, w13, w2, _, _ = make_moe(tokens, experts, k, hidden, inter, dtype, seed=seed)
    return h, norm_weight, router, w13, w2, k


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("shape", [QWEN3_MOE_SMALL, MIXTRAL_SMALL], ids=["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_one_row_matches_reference_fp32(tokens, shape, renormalize):
    h, norm_weight, router, w13, w2, k = make_one_row(tokens, shape, torch.float32, seed=tokens)
    out = fm.moe_one_row_triton(h, norm_weight, 1e-6, router, w13, w2, k, renormalize)
    assert out.shape == h.shape and out.dtype == h.dtype
    want = fm.moe_one_row_reference(h, norm_weight, 1e-6, router, w13, w2, k, renormalize)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_one_row_reference_is_the_unfused_layer():
    # norm, router, route, experts, residual add, each as the generic path computes it (fp32: the
    # norm's roundings do not matter).
    from spark.engine.kernels import norm

    h, norm_weight, router, w13, w2, k = make_one_row(2, QWEN3_MOE_SMALL, torch.float32, seed=7)
    x = norm.rms_norm_reference(h, norm_weight, 1e-6)
    weights, ids = fm.route(x @ router.T, k, True)
    torch.testing.assert_close(fm.moe_one_row_reference(h, norm_weight, 1e-6, router, w13, w2, k, True),
                               h + fm.fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [QWEN3_MOE_SMALL, MIXTRAL_SMALL], ids=["qwen3_moe", "mixtral"])
def test_one_row_bf16_rounds_as_the_reference(shape):
    h, norm_weight, router, w13, w2, k = make_one_row(1, shape, torch.bfloat16, seed=3)
    assert_bf16_nearly_exact(fm.moe_one_row_triton(h, norm_weight, 1e-6, router, w13, w2, k, True),
                             fm.moe_one_row_reference(h, norm_weight, 1e-6, router, w13, w2, k, True), min_exact=0.98)


def test_gate_up_routes_as_route_triton():
    # The ids and weights the gate/up kernel stores for the down kernel are route_triton's, bit for bit.
    h, norm_weight, router, w13, w2, k = make_one_row(2, QWEN3_MOE_SMALL, torch.bfloat16, seed=5)
    logits = (3 * torch.randn(2, w13.shape[0], generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    ids = torch.empty(2 * k, dtype=torch.int32)
    weights = torch.empty(2 * k)
    fm._launch_gemvs(h, w13, w2, k, ids, weights, logits=logits, renormalize=True)
    want_w, want_i = fm.route_triton(logits, k, True)
    assert torch.equal(ids, want_i.reshape(-1)) and torch.equal(weights, want_w.reshape(-1))


@pytest.mark.parametrize("early", [True, False], ids=["early", "late"])
@pytest.mark.parametrize("routed", [True, False], ids=["from_logits", "from_ids"])
def test_down_loads_early_or_late_alike(early, routed):
    # One token of small experts: the down kernel takes its picks and weight rows before the wait on
    # gate/up (EARLY, off by default: slower on an H100), routing from the logits itself or reading the
    # given ids; the same sums as after the wait.
    experts, k, hidden, inter = QWEN3_MOE_SMALL
    config = fm.gemv_config(hidden, inter, 1)
    config["down"] = dict(config["down"], EARLY=early)
    h, norm_weight, router, w13, w2, _ = make_one_row(1, QWEN3_MOE_SMALL, torch.float32, seed=11)
    logits = h @ router.T
    weights, ids = fm.route(logits, k, True)
    flat_ids, flat_weights = ids.reshape(-1).to(torch.int32), weights.reshape(-1)
    if routed:  # garbage in: gate/up writes them from the logits (read by the late down; the early one routes)
        flat_ids, flat_weights = torch.full_like(flat_ids, -1), torch.full_like(flat_weights, float("nan"))
    got = fm._launch_gemvs(h, w13, w2, k, flat_ids, flat_weights, logits=logits if routed else None,
                           renormalize=True, config=config)
    torch.testing.assert_close(got, fm.fused_moe_reference(h, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_early_down_takes_the_whole_of_i_in_one_step():
    experts, k, hidden, inter = QWEN3_MOE_SMALL
    x, w13, w2, weights, ids = make_moe(1, experts, k, hidden, inter, seed=2)
    config = fm.gemv_config(hidden, inter, 1)
    config["down"] = dict(config["down"], BLOCK_K=inter // 2, EARLY=True)
    with pytest.raises(AssertionError, match="one step"):
        fm.fused_moe_gemv_triton(x, w13, w2, weights, ids, config)
    # Mixtral's wide experts keep the loop over I after the wait.
    assert not fm.gemv_config(4096, 14336, 1)["down"].get("EARLY", False)
