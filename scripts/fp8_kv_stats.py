"""Where an FP8 KV cache's error comes from (issue 22): K/V statistics, and the cosine of each way to quantize.

    python scripts/fp8_kv_stats.py [--prompts 50] [--steps 16] [--dtype bfloat16] [--out FILE]

One engine with a model-dtype ("auto") cache, on the CPU. The prompts of ``fp8_kv_check.py`` plus the
first ``steps - 1`` greedy tokens are prefilled teacher-forced once, and every layer's K (after RoPE, as
cached) and V recorded as the cache gets them. Per layer and KV head: absmax, percentiles of |x|, the
fraction that e4m3 at scale 1.0 holds as subnormals (|x| < 2**-6), flushes to zero (|x| < 2**-10) or
clamps (|x| > 448). Then the same prefill again for each *variant*, whose K and/or V are fake-quantized
(rounded to e4m3 and back, exactly what an fp8 cache reads) before the cache gets them, and the logits
of the last ``steps`` positions compared by cosine with the plain run's, as ``fp8_kv_check.py`` does.
Variants: scale 1.0 (today), K only, V only, per-head scales from the data's absmax, a scale per token
and head (ideal; not storable by the kernels), a scale per K channel; and bf16 rounding as a floor.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_kv_check import prompts_for  # noqa: E402

from spark.engine.engine import Engine  # noqa: E402
from spark.engine.kernels import fp8, kv_write  # noqa: E402
from spark.engine.offline import generate, prefill_logits  # noqa: E402
from spark.engine.sampling import SamplingParams  # noqa: E402

SUBNORMAL = 2.0**-6  # e4m3's smallest normal
FLUSH = 2.0**-10  # half e4m3's smallest subnormal (2**-9): below it a value rounds to zero


def fake_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e4m3 at ``scale`` (broadcast against x) and read back, in x's dtype."""
    return ((x.float() / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8).float() * scale).to(x.dtype)


