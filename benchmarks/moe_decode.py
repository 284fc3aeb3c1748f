"""MoE decode speed against the roofline of the bytes a step actually reads, beside HF transformers.

    python benchmarks/moe_decode.py                      # the H200 run: dummy qwen3-30b-a3b, bf16, batch 1 and 64
    python benchmarks/moe_decode.py --device cpu --preset tiny-qwen3-moe --quick   # a check of the script

Dummy (random, never zero) weights of the real shapes; 128-token random prompts, 128 new
tokens, greedy, no EOS stop. Spark's decode is timed over the decode steps only (CUDA
events around them; prefill excluded), CUDA graphs on, after a warm-up, median of 3 runs.

The roofline counts the bytes a decode step must read (../shared/PERF.md's method): every
weight outside the experts once (attention, norms, routers, dense MLP layers, the head; one
embedding row per sequence), the experts the step's tokens are routed to (each once, however
many of the batch's tokens share it), the KV cache read and written; over 4.25 TB/s, or the
step's FLOPs over 783 TFLOP/s if larger (``roofline_frac``; ``roofline_frac_copy`` divides by this
card's own measured copy rate instead). Batch 1 touches top-k experts a layer; how many a
batch of 64 touches is counted from the router during an eager run of the same decode (the
warm-up), layer by layer and step by step. Each row names the path its experts ran by
(``moe_path``: the GEMVs for a few tokens, the grouped GEMMs for more, the reference on the CPU).

transformers' ``generate`` of the same config with random bf16 weights runs in the same
process afterwards (its dynamic cache; fewer new tokens at batch 1, where it is slow). Prints
progress and a table; writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's spark
from offline_decode import copy_bandwidth, decode_once, git_commit, sync, write_results  # noqa: E402  (a sibling: benchmarks/ is the script's directory)

BANDWIDTH = 4.25e12  # bytes/s, device-to-device copy on one H200 (PERF.md)
MATMUL = 783e12  # bf16 FLOP/s on one H200 (PERF.md)


def log(msg: str) -> None:
    print(f"[moe_decode {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ExpertCounter:
    """Forward pre-hooks on every sparse layer that count the distinct experts of each decode step
    of ``batch`` rows (eager steps only: a replayed graph runs no hook)."""

    def __init__(self, model, batch: int):
        from spark.engine.kernels.moe_routing import route
        from spark.engine.models.moe import SparseMoe

        self.batch, self.counts = batch, []  # counts: distinct experts of one layer in one step
        self.handles = []
        for layer in model.layers:
            ffn = layer.feed_forward
            if isinstance(ffn, SparseMoe):
                def hook(module, args, route=route):
                    x = args[0]
                    if x.shape[0] == self.batch:
                        _, ids = route(module.gate(x), module.top_k, module.renormalize)
                        self.counts.append(ids.unique())
                self.handles.append(ffn.register_forward_pre_hook(hook))

        # A one-row step (batch 1 on the GPU) calls no SparseMoe.forward: its layers' sublayer is
        # moe_gemv.moe_one_row_triton (reached through the module at each call), counted here.
        from spark.engine.kernels import moe_gemv, small_linear

        self.one_row = one_row = moe_gemv.moe_one_row_triton

        def counted_one_row(h, norm_weight, eps, router, w13, w2, top_k, renormalize, *rest, **kw):
            if h.shape[0] == self.batch:
                logits = small_linear.small_linear_reference(h, router, norm_weight=norm_weight, eps=eps)
                self.counts.append(route(logits, top_k, renormalize)[1].unique())
            return one_row(h, norm_weight, eps, router, w13, w2, top_k, renormalize, *rest, **kw)

        moe_gemv.moe_one_row_triton = counted_one_row

    def mean(self) -> float:
        return sum(int(c.numel()) for c in self.counts) / max(1, len(self.counts))

    def remove(self) -> None:
        from spark.engine.kernels import moe_gemv

        for h in self.handles:
            h.remove()
        moe_gemv.moe_one_row_triton = self.one_row


def first_moe(model):
    from spark.engine.models.moe import SparseMoe

    return next(layer.feed_forward for layer in model.layers if isinstance(layer.feed_forward, SparseMoe))


def moe_path(model, batch: int) -> str:
    """The experts' path a decode step of ``batch`` rows runs: the torch reference (the CPU's ops),
    or the fused kernel's "gemv" or "grouped" (``fused_moe.moe_path``, a function of the shapes alone)."""
    from spark.engine.kernels import fused_moe
    from spark.engine.models import ops

    moe = first_moe(model)
    if moe.ops.moe is not ops.TritonOps.moe:
        return "reference"
    if batch == 1 and model.one_row:
        return "one-row"  # moe_gemv.moe_one_row_triton: the router, then the GEMVs routing from its logits
    return fused_moe.moe_path(batch, moe.top_k, moe.w13.shape[0])


