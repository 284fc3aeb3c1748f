"""moe_routing.py: the router's top-k, torch and Triton."""

import pytest
import torch

from spark.engine.kernels import moe_routing


def test_route_renormalised_top_k_is_a_softmax_over_the_selected_logits():
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    weights, ids = moe_routing.route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids), -1))  # Mixtral's form
    plain, same = moe_routing.route(logits, 2, renormalize=False)
    assert torch.equal(ids, same) and torch.allclose(plain, torch.softmax(logits, -1).gather(1, ids))


@pytest.mark.parametrize("experts, k, renormalize", [(8, 2, True), (128, 8, False), (6, 3, True), (4, 1, False)])
def test_route_triton_matches_route(experts, k, renormalize):
    logits = (3 * torch.randn(9, experts, generator=torch.Generator().manual_seed(experts))).to(torch.bfloat16)
    weights, ids = moe_routing.route_triton(logits, k, renormalize)
    want_w, want_i = moe_routing.route(logits, k, renormalize)
    assert torch.equal(ids.long(), want_i)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # numpy's max, by design here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # route_token keys each its own way
def test_route_of_a_nan_row_stays_inside_the_experts(dtype):
    # A replayed decode graph's padded rows may carry NaN: their picks must still index real experts.
    logits = torch.randn(3, 8).to(dtype)
    logits[1] = float("nan")
    weights, ids = moe_routing.route_triton(logits, 2, True)
    assert ((ids >= 0) & (ids < 8)).all()
    assert torch.equal(ids[[0, 2]].long(), moe_routing.route(logits[[0, 2]], 2, True)[1])
