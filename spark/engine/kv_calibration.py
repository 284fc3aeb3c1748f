"""The per-head scales of an fp8 KV cache, set at load time from one short prefill (issue 22).

e4m3 rounds every value in its normal range, ``[2**-6, 448]`` times the scale, to the same
relative precision (3 mantissa bits), so a scale does not buy precision: it keeps a head's values
inside that range. Measured on the default model (``scripts/fp8_kv_stats.py``, 50 prompts): at
scale 1.0 no K or V value clamps and ~1% are subnormal (45% of layer 0's V), and scales from each
head's absmax leave the logits cosine where it was (0.9973); what is left is the mantissa's
rounding. A model whose K reach past 448 (or whose V sit below 2**-6) would lose much more at 1.0.

So a scale is the power of two at or above ``absmax * HEADROOM / 448``, over a prefill of
``CALIBRATION_TEXT`` through the model with a model-dtype cache: a power of two divides and
multiplies exactly, and ``HEADROOM`` (16) leaves later tokens 16x to 32x room before the clamp,
while 2**11 of e4m3's 2**15 range of normals stays below the absmax. A head whose absmax lies
in (14, 28] keeps 1.0, as the default model's K do (up to 21); its V get 1/8 to 1/2, layer 0's 1/32.
"""

from __future__ import annotations

import torch

from spark.engine.kernels import fp8
from spark.engine.kv_cache import KVCache
from spark.engine.teacher_forcing import prefill_logits

HEADROOM = 16.0  # how far past the calibration's absmax a value may go before it clamps (at least)
# Prose, code, numbers and a list, so that the heads that attend to each see their kind of token.
CALIBRATION_TEXT = """\
The water cycle moves water between the oceans, the air and the land. Sunlight warms the sea; \
vapour rises, cools and condenses into clouds, and rain or snow returns it to the ground, where \
rivers carry it back to the sea over days, years or, for deep groundwater, thousands of years.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

Q3 revenue was $4.72M (up 18.5% from $3.98M), with 1,204 new accounts; costs rose 7% to $2.1M.
Steps: 1) preheat the oven to 220 C; 2) mix 500 g flour, 350 ml water, 10 g salt and 7 g yeast;
3) rest for 2 hours; 4) bake for 35 minutes. "Why is the sky blue?" she asked. Rayleigh
scattering: shorter wavelengths scatter more, so blue light reaches the eye from every direction.
"""


def scales_for(absmax: torch.Tensor, headroom: float = HEADROOM) -> torch.Tensor:
    """Scales (fp32, ``absmax``'s shape): the power of two at or above ``absmax * headroom / 448``;
    1.0 where ``absmax`` is 0 (a head the calibration never wrote)."""
    want = absmax.float() * headroom / fp8.FP8_MAX
    return torch.where(want > 0, torch.exp2(torch.ceil(torch.log2(want))), torch.ones_like(want))


def kv_absmax(engine, token_ids: list[int]) -> torch.Tensor:
    """``[layers, 2 (K, V), Hkv]`` fp32: each head's largest |K| (after RoPE, as cached) and |V| over one
    prefill of ``token_ids``, through ``engine.model`` with a cache in the model's dtype swapped in for it."""
    pages = 1 - (-len(token_ids) // engine.page_size)  # and the allocator's scratch page
    cache = KVCache(engine.config.shard(engine.tp.world_size), pages, engine.page_size, engine.dtype, engine.device)
    kept = engine.kv_cache
    engine.kv_cache = cache
    try:
        prefill_logits(engine, [token_ids], 1)
    finally:
        engine.kv_cache = kept
    # storage [layers, 2, pages, page_size, Hkv, Dh]; never-written slots are zeros
    return cache.storage.abs().amax(dim=(2, 3, 5)).float()


def calibrate(engine, token_ids: list[int] | None = None, headroom: float = HEADROOM) -> torch.Tensor:
    """Set an fp8 cache's scales (``engine.kv_cache.scales``, in place: the layers' views stay) from a
    prefill of ``token_ids`` (default: ``CALIBRATION_TEXT``). Call before any sequence is cached: K/V
    already stored were quantized at the old scales. Returns the scales, ``[layers, 2, Hkv]``."""
    if token_ids is None:
        token_ids = calibration_tokens(engine)
    scales = scales_for(kv_absmax(engine, token_ids), headroom)
    engine.kv_cache.scales.copy_(scales.to(engine.kv_cache.scales.device))
    return engine.kv_cache.scales


def calibration_tokens(engine) -> list[int]:
    """``CALIBRATION_TEXT`` in the engine's tokens; an engine without a tokenizer gets a fixed spread of ids."""
    if engine.tokenizer is not None:
        return engine.tokenizer.encode(CALIBRATION_TEXT)
    return [(7919 * i) % engine.config.vocab_size for i in range(256)]
