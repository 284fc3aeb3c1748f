"""Decode and prefill attention kernels, timed alone over a sweep of launch configs (GPU).

    python benchmarks/attention_bench.py [--quick] [--out attention.json]
    python benchmarks/attention_bench.py --kv-dtypes   # issue 22: 8B decode at 32 x 4k and 1 x 32k, bf16 vs fp8 cache

Each case builds a paged bf16 cache with random pages (page size 16, as the engine)
and checks the kernel against its torch reference once. Decode runs the rope +
KV-write variant the decode graphs use, timed in a CUDA graph over copies of the
cache too large for L2 together (`graph_time_us`); prefill is timed with
`triton.testing.do_bench` (L2 flushed before every call). Medians throughout. Prints one line per
(case, config) and, per case, the fastest config against the default one.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys

import torch

from gpu_timing import graph_time_us

PAGE = 16
# (name, heads, kv heads, head dim, batch, context)
DECODE_CASES = [
    ("8b-b1-ctx192", 32, 8, 128, 1, 192),
    ("8b-b1-ctx2048", 32, 8, 128, 1, 2048),
    ("8b-b64-ctx192", 32, 8, 128, 64, 192),
    ("8b-b256-ctx640", 32, 8, 128, 256, 640),
    ("smollm-b1-ctx192", 9, 3, 64, 1, 192),
    ("smollm-b64-ctx192", 9, 3, 64, 64, 192),
]
# Issue 22's decode shapes, each with a bf16 and an fp8 cache (--kv-dtypes): 8B at batch 32 x 4k, 1 x 32k
KV_DTYPE_CASES = [
    ("8b-b32-ctx4096", 32, 8, 128, 32, 4096),
    ("8b-b1-ctx32768", 32, 8, 128, 1, 32768),
]
# --one-row: batch-1 decode as the engine launches it (config and splits its own choice), by context and by
# the block table's width (the model's max length, which the split count follows): (name, heads, kv heads, head dim)
ONE_ROW_SHAPES = [("8b", 32, 8, 128), ("qwen3-moe", 32, 4, 128)]
ONE_ROW_CONTEXTS = [(255, 272), (255, 40960), (2047, 40960), (32767, 40960)]  # (context, max model length)
# (name, heads, kv heads, head dim, sequences, new tokens each, context before them)
PREFILL_CASES = [
    ("8b-4x512", 32, 8, 128, 4, 512, 0),
    ("8b-1x512-after-1024", 32, 8, 128, 1, 512, 1024),
    ("8b-16x512", 32, 8, 128, 16, 512, 0),
]


def paged_cache(batch: int, context: int, kv_heads: int, head_dim: int, spare_tokens: int = 16, fp8_scale=None):
    """A shuffled page pool holding `batch` sequences of `context` tokens (+ room for the next one); bf16,
    or e4m3 at ``fp8_scale`` ([Hkv] fp32) when given."""
    from spark.engine.kernels import fp8

    pages_per_seq = -(-(context + spare_tokens) // PAGE)
    num_pages = batch * pages_per_seq + 1
    k_cache = torch.randn(num_pages, PAGE, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    if fp8_scale is not None:
        k_cache, v_cache = fp8.quantize_reference(k_cache, fp8_scale), fp8.quantize_reference(v_cache, fp8_scale)
    order = torch.randperm(num_pages - 1, device="cuda")[: batch * pages_per_seq] + 1
    tables = order.view(batch, pages_per_seq).to(torch.int32)
    return k_cache, v_cache, tables


def time_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1000.0


def decode_case(case, configs, kv_dtype: str = "bf16") -> list[dict]:
    from spark.engine.kernels import paged_attention as pa

    name, heads, kv_heads, head_dim, batch, context = case
    fp8_cache = kv_dtype == "fp8"
    # scales unlike 1.0 (and unlike each other), so that a kernel that drops one fails the check
    scale_kw = {"k_scale": torch.linspace(0.02, 0.04, kv_heads, device="cuda"),
                "v_scale": torch.linspace(0.03, 0.01, kv_heads, device="cuda")} if fp8_cache else {}
    k_cache, v_cache, tables = paged_cache(batch, context, kv_heads, head_dim, fp8_scale=scale_kw.get("k_scale"))
    # Copies of the cache, one per call in the timing graph, about 128 MB in all: a real
    # step reads each layer's cache once, after the weights have flushed it from L2.
    copies = max(1, min(512, -(-(128 << 20) // (2 * k_cache.numel() * k_cache.element_size()))))
    caches = [(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone()) for _ in range(copies - 1)]
    seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device="cuda")
    positions = seq_lens.long() - 1
    slots = tables[:, context // PAGE].long() * PAGE + context % PAGE
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    scale = head_dim**-0.5
    kc, vc = k_cache.clone(), v_cache.clone()
    want = pa.paged_decode_attention_rope_reference(q, k, v, positions, inv_freq, kc, vc, slots, tables, seq_lens, scale,
                                                    **scale_kw)
    kv_bytes = 2 * batch * (context + 1) * kv_heads * head_dim * k_cache.element_size()
    rows = []
    # The default row is the engine's own launch: its config (one row's where it fits) and its split count.
    max_context = tables.shape[1] * PAGE
    one_row_fits = getattr(pa, "one_row_fits", None)  # a tree from before the one-row config has none
    if one_row_fits is not None and one_row_fits(batch, kv_heads, head_dim, max_context):
        default = pa.decode_config(head_dim, fp8_cache, True)
    else:
        try:
            default = pa.decode_config(head_dim, fp8_cache)
        except TypeError:  # a tree from before fp8 configs (A/B against main: PYTHONPATH at its checkout)
            default = pa.decode_config(head_dim)
    try:
        auto_splits = pa.choose_num_splits(batch, kv_heads, max_context, default.block_n)
    except TypeError:  # a tree whose partitions are not sized by the launch's key step
        auto_splits = pa.choose_num_splits(batch, kv_heads, max_context)
    for cfg, splits in [(default, None)] + [c for c in configs(batch, default) if c != (default, None)]:
        is_default = (cfg, splits) == (default, None)
        splits = splits or auto_splits

        def call(kv=(k_cache, v_cache), cfg=cfg, splits=splits):
            return pa.paged_decode_attention_rope_triton(q, k, v, positions, inv_freq, *kv, slots, tables, seq_lens,
                                                         scale, num_splits=splits, config=cfg, **scale_kw)
        try:
            # relative to the output's size: random keys spread attention thin, so outputs are small
            # and an absolute bound alone would pass a kernel that mixed up V's dims
            err = (call().float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
            us = graph_time_us([functools.partial(call, kv) for kv in caches])
        except Exception as exc:  # a config that does not compile (registers, shared memory) is skipped
            print(f"{name} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        rows.append({"kernel": "decode_rope", "case": f"{name}-{kv_dtype}", "kv_dtype": kv_dtype,
                     "default": is_default, "splits": splits,
                     "block_n": cfg.block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "us": round(us, 2),
                     "kv_tb_s": round(kv_bytes / us / 1e6, 3), "max_rel_err": round(err, 4)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def one_row_case(shape, context: int, max_len: int) -> dict:
    """Batch-1 decode of ``shape`` at ``context`` keys as the engine launches it (no config, no split count
    given: the tree's own choices), the block table ``max_len`` keys wide; timed as ``decode_case`` times."""
    from spark.engine.kernels import paged_attention as pa

    name, heads, kv_heads, head_dim = shape
    k_cache, v_cache, tables = paged_cache(1, context, kv_heads, head_dim)
    width = -(-max_len // PAGE)
    tables = torch.cat([tables, tables[:, :1].expand(1, width - tables.shape[1])], dim=1).contiguous()
    copies = max(1, min(512, -(-(128 << 20) // (2 * k_cache.numel() * k_cache.element_size()))))
    caches = [(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone()) for _ in range(copies - 1)]
    seq_lens = torch.full((1,), context + 1, dtype=torch.int32, device="cuda")
    positions = seq_lens.long() - 1
    slots = tables[:, context // PAGE].long() * PAGE + context % PAGE
    q = torch.randn(1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    scale = head_dim**-0.5

    def call(kv=(k_cache, v_cache)):
        return pa.paged_decode_attention_rope_triton(q, k, v, positions, inv_freq, *kv, slots, tables, seq_lens, scale)
    want = pa.paged_decode_attention_rope_reference(q, k, v, positions, inv_freq, k_cache.clone(), v_cache.clone(),
                                                    slots, tables, seq_lens, scale)
    err = (call().float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
    us = graph_time_us([functools.partial(call, kv) for kv in caches])
    row = {"kernel": "decode_rope_one_row", "case": f"{name}-ctx{context + 1}-max{max_len}", "us": round(us, 2),
           "max_rel_err": round(err, 4)}
    print(json.dumps(row), flush=True)
    return row


def prefill_case(case, configs) -> list[dict]:
    from spark.engine.kernels import prefill_attention as pf

    name, heads, kv_heads, head_dim, seqs, new, before = case
    context = before + new
    k_cache, v_cache, tables = paged_cache(seqs, context, kv_heads, head_dim)
    q = torch.randn(seqs * new, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, seqs + 1, device="cuda", dtype=torch.int32) * new
    seq_lens = torch.full((seqs,), context, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    want = pf.paged_prefill_attention_reference(q, k_cache, v_cache, qsl, seq_lens, tables, scale, new)
    # causal FLOPs: each new token i attends to before + i + 1 keys; QK and PV
    flops = 4 * heads * head_dim * seqs * sum(before + i + 1 for i in range(new))
    rows = []
    for block_m, block_n, stages in configs:
        def run():
            return pf.paged_prefill_attention_triton(q, k_cache, v_cache, qsl, seq_lens, tables, scale, new,
                                                     block_m=block_m, block_n=block_n, num_stages=stages)
        try:
            err = (run().float() - want.float()).abs().max().item()
            us = time_us(run)
        except Exception as exc:
            print(f"{name} {(block_m, block_n, stages)}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        rows.append({"kernel": "prefill", "case": name, "default": (block_m, block_n, stages) == (64, 64, 2),
                     "block_m": block_m, "block_n": block_n, "num_stages": stages,
                     "us": round(us, 2), "tflop_s": round(flops / us / 1e6, 1), "max_abs_err": round(err, 4)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _close_enough(row: dict) -> bool:
    """A row's kernel agreed with its torch reference: within 5% of the output's largest value (decode),
    or 0.05 (prefill)."""
    err = row.get("max_rel_err", row.get("max_abs_err"))
    return math.isfinite(err) and err < 0.05


def summarize(rows: list[dict]) -> None:
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        best = min(mine, key=lambda r: r["us"])
        base = next((r for r in mine if r["default"]), None)
        knobs = {k: best[k] for k in ("block_m", "block_n", "num_warps", "num_stages", "splits") if k in best}
        print(f"{case:24s} best {best['us']:8.2f} us {knobs}  default {base['us'] if base else '-'} us")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the default configs only")
    ap.add_argument("--kv-dtypes", action="store_true",
                    help="only issue 22's decode shapes, bf16 and fp8 caches: the defaults, and a sweep of fp8 configs")
    ap.add_argument("--one-row", action="store_true",
                    help="only batch-1 decode as the engine launches it, by context and max model length")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.one_row:
        torch.manual_seed(0)
        rows = [one_row_case(shape, ctx, max_len) for shape in ONE_ROW_SHAPES for ctx, max_len in ONE_ROW_CONTEXTS]
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"bench": "attention_one_row", "rows": rows}, f, indent=1)
        return 0 if all(map(_close_enough, rows)) else 1
    import attrs

    from spark.engine.kernels.decode_plan import DecodeConfig

    if args.quick:  # the default (spark.engine.kernels.decode_plan.decode_config), its neighbours
        def decode_configs(batch, default):
            more = [(default, s) for s in ((4, 8) if batch == 1 else (2, 4))]
            return [(attrs.evolve(default, num_stages=0), None)] + more
        prefill_configs = [(64, 64, 2), (64, 64, 0)]
    else:
        def decode_configs(batch, default):
            if batch == 1:  # few programs: splitting the context is the other way to parallelism
                return [(DecodeConfig(block_n=n, num_warps=w, num_stages=s), splits)
                        for n, w, s, splits in itertools.product((32, 64, 128), (2, 4), (2, 3), (None, 2, 4, 8))]
            return [(DecodeConfig(block_n=n, num_warps=w, num_stages=s), None)
                    for n, w, s in itertools.product((32, 64, 128), (2, 4, 8), (0, 2, 3))]
        prefill_configs = list(itertools.product((64,), (32, 64), (0, 2, 3)))
    torch.manual_seed(0)
    rows = []
    if args.kv_dtypes:
        def fp8_configs(batch, default):
            return [(DecodeConfig(block_n=n, num_warps=w, num_stages=s), None)
                    for n, w, s in itertools.product((64, 128, 256), (4, 8), (2, 3))]
        from spark.engine.kernels import paged_attention as pa

        for case in KV_DTYPE_CASES:
            rows += decode_case(case, lambda batch, default: [], "bf16")
            rows += decode_case(case, fp8_configs, "fp8")
            if hasattr(pa, "FP8_V_EARLY"):  # A/B: V converted in the dot's operand layout (byte loads), as before
                pa.FP8_V_EARLY = False
                rows += [dict(r, case=r["case"] + "-v-late") for r in decode_case(case, lambda b, d: [], "fp8")]
                pa.FP8_V_EARLY = True
        summarize(rows)
        fastest = {r["case"]: r["us"] for r in rows if r["default"]}
        for name, *_ in KV_DTYPE_CASES:
            bf16, fp8_us = fastest.get(f"{name}-bf16"), fastest.get(f"{name}-fp8")
            if bf16 and fp8_us:
                print(f"{name:24s} fp8 default config {bf16 / fp8_us:.3f}x the bf16 kernel's rate (roofline 2x)")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"bench": "attention", "rows": rows}, f, indent=1)
        return 0 if all(map(_close_enough, rows)) else 1
    for case in DECODE_CASES:
        rows += decode_case(case, decode_configs)
    for case in PREFILL_CASES:
        rows += prefill_case(case, prefill_configs)
    summarize(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bench": "attention", "rows": rows}, f, indent=1)
    return 0 if all(map(_close_enough, rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
