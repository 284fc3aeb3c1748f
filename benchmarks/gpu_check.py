"""GPU correctness check of the engine's CUDA path, one command on a GPU machine.

    python benchmarks/gpu_check.py

1. Triton kernels (paged decode attention with and without split-KV, KV write,
   fused rope + KV write, decode attention with the rope + KV write folded in)
   against their torch references on random bf16 data of real shapes.
2. The engine on dummy weights of real shapes (bf16): the Triton decode path
   against the torch reference path, token for token (greedy), and a first
   rough decode speed (the tuned fast path is a later issue).
Prints a table; writes JSON next to the other results.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time

import torch

from spark.engine.offline import generate
from spark.engine.engine import Engine
from spark.engine.models.ops import TorchOps
from spark.engine.kernels import activation, kv_write, paged_attention as pa, rope
from spark.engine.sampling import SamplingParams


def check_kernels(rows: list) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, ctx, hkv, group, dim, page, splits in [
        (1, 17, 8, 4, 128, 16, None), (8, 1000, 8, 4, 128, 16, None), (64, 300, 8, 4, 128, 16, 1),
        (4, 4096, 8, 4, 128, 16, None), (4, 4096, 8, 4, 128, 16, 1), (16, 2000, 3, 3, 64, 16, None),
        (32, 129, 2, 7, 64, 32, 4),
    ]:
        pages_per_seq = -(-ctx // page)
        num_pages = batch * pages_per_seq + 1
        k_cache = torch.randn(num_pages, page, hkv, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        v_cache = torch.randn(num_pages, page, hkv, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        perm = torch.randperm(num_pages - 1, device="cuda", generator=gen) + 1
        tables = perm[: batch * pages_per_seq].view(batch, pages_per_seq).int()
        seq_lens = torch.randint(1, ctx + 1, (batch,), device="cuda", generator=gen).int()
        seq_lens[0] = ctx
        q = torch.randn(batch, hkv * group, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        scale = dim**-0.5
        ref = pa.paged_decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, scale)
        out = pa.paged_decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, scale, num_splits=splits)
        torch.cuda.synchronize()
        err = (out.float() - ref).abs().max().item()
        t = bench(lambda: pa.paged_decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, scale, num_splits=splits))
        rows.append({"check": "decode_attention", "batch": batch, "ctx": ctx, "heads": hkv * group, "kv_heads": hkv,
                     "head_dim": dim, "page": page, "splits": splits, "max_abs_err": err, "us": t * 1e6, "ok": err < 2e-2})
    k = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::7] = -1
    kc, vc = torch.zeros(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16), torch.zeros(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    kr, vr = kc.clone(), vc.clone()
    kv_write.write_kv_triton(k, v, kc, vc, slots)
    kv_write.write_kv_reference(k, v, kr, vr, slots)
    rows.append({"check": "kv_write", "ok": bool(torch.equal(kc, kr) and torch.equal(vc, vr))})
    check_rope_write_kv(rows)
    check_decode_inputs(rows)


def check_decode_inputs(rows: list) -> None:
    """The decode graph's unpacking kernel vs its reference: every buffer bit-equal."""
    from spark.engine.kernels import decode_inputs as di

    gen = torch.Generator().manual_seed(4)
    for bucket, width, columns in ((1, 9, 17), (64, 13, 512), (256, 300, 512)):
        ring = torch.randint(0, 1 << 17, (4, 256), generator=gen)
        fields = [torch.randint(0, 1 << 30, (4, bucket), generator=gen).view(-1),
                  torch.randint(-2, ring.numel(), (bucket,), generator=gen),
                  torch.randint(0, 1 << 20, (bucket * width,), generator=gen)]
        staged = torch.cat([torch.tensor([width, 3]), *fields])

        def buffers(device):
            return dict(ring=ring.to(device), fed=torch.arange(256, device=device), input_ids=torch.zeros(256, dtype=torch.int64, device=device),
                        positions=torch.zeros(256, dtype=torch.int64, device=device),
                        slot_mapping=torch.zeros(256, dtype=torch.int64, device=device),
                        seq_lens=torch.zeros(256, dtype=torch.int32, device=device),
                        block_tables=torch.zeros(256, columns, dtype=torch.int32, device=device),
                        ring_index=torch.zeros(256, dtype=torch.int64, device=device))

        want, got = buffers("cpu"), buffers("cuda")
        di.unpack_decode_inputs_reference(staged, bucket, **want)
        di.unpack_decode_inputs_triton(staged.cuda(), bucket, **got)
        same = all(torch.equal(got[k].cpu(), want[k]) for k in want)
        rows.append({"check": "decode_inputs", "bucket": bucket, "width": width, "ok": same})


