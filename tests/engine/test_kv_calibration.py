"""An fp8 KV cache's scales from a load-time prefill (spark/engine/kv_calibration.py)."""

from __future__ import annotations

import torch

from spark.engine import kv_calibration
from spark.engine.engine import Engine
from spark.engine.kernels import fp8
from spark.engine.kv_calibration import HEADROOM, scales_for


def test_scales_are_the_powers_of_two_that_leave_the_headroom():
    absmax = torch.tensor([0.0, 14.0, 14.01, 21.0, 28.0, 28.01, 1000.0, 0.01])
    assert scales_for(absmax).tolist() == [1.0, 0.5, 1.0, 1.0, 1.0, 2.0, 64.0, 2.0**-11]
    spread = torch.logspace(-4, 4, 97)
    room = fp8.FP8_MAX / (spread / scales_for(spread))  # how far past the absmax a value may go unclamped
    assert (room >= HEADROOM).all() and (room < 2 * HEADROOM).all()


def _tiny_fp8_engine(**kwargs) -> Engine:
    return Engine.load("dummy:tiny-llama", device="cpu", dtype=torch.float32, kv_dtype="fp8", kv_cache_tokens=512,
                       progress=False, **kwargs)


def test_calibration_sets_the_scales_in_place_and_leaves_the_cache_unwritten():
    engine = _tiny_fp8_engine(kv_calibration=False)
    cache, views = engine.kv_cache, [(k.scale, v.scale) for k, v in engine.kv_cache.layers]
    assert cache.scales.eq(1).all()
    tokens = kv_calibration.calibration_tokens(engine)
    absmax = kv_calibration.kv_absmax(engine, tokens)  # [layers, 2, Hkv]
    assert absmax.shape == cache.scales.shape and (absmax > 0).all()
    scales = kv_calibration.calibrate(engine, tokens)
    assert engine.kv_cache is cache and scales is cache.scales
    assert torch.equal(scales, scales_for(absmax)) and not scales.eq(1).all()
    for i, (k_scale, v_scale) in enumerate(views):  # the kernels' views of the scales see them
        assert torch.equal(k_scale, scales[i, 0]) and torch.equal(v_scale, scales[i, 1])
    assert cache.storage.view(torch.uint8).eq(0).all()  # the pass ran on a cache of its own

    # The same prefill into the fp8 cache: what it reads back (stored * scale) has the absmax measured, to
    # e4m3's rounding in layer 0 (whose input is exact; later layers' carry the rounding of the ones
    # before), and no stored value comes near the clamp.
    from spark.engine.offline import prefill_logits

    prefill_logits(engine, [tokens], 1)
    stored = cache.storage.float().abs().amax(dim=(2, 3, 5))  # [layers, 2, Hkv]
    torch.testing.assert_close(stored[0] * scales[0], absmax[0], rtol=2.0**-4, atol=0)
    torch.testing.assert_close(stored * scales, absmax, rtol=0.25, atol=0)
    assert (stored <= fp8.FP8_MAX / HEADROOM).all()


def test_load_calibrates_an_fp8_cache_by_default():
    engine = _tiny_fp8_engine()
    tokens = kv_calibration.calibration_tokens(engine)
    assert torch.equal(engine.kv_cache.scales, scales_for(kv_calibration.kv_absmax(engine, tokens)))
