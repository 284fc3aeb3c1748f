"""The router's choice for a mixture-of-experts layer: each token's top-k experts and their weights.

A token's weights are the softmax of its router logits over the ``E`` experts, its top ``k`` kept
(renormalised to sum to 1 where the model asks: Mixtral's router). ``route`` is the torch reference;
``route_triton`` takes one launch, one program a token. The routing of one token is a @triton.jit
helper of its own (``route_token``), so that the GEMV kernels of the few-token path (moe_gemv.py)
route their token inside their own programs, with the same bits as ``route_triton`` and no launch
of their own.
"""

from __future__ import annotations

import functools

import torch

triton = None  # bound by _kernels() on first use: TRITON_INTERPRET is read when @triton.jit runs
tl = None
_route_token = None  # route_token, bound by _kernels() as a module global, where moe_route_kernel looks it up
_flip = None  # flip, likewise, for route_token


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


def route_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` in one launch (one program a token): weights fp32 [T, k], expert ids int32 [T, k].

    Ties between equal probabilities go to the lower expert id (torch's topk does not promise an order)."""
    kernel = _kernels()[1]
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        kernel[(num_tokens,)](logits, weights, ids, logits.stride(0), num_experts, TOP_K=top_k,
                              K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts),
                              RENORMALIZE=renormalize)
    return weights, ids


def jit_route_token():
    """The @triton.jit ``route_token`` (one token's weights and ids from its logits), JIT-ed once, for
    kernels of other modules to call (moe_gemv.py's): the same bits as ``route_triton``'s."""
    return _kernels()[0]


@functools.cache
def _kernels():
    """(route_token, route kernel), JIT-ed at first use."""
    global triton, tl, _route_token, _flip
    import triton
    import triton.language as tl

    @triton.jit
    def flip(bits, MAGNITUDE: tl.constexpr):
        """A float's sign-extended bits made to order as signed ints (a negative one's magnitude bits
        flipped), and back: the flip undoes itself."""
        return bits ^ ((bits >> 31) & MAGNITUDE)

    @triton.jit
    def route_token(logits_row, num_experts, pick, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                    RENORMALIZE: tl.constexpr):
        """One token's (weights fp32 [K_PAD], expert ids int32 [K_PAD], the id of pick ``pick`` as a scalar)
        from its logits: k rounds of argmax over the logits (the lowest id among ties), each pick's
        weight its softmax over the experts in fp32, renormalised if asked.

        The scalar is kept as its round finds it, so that a program that reads one expert's weights
        (moe_gemv's gate/up) has its address after the rounds, with no reduction over the picks and
        without waiting on the softmax, which only the weights need: Qwen3-30B-A3B's graphed batch-1
        step on an H100, 360.8 tok/s against 358.6 when gate/up summed its pick out of the ids and
        stored them ahead of its weight loads.

        The softmax is monotonic, so the picks come from the logits, as integers: a float's bits with
        a negative one's magnitude bits flipped order as signed ints do. A one-warp program's rounds
        are its critical path, and on a GPU an int32 max or min over a warp is one instruction
        (redux.sync), where a float max is a chain of five shuffles; the softmax's sum no longer
        waits on the picks. Qwen3-30B-A3B's graphed batch-1 step on an H100 (decode_ablation.py, the
        same call): 349.3 tok/s against 345.9 with float argmax rounds. A bf16 logit's 16 bits leave
        room for the id below them: one max a round finds both (354.6 against 353.1 in another call,
        with the head's fp32 scores). (+0 ranks above -0 here, where float equality tied them.)"""
        experts = tl.arange(0, E_PAD)
        valid = experts < num_experts
        none = -2147483647 - 1  # below every key
        picks = tl.arange(0, K_PAD)
        top_key = tl.full([K_PAD], none, tl.int32)
        chosen = none  # the key (bf16) or id (else) of round ``pick``
        if logits_row.dtype.element_ty == tl.bfloat16:
            tl.static_assert(E_PAD <= 65536, "the ids take the low 16 bits of a key")
            raw = tl.load(logits_row + experts, mask=valid, other=float("-inf"))
            bits = raw.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended
            keys = tl.where(valid, (_flip(bits, 0x7FFF) << 16) | (E_PAD - 1 - experts), none)
            logits = raw.to(tl.float32)
            # Round 0's pick, the largest logit, is the softmax's shift; the sum needs nothing of the later rounds.
            shift = (_flip(tl.max(keys, axis=0) >> 16, 0x7FFF) << 16).to(tl.float32, bitcast=True)
            total = tl.sum(tl.where(valid, tl.exp(logits - shift), 0.0), axis=0)
            for j in tl.static_range(TOP_K):
                best = tl.max(keys, axis=0)
                top_key = tl.where(picks == j, best, top_key)
                chosen = tl.where(pick == j, best, chosen)
                keys = tl.where(keys == best, none, keys)
            top_i = E_PAD - 1 - (top_key & 0xFFFF)
            chosen = E_PAD - 1 - (chosen & 0xFFFF)
            top_logit = (_flip(top_key >> 16, 0x7FFF) << 16).to(tl.float32, bitcast=True)
        else:
            logits = tl.load(logits_row + experts, mask=valid, other=float("-inf")).to(tl.float32)
            bits = logits.to(tl.int32, bitcast=True)
            keys = tl.where(valid, _flip(bits, 0x7FFFFFFF), none)
            shift = _flip(tl.max(keys, axis=0), 0x7FFFFFFF).to(tl.float32, bitcast=True)
            total = tl.sum(tl.where(valid, tl.exp(logits - shift), 0.0), axis=0)
            top_i = tl.zeros([K_PAD], dtype=tl.int32)
            for j in tl.static_range(TOP_K):
                best = tl.max(keys, axis=0)
                at = tl.min(tl.where(keys == best, experts, E_PAD), axis=0)  # the lowest id among ties
                top_key = tl.where(picks == j, best, top_key)
                top_i = tl.where(picks == j, at, top_i)
                chosen = tl.where(pick == j, at, chosen)
                keys = tl.where(experts == at, none, keys)
            top_logit = _flip(top_key, 0x7FFFFFFF).to(tl.float32, bitcast=True)
        # Every real pick is a real expert, in a NaN row too (a padded row of a replayed graph attends
        # to nothing: NaN's bits rank highest). The picks past TOP_K (K_PAD's padding) found no key:
        # they take expert 0, so that no id ever points outside the weights.
        top_i = tl.where(top_i < num_experts, top_i, 0)
        chosen = tl.where((chosen >= 0) & (chosen < num_experts), chosen, 0)
        top_w = tl.exp(top_logit - shift) / total
        if RENORMALIZE:
            top_w = top_w / tl.sum(tl.where(picks < TOP_K, top_w, 0.0), axis=0)
        return top_w, top_i, chosen

    _route_token, _flip = route_token, flip

    @triton.jit
    def moe_route_kernel(logits_ptr, weights_ptr, ids_ptr, stride_t, num_experts, TOP_K: tl.constexpr,
                         K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
        # One token a program.
        t = tl.program_id(0).to(tl.int64)
        top_w, top_i, _ = _route_token(logits_ptr + t * stride_t, num_experts, 0, TOP_K, K_PAD, E_PAD, RENORMALIZE)
        picks = tl.arange(0, K_PAD)
        tl.store(weights_ptr + t * TOP_K + picks, top_w, mask=picks < TOP_K)
        tl.store(ids_ptr + t * TOP_K + picks, top_i, mask=picks < TOP_K)

    return route_token, moe_route_kernel
