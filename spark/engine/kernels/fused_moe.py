"""A mixture-of-experts feed-forward: routing, then every token's top-k experts, reference and Triton.

Each of the ``T`` tokens picks ``k`` experts; ``slot = t * k + j`` names its ``j``-th pick.
Expert ``e`` is a SwiGLU MLP: ``w2[e] @ (silu(gate) * up)`` with ``gate, up = w13[e] @ x``
(``w13`` [E, 2I, D], gate rows first; ``w2`` [E, D, I]: each expert's weights as ``nn.Linear``
would hold them, K contiguous). The output of a token is the routing-weighted sum of its picks.

The Triton path (next), as vLLM's fused MoE does it:

1. ``align``: the slots sorted by expert, each expert's run padded to a multiple of
   ``BLOCK_M`` (padding holds the sentinel ``T * k``), and the expert of every block of
   ``BLOCK_M`` rows. Sizes are the static worst case (every used expert wastes
   ``BLOCK_M - 1`` rows), so nothing leaves the device and a decode step can be captured
   in a CUDA graph; blocks past the end are marked -1 and exit at once.
2. one grouped GEMM over those blocks for gate/up, SwiGLU in its epilogue: ``h`` [T * k, I];
3. one for down, the routing weight applied in its epilogue: ``y`` [T * k, D];
4. the combine: ``y.view(T, k, D).sum(1)``.

Rounding, both paths: products accumulate in fp32, ``h`` and each slot's weighted ``y`` are
rounded to the activations' dtype, the top-k sum is taken in fp32 and rounded once.
"""

from __future__ import annotations

import torch

from spark.engine.kernels import activation

def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the softmax over experts: (weights fp32 [T, k], expert ids int64 [T, k]).

    Args:
      logits: the router's scores [T, E].
      renormalize: scale each token's k weights to sum to 1 (which equals a softmax over the
        selected logits alone: Mixtral's router).
    """
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Sum over each token's experts of ``weight * expert(x)`` (torch reference: a loop over experts).

    Args:
      x: [T, D]; w13: [E, 2I, D]; w2: [E, D, I]; topk_weights: [T, k] (fp32); topk_ids: [T, k],
        any expert in 0..E-1, repeats allowed.

    Returns:
      [T, D] in x's dtype.
    """
    num_tokens, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1).float()
    order = torch.argsort(flat, stable=True)  # slots, grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    y = torch.zeros(num_tokens * k, x.shape[1], dtype=x.dtype, device=x.device)  # per slot
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        h = activation.silu_and_mul_reference(x[slots // k] @ w13[e].T)  # [n, I]
        y[slots] = ((h @ w2[e].T).float() * weights[slots, None]).to(x.dtype)
    return y.view(num_tokens, k, -1).float().sum(1).to(x.dtype)