def check_kernel(model, device, dtype) -> dict:
    """The fused kernel against the torch reference on one layer's real weights (decode and prefill
    sizes): max |diff| / max |ref| and the path taken, by tokens."""
    from spark.engine.kernels import fused_moe, moe_routing

    moe = first_moe(model)
    gen = torch.Generator(device=device).manual_seed(0)
    worst = {}
    for tokens in (1, 4, 64, 2000):
        x = torch.randn(tokens, moe.w13.shape[2], generator=gen, device=device).to(dtype)
        weights, ids = moe_routing.route(moe.gate(x), moe.top_k, moe.renormalize)
        got = fused_moe.fused_moe_triton(x, moe.w13, moe.w2, weights, ids).float()
        want = fused_moe.fused_moe_reference(x, moe.w13, moe.w2, weights, ids).float()
        worst[tokens] = {"rel_err": round(((got - want).abs().max() / want.abs().max()).item(), 5),
                         "path": fused_moe.moe_path(tokens, moe.top_k, moe.w13.shape[0])}
    return worst


def check_one_row(model, device, dtype, replays: int = 20) -> dict:
    """The one-row MoE sublayer (router, gate/up, down: PDL launches, the down's routing and weights
    loaded before its wait) replayed from a CUDA graph, where its launches overlap as in a decode
    step, against its torch reference on the first MoE layer's real weights, a new residual each replay:
    the worst max |diff| / max |ref|, and the smallest fraction of outputs bit-equal to it."""
    from spark.engine.kernels import moe_gemv

    moe = first_moe(model)
    block = next(layer for layer in model.layers if layer.feed_forward is moe)
    args = (block.ffn_norm.weight, block.ffn_norm.eps, moe.gate.weight, moe.w13, moe.w2, moe.top_k, moe.renormalize)
    gen = torch.Generator(device=device).manual_seed(1)
    h = torch.randn(1, moe.w13.shape[2], generator=gen, device=device).to(dtype)
    moe_gemv.moe_one_row_triton(h, *args)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gemv.moe_one_row_triton(h, *args)
    worst, least_exact = 0.0, 1.0
    for _ in range(replays):
        h.copy_(torch.randn(h.shape, generator=gen, device=device).to(dtype))
        graph.replay()
        want = moe_gemv.moe_one_row_reference(h, *args)
        worst = max(worst, ((out.float() - want.float()).abs().max() / want.float().abs().max()).item())
        # bit-equal outputs: the kernel rounds as the reference, only fp32 sums' order differs (the
        # interpreter's tests ask 0.98); a stale or raced routing would change most of them
        least_exact = min(least_exact, (out == want).float().mean().item())
    return {"replays": replays, "rel_err": round(worst, 5), "least_exact": round(least_exact, 4)}


def step_roofline(config, model, batch: int, experts_per_layer: float, context: float, dtype_bytes: int,
                  bandwidth: float = BANDWIDTH) -> dict:
    """Bytes and FLOPs a decode step of ``batch`` rows at mean ``context`` must move and do (over
    ``bandwidth`` bytes/s and MATMUL FLOP/s)."""
    from spark.engine.models.moe import SparseMoe

    c = config
    sparse = [layer.feed_forward for layer in model.layers if isinstance(layer.feed_forward, SparseMoe)]
    expert_params = 3 * c.moe_intermediate_size * c.hidden_size  # one expert's w13 and w2
    all_params = sum(p.numel() for p in model.parameters())
    stacked = sum(m.w13.numel() + m.w2.numel() for m in sparse)
    embedding = c.vocab_size * c.hidden_size
    # Outside the experts every weight is read once, but of the embedding only the rows looked up
    # (a tied head reads it whole, as the head).
    dense_params = all_params - stacked - (0 if c.tie_word_embeddings else embedding) + batch * c.hidden_size
    touched = len(sparse) * experts_per_layer * expert_params
    kv_tok = c.kv_bytes_per_token(dtype_bytes)
    step_bytes = (dense_params + touched) * dtype_bytes + batch * context * kv_tok + batch * kv_tok
    active = dense_params + len(sparse) * c.num_experts_per_tok * expert_params
    step_flops = 2 * active * batch + 4 * batch * context * c.num_heads * c.head_dim * c.num_layers
    step_s = max(step_bytes / bandwidth, step_flops / MATMUL)
    return {"step_bytes": int(step_bytes), "step_flops": int(step_flops), "roofline_step_ms": step_s * 1e3,
            "roofline_tok_s": batch / step_s, "experts_per_layer": experts_per_layer,
            "bound": "bytes" if step_bytes / bandwidth >= step_flops / MATMUL else "flops"}




