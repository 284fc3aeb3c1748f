"""MoE layers for the kernel tests of fused_moe.py and moe_gemv.py: random inputs, and both families' shapes."""

import torch


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


# Both families' expert shapes scaled down (experts, top-k, D, I): Qwen3-MoE's many experts, top-8
# and an I of 3 x 2^n (768 = 3 x 256); Mixtral's 8 experts, top-2 and a wide I (14336 = 7 x 2^11),
# its D not a power of 2 here so that the gate/up's one K step is masked.
QWEN3_MOE_SMALL = (32, 8, 128, 96)
MIXTRAL_SMALL = (8, 2, 192, 448)