def check_rope_write_kv(rows: list) -> None:
    """The fused rope + KV-write kernel vs rope-then-write in torch, on a Llama-3.1-8B layer's shapes (bf16)."""
    heads, kv_heads, dim, tokens, page = 32, 8, 128, 64, 16
    gen = torch.Generator(device="cuda").manual_seed(2)
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = (x.view(tokens, -1, dim) for x in fused.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1))
    positions = torch.randint(0, 131072, (tokens,), device="cuda", generator=gen)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    num_pages = 2 * tokens // page
    slots = torch.randperm(num_pages * page, device="cuda", generator=gen)[:tokens]
    slots[::5] = -1  # padding tokens: nothing may be written for them
    kc = torch.full((num_pages, page, kv_heads, dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    vc, kr, vr = kc.clone(), kc.clone(), kc.clone()
    q_out = rope.rope_and_write_kv_triton(q, k, v, positions, inv_freq, kc, vc, slots)
    q_ref = rope.rope_and_write_kv_reference(q, k, v, positions, inv_freq, kr, vr, slots)
    torch.cuda.synchronize()
    written = ~kr.isnan()
    same_slots = torch.equal(kc.isnan(), ~written) and torch.equal(vc.isnan(), ~written)
    # Same fp32 formula on both sides; only cos/sin ulps differ, so at most 1 bf16 ulp
    # apart (a bf16 ulp of x is at most |x| * 2**-7; 1e-6 lets values near 0 change sign).
    pairs = [(q_out.float(), q_ref.float()), (kc[written].float(), kr[written].float())]
    within_ulp = all(bool(((a - b).abs() <= b.abs() * 2**-7 + 1e-6).all()) for a, b in pairs)
    err = max((a - b).abs().max().item() for a, b in pairs)
    t = bench(lambda: rope.rope_and_write_kv_triton(q, k, v, positions, inv_freq, kc, vc, slots))
    rows.append({"check": "rope_write_kv", "tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
                 "page": page, "max_abs_err": err, "within_1_bf16_ulp": within_ulp,
                 "us": t * 1e6,
                 "ok": bool(same_slots and within_ulp and torch.equal(vc[written], vr[written]))})


def check_decode_attention_rope(rows: list) -> None:
    """Rope + KV write + decode attention in one launch vs its reference, and vs the unfused kernels' cache (bf16)."""
    heads, kv_heads, dim, page = 32, 8, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(4)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    scale = dim**-0.5
    for batch, ctx in [(1, 17), (1, 300), (8, 17), (8, 300)]:
        pages_per_seq = -(-ctx // page)
        num_pages = batch * pages_per_seq + 1
        k_cache = torch.randn(num_pages, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        v_cache = torch.randn_like(k_cache)
        tables = (torch.randperm(num_pages - 1, device="cuda", generator=gen)[: batch * pages_per_seq] + 1)
        tables = tables.view(batch, pages_per_seq).int()
        seq_lens = torch.randint(1, ctx + 1, (batch,), device="cuda", generator=gen).int()
        seq_lens[0] = ctx
        positions = seq_lens.long() - 1  # the new token is the last key of its sequence
        slots = tables.gather(1, (positions // page)[:, None]).squeeze(1).long() * page + positions % page
        fused = torch.randn(batch, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        q, k, v = (x.view(batch, -1, dim) for x in fused.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1))
        args = (q, k, v, positions, inv_freq)
        kf, vf, kr, vr, ku, vu = (c.clone() for c in (k_cache, v_cache) * 3)
        out = pa.paged_decode_attention_rope_triton(*args, kf, vf, slots, tables, seq_lens, scale)
        # paged_decode_attention_rope_reference, with its attention in fp32 (as check_kernels'
        # reference): bf16 SDPA would add its own rounding to the comparison.
        q_rot = rope.rope_and_write_kv_reference(*args, kr, vr, slots)
        ref = pa.paged_decode_attention_reference(q_rot.float(), kr.float(), vr.float(), tables, seq_lens, scale)
        rope.rope_and_write_kv_triton(*args, ku, vu, slots)
        torch.cuda.synchronize()
        err = (out.float() - ref.float()).abs().max().item()
        # The new tokens' K/V bit for bit as the unfused kernel writes them, nothing else touched.
        cache_equal = bool(torch.equal(kf, ku) and torch.equal(vf, vu))
        t = bench(lambda: pa.paged_decode_attention_rope_triton(*args, kf, vf, slots, tables, seq_lens, scale))

        def unfused():
            q_rot = rope.rope_and_write_kv_triton(*args, ku, vu, slots)
            pa.paged_decode_attention_triton(q_rot, ku, vu, tables, seq_lens, scale)

        t_unfused = bench(unfused)
        rows.append({"check": "decode_attention_rope", "batch": batch, "ctx": ctx, "heads": heads, "kv_heads": kv_heads,
                     "head_dim": dim, "page": page, "max_abs_err": err, "cache_equal_unfused": cache_equal,
                     "us": t * 1e6, "us_unfused": t_unfused * 1e6, "ok": err < 2e-2 and cache_equal})


def bench(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def check_small_linear_rows(rows: list) -> None:
    """The small-row kernel where the model routes 33-64 rows to it (``TritonOps.project``),
    against cuBLAS on Llama-3.1-8B's shapes: the same product, up to fp32 summation order."""
    from spark.engine.kernels import small_linear as sl

    gen = torch.Generator(device="cuda").manual_seed(3)
    for m in (33, 64):
        for name, n, k in (("wo", 4096, 4096), ("w13", 28672, 4096), ("w2", 4096, 14336)):
            assert sl.beats_cublas(m, k, torch.bfloat16)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
            got, want = sl.small_linear_triton(x, w).float(), torch.nn.functional.linear(x, w).float()
            if name == "w13":  # as the model runs it: the gate in the epilogue
                rows.append(_compare("small_linear_rows", "w13+gate", m, sl.small_linear_triton(x, w, gated_output=True),
                                     activation.silu_and_mul_triton(torch.nn.functional.linear(x, w))))
            rows.append(_compare("small_linear_rows", name, m, got, want))
    # Split K at 64 rows (wo, w2): the partials summed by the add-norm kernel, as the model
    # runs them, against cuBLAS + the unsplit add-norm.
    from spark.engine.kernels import norm as norm_kernels
    for name, n, k in (("wo", 4096, 4096), ("w2", 4096, 14336)):
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        residual = torch.randn(64, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        g = (torch.rand(n, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
        for cfg in (sl.split_config(64, n, k), sl.Config(64, 128, num_stages=4, use_dot=True, split_k=4)):
            if cfg is None:
                continue
            partials = sl.small_linear_split_k_triton(x, w, cfg)
            got = norm_kernels.add_rms_norm_triton(partials, residual, g, 1e-5)
            want = norm_kernels.add_rms_norm_triton(torch.nn.functional.linear(x, w), residual, g, 1e-5)
            rows.append(_compare("small_linear_split_k", f"{name}+add_norm k{cfg.split_k}", 64, got[1], want[1]))
            rows.append(_compare("small_linear_split_k", f"{name}+add_norm k{cfg.split_k} normed", 64, got[0], want[0]))
    # Batch 1's w13 of a wide model: the norm before and the gate after, on the one-row path.
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    w = (torch.randn(28672, 4096, device="cuda", generator=gen) / 64).to(torch.bfloat16)
    g = (torch.rand(4096, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    assert sl.gate_in_epilogue(1, 4096)
    rows.append(_compare("small_linear_rows", "w13+norm+gate", 1,
                         sl.small_linear_triton(x, w, norm_weight=g, eps=1e-5, gated_output=True),
                         sl.small_linear_reference(x, w, norm_weight=g, eps=1e-5, gated_output=True)))


def _compare(check: str, proj: str, m: int, got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.float(), want.float()
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()
    rel = ((got - want).abs() / want.abs().clamp_min(1e-3)).max().item()
    return {"check": check, "proj": proj, "m": m, "min_cos": round(cos, 7), "max_rel_diff": round(rel, 4),
            "ok": cos > 0.99999}


def check_engine(rows: list, preset: str, batches: tuple[int, ...], new_tokens: int) -> None:
    """Decode logits of the Triton path vs the torch reference path, then a rough speed.

    Greedy tokens of random-weight models sit on near-ties, so bf16 rounding
    differences flip them; the honest comparison is the logits of the same step
    (prefill runs the same code in both paths, so the decode inputs are equal).
    """
    t0 = time.perf_counter()
    engine = Engine.load(f"dummy:{preset}", device="cuda", progress=False, kv_cache_bytes=8 << 30, max_model_len=4096)
    load_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(1)
    for batch in batches:
        prompts = [torch.randint(0, engine.config.vocab_size, (128,), generator=gen).tolist() for _ in range(batch)]
        two = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        generate(engine, prompts[:1], two)  # warm-up (Triton compile)
        fast_logits = _second_step_logits(engine, prompts, two)
        originals = pa.paged_decode_attention_triton, pa.paged_decode_attention_rope_triton
        pa.paged_decode_attention_triton = lambda q, kc, vc, bt, sl, scale: pa.paged_decode_attention_reference(q, kc, vc, bt, sl, scale)
        pa.paged_decode_attention_rope_triton = pa.paged_decode_attention_rope_reference  # the decode path's kernel
        try:
            ref_logits = _second_step_logits(engine, prompts, two)
        finally:
            pa.paged_decode_attention_triton, pa.paged_decode_attention_rope_triton = originals
        cos = torch.nn.functional.cosine_similarity(fast_logits, ref_logits, dim=-1).min().item()
        diff = (fast_logits - ref_logits).abs().max().item()
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate(engine, prompts, params)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        total = sum(len(o) for o in out)
        rows.append({"check": "engine", "model": preset, "batch": batch, "load_s": round(load_s, 1),
                     "decode_logits_min_cos": round(cos, 6), "decode_logits_max_abs_diff": round(diff, 4),
                     "logit_scale": round(ref_logits.abs().max().item(), 3),
                     "tok_s_incl_prefill": round(total / seconds, 1), "ok": cos > 0.999})
    del engine
    torch.cuda.empty_cache()


def _second_step_logits(engine, prompts, params) -> torch.Tensor:
    captured = []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    try:
        generate(engine, prompts, params)
    finally:
        engine.model.compute_logits = compute
    return captured[-1].float()


def check_gpu_vs_cpu(rows: list) -> None:
    """The same fp32 weights on the CPU path (torch references) and the GPU path (Triton, graphs): greedy tokens."""
    # float32: dense weights (the CPU's default packs them in 4 bits, which a GPU copy cannot run).
    cpu = Engine.load("dummy:smollm2-135m", device="cpu", dtype=torch.float32, progress=False,
                      kv_cache_bytes=256 << 20, max_model_len=512)
    model = copy.deepcopy(cpu.model).to("cuda")
    for m in model.modules():  # the references on the GPU (the CPU's own ops have no padded slots)
        if hasattr(m, "ops"):
            m.ops = TorchOps()
    gpu = Engine(model, tokenizer=cpu.tokenizer, kv_cache_bytes=256 << 20, max_model_len=512)
    gpu.enable_cuda_graphs(8)
    gpu.graphs.capture_all()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cpu.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 33, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    # Seeded draws are a pure function of (seed, step, logits), so the two paths agree there
    # too; a batch that mixes them takes the sampler, whose tokens the graphs take on the host.
    mixed = [params, SamplingParams(temperature=0.8, seed=5, max_tokens=32, ignore_eos=True), params,
             SamplingParams(temperature=0.0, logprobs=2, max_tokens=32, ignore_eos=True)]
    # A batch of 4, then batch 1 (the fused small-row path); plain greedy rows (the graphs'
    # own argmax, fed from their ring), then the mixed batch.
    for group, p in ((prompts, params), (prompts[1:2], params), (prompts, mixed)):
        a = [[o.token_id for o in r] for r in generate(cpu, group, p)]
        b = [[o.token_id for o in r] for r in generate(gpu, group, p)]
        same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
        rows.append({"check": "gpu_vs_cpu_fp32_greedy" if p is params else "gpu_vs_cpu_fp32_mixed",
                     "model": "smollm2-135m (dummy, fp32)", "batch": len(group),
                     "tokens_equal": f"{same}/{32 * len(group)}", "ok": same == 32 * len(group)})


def main() -> int:
    assert torch.cuda.is_available(), "needs a GPU"
    rows: list = []
    check_kernels(rows)
    check_decode_attention_rope(rows)
    check_gpu_vs_cpu(rows)
    check_small_linear_rows(rows)
    check_engine(rows, "smollm2-135m", (1, 64), 64)
    check_engine(rows, "tiny-qwen3", (4,), 16)
    check_engine(rows, "llama-3.1-8b", (1, 8, 64), 64)
    for r in rows:
        print(json.dumps(r))
    out = sys.argv[1] if len(sys.argv) > 1 else "gpu_check.json"
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