def hf_config(config):
    """The transformers config of a Spark MoE config."""
    import transformers

    c = config
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                  num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                  rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
                  tie_word_embeddings=c.tie_word_embeddings, num_experts_per_tok=c.num_experts_per_tok,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if c.arch == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            **common, intermediate_size=c.intermediate_size, moe_intermediate_size=c.moe_intermediate_size,
            num_experts=c.num_experts, norm_topk_prob=c.norm_topk_prob, mlp_only_layers=list(c.dense_layers))
    if c.arch == "mixtral":
        return transformers.MixtralForCausalLM, transformers.MixtralConfig(
            **common, intermediate_size=c.moe_intermediate_size, num_local_experts=c.num_experts)
    raise ValueError(f"not an MoE architecture: {c.arch}")


def hf_decode(config, device, dtype, batch: int, prompt: int, new: int) -> float:
    """transformers ``generate`` tokens/s (its prefill included, dynamic cache), after a short warm-up."""
    cls, cfg = hf_config(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in dtype at once: in float32 a 30B model needs twice its bf16 bytes
    try:
        with torch.device(device):
            model = cls(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    ids = torch.randint(0, config.vocab_size, (batch, prompt), device=device)
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        sync(device)
    rate = batch * new / (time.perf_counter() - t0)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="a dummy MoE preset (qwen3-30b-a3b, mixtral-8x7b, tiny-*)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hf-new-b1", type=int, default=32, help="transformers' new tokens at batch 1 (it is slow there)")
    ap.add_argument("--quick", action="store_true", help="one rep, 16 new tokens")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.reps, args.new, args.hf_new_b1 = 1, 16, 8
    from spark.engine.engine import Engine

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.prompt + args.new + 16
    t0 = time.perf_counter()
    log(f"loading dummy:{args.preset} on {device} in {dtype} ...")
    engine = Engine.load(f"dummy:{args.preset}", device=device, dtype=dtype, progress=False, max_model_len=max_len,
                         kv_cache_tokens=max(batches) * (max_len + 16))
    config = engine.config
    if not config.num_experts:
        raise SystemExit(f"{args.preset} is not an MoE preset")
    doc = {"bench": "moe_decode", "preset": args.preset, "device": _device_name(device), "dtype": str(dtype),
           "date": datetime.date.today().isoformat(), "commit": git_commit(), "command": " ".join(["python"] + sys.argv),
           "prompt": args.prompt, "new": args.new, "bandwidth_assumed": BANDWIDTH, "matmul_assumed": MATMUL,
           "results": []}
    log(f"loaded in {time.perf_counter() - t0:.1f}s: {sum(p.numel() for p in engine.model.parameters()) / 1e9:.2f}B "
        f"parameters, {config.num_experts} experts, top-{config.num_experts_per_tok}")
    if device.type == "cuda":
        doc["copy_tb_s"] = round(copy_bandwidth() / 1e12, 3)
        log(f"device-to-device copy {doc['copy_tb_s']} TB/s (the roofline assumes {BANDWIDTH / 1e12})")

    if device.type == "cuda":
        doc["kernel_check"] = check_kernel(engine.model, device, dtype)
        log(f"fused MoE vs the torch reference, max |diff| / max |ref| and path by tokens: {doc['kernel_check']}")
        doc["one_row_graph_check"] = check_one_row(engine.model, device, dtype)
        log(f"one-row MoE sublayer, graph replays vs its reference: {doc['one_row_graph_check']}")
    # Warm-up, eager, with the router counted: how many distinct experts a decode step touches.
    experts = {}
    for batch in batches:
        counter = ExpertCounter(engine.model, batch)
        log(f"batch {batch}: eager warm-up, counting experts ...")
        rate, _ = decode_once(engine, batch, args.prompt, args.new, seed=1000 + batch)
        counter.remove()
        experts[batch] = counter.mean()
        log(f"batch {batch}: eager {rate:.1f} tok/s; {experts[batch]:.1f} distinct experts per layer and step "
            f"(of {config.num_experts}; {len(counter.counts)} layer-steps)")
    if device.type == "cuda" and not args.no_graphs:
        t1 = time.perf_counter()
        engine.enable_cuda_graphs(max(batches))
        engine.graphs.capture_all()
        log(f"CUDA graphs captured for batches up to {max(batches)} in {time.perf_counter() - t1:.1f}s")
    rows = []
    for batch in batches:
        runs = []
        for rep in range(args.reps + 1):  # the first is a warm-up (graphs replayed once, allocator settled)
            tok_s, step_ms = decode_once(engine, batch, args.prompt, args.new, seed=rep)
            if rep:
                runs.append((tok_s, step_ms))
        tok_s = statistics.median(r[0] for r in runs)
        roof = step_roofline(config, engine.model, batch, experts[batch], args.prompt + args.new / 2,
                             dtype.itemsize)
        row = {"batch": batch, "tok_s": round(tok_s, 1), "step_ms": round(statistics.median(r[1] for r in runs), 3),
               "tok_s_runs": [round(r[0], 1) for r in runs], "roofline_frac": round(tok_s / roof["roofline_tok_s"], 3),
               "moe_path": moe_path(engine.model, batch),
               # The same bytes over this card's own copy rate (an H100's is well below PERF.md's H200 figure).
               "roofline_frac_copy": (round(tok_s / step_roofline(
                   config, engine.model, batch, experts[batch], args.prompt + args.new / 2, dtype.itemsize,
                   doc["copy_tb_s"] * 1e12)["roofline_tok_s"], 3) if "copy_tb_s" in doc else None),
               **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in roof.items()}, "hf_tok_s": None}
        rows.append(row)
        doc["results"] = rows
        _write(args, doc)
        log(f"batch {batch}: spark {tok_s:.1f} tok/s (runs {row['tok_s_runs']}), step {row['step_ms']} ms, "
            f"roofline {roof['roofline_tok_s']:.1f} tok/s ({roof['bound']}), {row['roofline_frac']} of it; "
            f"experts by the {row['moe_path']} path")
    del engine, counter  # the counter's hooks hold the model too
    gc.collect()  # the engine's reference cycles hold its weights and KV cache until collected
    if device.type == "cuda":
        torch.cuda.empty_cache()
        log(f"GPU memory after freeing Spark's engine: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")
    if not args.no_hf:
        for row in rows:
            new = args.hf_new_b1 if row["batch"] == 1 else args.new
            log(f"transformers batch {row['batch']}: building the same config with random weights, {new} new tokens ...")
            row["hf_tok_s"] = round(hf_decode(config, device, dtype, row["batch"], args.prompt, new), 1)
            row["hf_new_tokens"] = new
            log(f"transformers batch {row['batch']}: {row['hf_tok_s']} tok/s")
            _write(args, doc)
    path = _write(args, doc)
    print(f"\n{args.preset} on {doc['device']} ({dtype}), {args.prompt}-token prompts, {args.new} new tokens; "
          f"roofline at {BANDWIDTH / 1e12} TB/s, {MATMUL / 1e12:.0f} TFLOP/s"
          + (f" (frac@copy: at this card's {doc['copy_tb_s']} TB/s copy)" if "copy_tb_s" in doc else ""))
    print(f"{'batch':>5} {'moe path':>9} {'spark tok/s':>11} {'step ms':>8} {'experts':>8} {'roof tok/s':>10} "
          f"{'frac':>6} {'frac@copy':>9} {'hf tok/s':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['moe_path']:>9} {r['tok_s']:>11} {r['step_ms']:>8} {r['experts_per_layer']:>8.1f} "
              f"{r['roofline_tok_s']:>10.1f} {r['roofline_frac']:>6} {str(r['roofline_frac_copy']):>9} "
              f"{str(r['hf_tok_s']):>9}")
    print(f"results: {path}")
    return 0


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _write(args, doc: dict) -> str:
    return write_results(doc, f"moe-decode-{args.preset}", args.out)


if __name__ == "__main__":
    sys.exit(main())