class Recorder:
    """Wraps ``kv_write.write_kv_reference``: records each layer's K/V, or rewrites them by a variant."""

    def __init__(self, num_layers: int):
        self.num_layers, self.calls = num_layers, 0
        self.keys, self.values = [None] * num_layers, [None] * num_layers  # [T, Hkv, D] fp32 per layer
        self.variant = None  # (layer, k, v) -> (k, v), or None to record
        self._original = kv_write.write_kv_reference

    def __enter__(self):
        kv_write.write_kv_reference = self._write
        return self

    def __exit__(self, *exc):
        kv_write.write_kv_reference = self._original

    def _write(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        layer = self.calls % self.num_layers
        self.calls += 1
        if self.variant is None:
            self.keys[layer], self.values[layer] = k.float().clone(), v.float().clone()
        else:
            k, v = self.variant(layer, k, v)
        self._original(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def head_stats(x: torch.Tensor) -> dict:
    """Statistics of one layer's K or V [T, Hkv, D], per head."""
    a = x.abs().transpose(0, 1).reshape(x.shape[1], -1)  # [Hkv, T * D]
    q = torch.quantile(a[:, :: max(1, a.shape[1] // 100_000)], torch.tensor([0.5, 0.999]), dim=1)
    channel_max = x.abs().amax(0)  # [Hkv, D]
    return {
        "absmax": a.amax(1).tolist(), "median": q[0].tolist(), "p999": q[1].tolist(),
        "frac_subnormal": (a < SUBNORMAL).float().mean(1).tolist(),
        "frac_flushed": (a < FLUSH).float().mean(1).tolist(),
        "frac_clamped": (a > fp8.FP8_MAX).float().mean(1).tolist(),
        # how unevenly the head's channels are used: the largest channel's absmax over the median channel's
        "channel_spread": (channel_max.amax(1) / channel_max.median(1).values).tolist(),
    }


def _hadamard(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (entries ±1), n a power of two."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def variants(rec: Recorder, dtype: torch.dtype) -> dict:
    """name -> (layer, k, v) -> (k, v). Scales from the recorded data (ideal calibration on these prompts)."""
    k_head = [x.abs().amax((0, 2)) / fp8.FP8_MAX for x in rec.keys]  # [Hkv] per layer
    v_head = [x.abs().amax((0, 2)) / fp8.FP8_MAX for x in rec.values]
    k_chan = [x.abs().amax(0) / fp8.FP8_MAX for x in rec.keys]  # [Hkv, D]
    one = torch.ones(())

    def tok(x):  # a scale per token and head: [T, Hkv, 1]
        return (x.float().abs().amax(-1, keepdim=True) / fp8.FP8_MAX).clamp_min(1e-12)

    d = rec.keys[0].shape[-1]
    hadamard = _hadamard(d) / d**0.5  # orthogonal: q.k = (q H).(k H), so a cache may hold k H

    def rot(x, scale):  # fake-quantized in the Hadamard basis, read back in the original one
        return (fake_fp8(x.float() @ hadamard, scale) @ hadamard.T).to(x.dtype)

    # K's mean over tokens per channel: a constant key offset adds q.mu to every score of a query, which
    # the softmax cancels, so a cache may hold k - mu (smaller, so its rounding error is smaller) instead
    k_mean = [x.mean(0) for x in rec.keys]  # [Hkv, D]

    def centered(i, k, scale):
        return (fake_fp8(k.float() - k_mean[i], scale) + k_mean[i]).to(k.dtype)

    def int8_token(x):  # symmetric int8 with a scale per token and head, for comparison
        s = (x.float().abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)
        return ((x.float() / s).round().clamp(-127, 127) * s).to(x.dtype)

    out = {
        "k_centered_scale1": lambda i, k, v: (centered(i, k, one), v),
        "kv_centered_scale1": lambda i, k, v: (centered(i, k, one), fake_fp8(v, one)),
        "k_centered_token_absmax": lambda i, k, v: (centered(i, k, tok(k.float() - k_mean[i])), v),
        "k_only_int8_token": lambda i, k, v: (int8_token(k), v),
        "kv_int8_token": lambda i, k, v: (int8_token(k), int8_token(v)),
        "k_centered_hadamard_scale1": lambda i, k, v: ((rot(k.float() - k_mean[i], one) + k_mean[i]).to(k.dtype), v),
        "k_hadamard_scale1": lambda i, k, v: (rot(k, one), v),
        "kv_hadamard_scale1": lambda i, k, v: (rot(k, one), rot(v, one)),
        "k_hadamard_token_absmax": lambda i, k, v: (rot(k, tok(k.float() @ hadamard)), v),
        "kv_scale1": lambda i, k, v: (fake_fp8(k, one), fake_fp8(v, one)),
        "k_only_scale1": lambda i, k, v: (fake_fp8(k, one), v),
        "v_only_scale1": lambda i, k, v: (k, fake_fp8(v, one)),
        "kv_head_absmax": lambda i, k, v: (fake_fp8(k, k_head[i][:, None]), fake_fp8(v, v_head[i][:, None])),
        "k_only_head_absmax": lambda i, k, v: (fake_fp8(k, k_head[i][:, None]), v),
        "v_only_head_absmax": lambda i, k, v: (k, fake_fp8(v, v_head[i][:, None])),
        "kv_token_absmax": lambda i, k, v: (fake_fp8(k, tok(k)), fake_fp8(v, tok(v))),
        "k_only_token_absmax": lambda i, k, v: (fake_fp8(k, tok(k)), v),
        "v_only_token_absmax": lambda i, k, v: (k, fake_fp8(v, tok(v))),
        "k_channel_v_head_absmax": lambda i, k, v: (fake_fp8(k, k_chan[i]), fake_fp8(v, v_head[i][:, None])),
    }
    if dtype == torch.float32:  # the floor: a bf16 cache under an fp32 model
        out["kv_bf16"] = lambda i, k, v: (k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float())
        out["k_only_bf16"] = lambda i, k, v: (k.to(torch.bfloat16).float(), v)
        out["v_only_bf16"] = lambda i, k, v: (k, v.to(torch.bfloat16).float())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16", help="the model's (and the plain cache's) dtype")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--only", default=None, help="comma-separated variant names (default: all)")
    ap.add_argument("--calibration-prompts", type=int, default=0,
                    help="take the variants' scales and K means from this many other prompts (default: the measured ones)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    engine = Engine.load(args.model, device="cpu", dtype=dtype, weight_format="dense", kv_dtype="auto",
                         progress=False, kv_cache_tokens=args.prompts * 512)
    prompts = prompts_for(engine, args.prompts)
    outs = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=args.steps - 1, ignore_eos=True))
    forced = [p + [o.token_id for o in seq] for p, seq in zip(prompts, outs)]
    with Recorder(engine.config.num_layers) as rec:
        base = prefill_logits(engine, forced, args.steps).double()
        stats = {"K": [head_stats(x) for x in rec.keys], "V": [head_stats(x) for x in rec.values]}
        if args.calibration_prompts:  # prompts after the measured ones (other topic and style pairs)
            others = prompts_for(engine, args.prompts + args.calibration_prompts)[args.prompts:]
            prefill_logits(engine, others, 1)
        results = {}
        chosen = variants(rec, dtype)
        for name, fn in chosen.items():
            if args.only and name not in args.only.split(","):
                continue
            rec.variant = fn
            cos = torch.nn.functional.cosine_similarity(prefill_logits(engine, forced, args.steps).double(), base, dim=-1)
            results[name] = {"cosine_mean": round(cos.mean().item(), 6), "cosine_min": round(cos.min().item(), 6)}
            print(f"{name:28s} mean {results[name]['cosine_mean']:.6f}  min {results[name]['cosine_min']:.6f}", flush=True)
    for kind in ("K", "V"):
        rows = stats[kind]
        print(f"{kind}: absmax per layer (max over heads):", [round(max(r["absmax"]), 2) for r in rows])
        print(f"{kind}: median |x| per layer (min over heads):", [round(min(r["median"]), 4) for r in rows])
        print(f"{kind}: subnormal frac at scale 1 (max over heads):", [round(max(r["frac_subnormal"]), 3) for r in rows])
        print(f"{kind}: flushed frac (max over heads):", [round(max(r["frac_flushed"]), 3) for r in rows])
        print(f"{kind}: clamped frac (max):", max(max(r["frac_clamped"]) for r in rows))
        print(f"{kind}: channel spread (max over heads):", [round(max(r["channel_spread"]), 1) for r in rows])
    doc = {"bench": "fp8_kv_stats", "model": args.model, "dtype": args.dtype, "prompts": args.prompts,
           "steps": args.steps, "tokens": int(rec.keys[0].shape[0]), "cosine": results, "stats": stats}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
