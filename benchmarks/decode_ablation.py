"""In-chain cost of each piece of a graphed decode step, and A/Bs of kernel knobs, on a GPU.

    python benchmarks/decode_ablation.py [PRESET] [MAX_MODEL_LEN] [BATCH,BATCH..] [VARIANT,VARIANT...]
    e.g. python benchmarks/decode_ablation.py llama-3.1-8b 272 1,64 base,skip_wo,before_one_row_sweep,base2

Times the CUDA-graphed decode step (offline_decode's loop, median of 3) with one piece
skipped (its output left uninitialised: the tokens are wrong by design, the time is
that piece's cost inside the PDL chain) or one knob changed (early loads, early weight
tiles, a projection's launch config at the batch timed, alone or with others). Prints
us/layer saved against the base runs of the same batch; writes JSON to $OUT (or the
current directory).
"""
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_decode import spark_decode
from spark.engine.engine import Engine
from spark.engine.kernels import paged_attention as pa, small_linear as sl, launch, moe_gemv
import attrs
import spark.engine.models.llama as llama
from spark.engine import cuda_graphs

preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
mml = int(sys.argv[2]) if len(sys.argv) > 2 else 272
batches = [int(b) for b in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1]
only = sys.argv[4].split(",") if len(sys.argv) > 4 else None
engine = Engine.load(f"dummy:{preset}", device="cuda", progress=False, max_model_len=mml,
                     kv_cache_bytes=4 << 30)
real_sl = sl.small_linear_triton
real_kernels = pa._kernels
real_choose = pa.choose_num_splits
real_decode_config = pa.decode_config

class Noop:
    def __getitem__(self, grid):
        return lambda *a, **k: None

def skip_shape(shape):
    def f(x, weight, **kw):
        if tuple(weight.shape) == shape and x.shape[0] == batch:
            return x.new_empty(x.shape[0], weight.shape[0])
        return real_sl(x, weight, **kw)
    return f

c = engine.config
D, I = c.hidden_size, c.intermediate_size
qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
real_cfg = sl.default_config
real_early = sl.EARLY_TILE_MAX_BYTES
real_split = sl.split_config
def cfg_for(by_shape):
    """default_config with the launch configs of `by_shape` ({(n, k): Config}) at the batch timed."""
    def f(m, n, k, **kw):
        return by_shape[(n, k)] if (m == batch and (n, k) in by_shape) else real_cfg(m, n, k, **kw)
    return f
C = sl.Config
WQKV, WO, W13, W2 = (qkv, D), (D, c.num_heads * c.head_dim), (2 * I, D), (D, I)
def tag(cfg):
    """A launch shape's name in a variant: rows x columns, d(efer reduce), w(arps), s(tages), e(arly tile)."""
    t = f"{cfg.block_n}x{cfg.block_k}{'d' if cfg.defer_reduce and not cfg.use_dot else ''}w{cfg.num_warps}"
    return t + f"{'s%d' % cfg.num_stages if cfg.use_dot else ''}{'e' if cfg.early_tile else ''}"


def flat_rows(on):
    """default_config with every one-row launch's flat_row set to ``on`` (the router's too)."""
    def f(m, n, k, **kw):
        cfg = real_cfg(m, n, k, **kw)
        return attrs.evolve(cfg, flat_row=on) if m == 1 else cfg
    return {"cfg": f, "patch": {(moe_gemv, "ROUTER_CONFIG"): dict(moe_gemv.ROUTER_CONFIG, flat_row=on)}, "rows": "one"}


variants = {
    "base": {},
    # small_linear's flat one-row product (Config.flat_row): nowhere, and for every weight (small ones only: base)
    "flat_none": flat_rows(False),
    "flat_all": flat_rows(True),
    # the split-KV reduce on 4 warps whatever its size (before decode_plan.reduce_num_warps)
    "reduce_warps4": {"patch": {(pa, "reduce_num_warps"): lambda block_s, block_d: 4}},
    "no_early_loads": {"flags": {"keys": False}},
    "no_early_tile": {"early_max": 0},
    # One piece of the batch-1 step left out (the fused small-row path).
    # (the real kernels are bound first: the launcher reads triton's module from them)
    "skip_attention": {"kernels": lambda: (real_kernels(), (Noop(), Noop()))[1], "rows": "one"},
    # ... and at 2+ rows (decode attention's whole cost in the chain of a larger batch).
    "skip_attention_rows": {"kernels": lambda: (real_kernels(), (Noop(), Noop()))[1], "rows": "dot"},
    **{f"skip_{name}": {"sl": skip_shape(shape), "rows": "one"}
       for name, shape in (("wqkv", WQKV), ("wo", WO), ("w13", W13), ("w2", W2))},
}
if preset == "llama-3.1-8b":
    one = lambda bn, bk, **kw: C(bn, bk, **{"defer_reduce": False, **kw})  # noqa: E731 (the FMA path)
    dot = lambda bn, bk, **kw: C(bn, bk, use_dot=True, **kw)  # noqa: E731 (tensor cores, 33-64 rows)

    # (n, k) as default_config sees them: w13's gated output halves its n.
    for name, shapes, cfgs in [
        ("wqkv", [WQKV], [C(8, 512, num_warps=2, early_tile=True), one(8, 1024, num_warps=2), one(8, 2048, num_warps=2),
                          one(8, 4096), dot(64, 128, num_stages=4)]),
        ("w13", [W13, (I, D)], [one(8, 1024, num_warps=2), one(8, 2048), one(8, 2048, num_warps=2), one(16, 2048),
                                one(8, 4096), dot(64, 64, num_stages=6)]),
        ("w2", [W2], [one(8, 2048), one(8, 2048, num_warps=8), one(8, 2048, num_warps=2), one(16, 2048), C(8, 2048),
                      dot(64, 128, num_stages=4)]),
        ("wo", [WO], [one(8, 2048), one(8, 4096), one(4, 4096), dot(64, 128, num_stages=4)]),
    ]:
        for cfg in cfgs:
            variants[f"{name}:{tag(cfg)}"] = {"cfg": cfg_for({s: cfg for s in shapes}),
                                              "rows": "dot" if cfg.use_dot else "one"}
    # 33-64 rows: wo and w2 in 32-output tiles are 128 programs on an H200's 132 SMs, one
    # weight stream per SM; 16-output tiles make 256. (K steps of 512 at 64 rows overflow
    # shared memory: the activation tile is 64 KB a stage.)
    for name, shapes in (("wo", [WO]), ("w2", [W2]), ("w13", [(I, D)])):
        for cfg in (dot(16, 256, num_stages=4), dot(16, 128, num_stages=6), dot(16, 256, num_stages=3),
                    dot(32, 128, num_stages=6)):
            variants.setdefault(f"{name}:{tag(cfg)}", {"cfg": cfg_for({s: cfg for s in shapes}), "rows": "dot"})
    for cfg in (dot(16, 256, num_stages=4), dot(16, 128, num_stages=6)):
        variants[f"wo_w2:{tag(cfg)}"] = {"cfg": cfg_for({WO: cfg, W2: cfg}), "rows": "dot"}
    # 33-64 rows: wo and w2 with K split (fp32 partials summed by the next add-norm),
    # wide output tiles and enough programs.
    def split_for(shapes, cfg):
        return lambda m, n, k: cfg if m == batch and (n, k) in shapes else real_split(m, n, k)

    split_cfgs = {}
    for cfg in (dot(64, 128, num_stages=4, split_k=2), dot(64, 128, num_stages=4, split_k=4),
                dot(128, 128, num_stages=4, split_k=4), dot(128, 128, num_stages=4, num_warps=8, split_k=4),
                dot(64, 256, num_stages=3, split_k=2), dot(32, 256, num_stages=4, split_k=2),
                dot(64, 256, num_stages=3, split_k=4), dot(128, 256, num_stages=2, split_k=2),
                dot(128, 256, num_stages=2, split_k=4), dot(64, 256, num_stages=3, num_warps=8, split_k=2)):
        t = f"{tag(cfg)}k{cfg.split_k}"
        split_cfgs[t] = cfg
        for name, shapes in (("wo_w2", [WO, W2]), ("wo", [WO]), ("w2", [W2])):
            variants[f"split_{name}:{t}"] = {"patch": {(sl, "split_config"): split_for(shapes, cfg)}, "rows": "dot"}
    variants["no_split"] = {"patch": {(sl, "split_config"): lambda m, n, k: None}, "rows": "dot"}

    def split_mix(by_shape):
        return lambda m, n, k: by_shape.get((n, k)) if m == batch else real_split(m, n, k)

    # wo and w2 each in its own split shape.
    for wo_tag, w2_tag in (("64x256w4s3k2", "128x128w4s4k4"), ("64x256w4s3k2", "64x256w4s3k4"),
                           ("64x128w4s4k2", "128x128w4s4k4")):
        variants[f"split_mix:{wo_tag}+{w2_tag}"] = {
            "patch": {(sl, "split_config"): split_mix({WO: split_cfgs[wo_tag], W2: split_cfgs[w2_tag]})}, "rows": "dot"}
    # The one-row launch shapes before the sweep of 2026-12-01 (an A/B of that change).
    variants["before_one_row_sweep"] = {"cfg": cfg_for({
        WQKV: C(8, 512, num_warps=2), WO: C(8, 512), W13: one(8, 1024), W2: one(4, 2048)}), "rows": "one"}

    def triton_wqkv(cfg):
        """Attention.forward with wqkv in the small-row kernel at the batch timed (cuBLAS's at 33-64 rows)."""
        def forward(self, x, rope, k_cache, v_cache, meta):
            qkv = sl.small_linear_triton(x, self.wqkv.weight, config=cfg) if x.shape[0] == batch else self.wqkv(x)
            return self.ops.project(self.attend(qkv, rope, k_cache, v_cache, meta), self.wo)
        return forward

    for cfg in (dot(64, 128, num_stages=4), dot(32, 256, num_stages=4), dot(64, 64, num_stages=6)):
        variants[f"triton_wqkv:{tag(cfg)}"] = {"patch": {(llama.Attention, "forward"): triton_wqkv(cfg)}, "rows": "dot"}

if preset == "qwen3-30b-a3b":  # issue 23's batch 1: the one-row MoE block's launch shapes in the chain

    one = lambda bn, bk, **kw: C(bn, bk, **{"defer_reduce": False, **kw})  # noqa: E731 (the FMA path)
    for name, shape, cfgs in [
        ("wqkv", WQKV, [one(4, 2048, num_warps=2), one(8, 2048, num_warps=2), one(4, 1024, num_warps=2),
                        one(2, 2048, num_warps=2), one(8, 1024, num_warps=2, early_tile=True),
                        one(4, 2048, num_warps=4), one(2, 1024, num_warps=2), one(2, 1024, num_warps=1),
                        one(4, 1024, num_warps=1), one(2, 2048, num_warps=1), one(8, 1024, num_warps=1),
                        one(4, 2048, num_warps=1), one(4, 1024, num_warps=1, early_tile=True)]),
        ("wo", WO, [one(4, 2048), one(4, 4096), one(2, 4096), one(4, 2048, num_warps=2), one(2, 2048, num_warps=2),
                    one(8, 2048, early_tile=True), one(4, 2048, early_tile=True), one(8, 1024, num_warps=2),
                    one(2, 2048, num_warps=2, early_tile=True), one(2, 4096, num_warps=2),
                    one(1, 4096, num_warps=2), one(2, 2048, num_warps=1), one(4, 4096, num_warps=2),
                    one(2, 4096, num_warps=1), one(4, 4096, num_warps=1), one(2, 4096, num_warps=2, early_tile=True)]),
    ]:
        for cfg in cfgs:
            variants[f"{name}:{tag(cfg)}"] = {"cfg": cfg_for({shape: cfg}), "rows": "one", "knob": (name, {shape: cfg})}
    real_gemv = moe_gemv.gemv_config

    def gemv(**parts):
        """gemv_config with some launch arguments of its parts (gate_up, down) replaced."""
        def f(hidden, inter, num_tokens=1):
            cfg = real_gemv(hidden, inter, num_tokens)
            return {part: {**shape, **parts.get(part, {})} for part, shape in cfg.items()}
        return f

    for bn, bk, w in ((2, 2048, 2), (8, 2048, 2), (4, 2048, 4), (4, 1024, 2), (2, 2048, 1), (8, 2048, 4),
                      (2, 1024, 1), (1, 2048, 1), (4, 2048, 1), (1, 1024, 1), (8, 2048, 1), (16, 2048, 1)):
        variants[f"gate_up:{bn}x{bk}w{w}"] = {
            "patch": {(moe_gemv, "gemv_config"): gemv(gate_up=dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w))},
            "rows": "one", "knob": ("gate_up", dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w))}
    for stages in (1, 2, 4):
        variants[f"gate_up:2x2048w1s{stages}"] = {"patch": {(moe_gemv, "gemv_config"): gemv(
            gate_up=dict(BLOCK_N=2, BLOCK_K=2048, num_warps=1, num_stages=stages))}, "rows": "one"}
    for bn, w in ((2, 4), (8, 4), (4, 2), (4, 8), (2, 2), (8, 8), (16, 8), (2, 8), (1, 4), (1, 2), (2, 1), (4, 1),
                  (8, 1), (1, 8), (1, 1), (4, 4)):
        variants[f"down:{bn}x1024w{w}"] = {
            "patch": {(moe_gemv, "gemv_config"): gemv(down=dict(BLOCK_N=bn, num_warps=w))}, "rows": "one",
            "knob": ("down", dict(BLOCK_N=bn, num_warps=w))}

    # Pieces of the MoE sublayer left out (upper bounds on what a faster piece can save): the router's
    # launch (its logits a fixed random buffer, so the routing still picks 8 distinct experts), the
    # routing inside gate/up (fixed ids and weights), the experts' two launches, and the whole sublayer.
    real_one_row = moe_gemv.moe_one_row_triton
    gen = torch.Generator().manual_seed(0)  # made before any capture: one token's logits, 8 distinct ids
    fixed = (torch.randn(1, c.num_experts, generator=gen).to("cuda", torch.bfloat16),
             torch.randperm(c.num_experts, generator=gen)[:c.num_experts_per_tok].to("cuda", torch.int32),
             torch.full((c.num_experts_per_tok,), 1.0 / c.num_experts_per_tok, device="cuda"))

    def moe_skipping(part):
        def f(h, norm_weight, eps, router, w13, w2, top_k, renormalize, config=None):
            if h.shape[0] != 1:
                return real_one_row(h, norm_weight, eps, router, w13, w2, top_k, renormalize, config)
            if part == "router_route_experts":
                return h.clone()
            if part == "experts":  # the router's launch alone
                sl.small_linear_triton(h, router, norm_weight=norm_weight, eps=eps,
                                       config=moe_gemv.router_config(*router.shape))
                return h.clone()
            logits, ids, weights = fixed
            common = dict(norm_weight=norm_weight, eps=eps, residual=h, config=config)
            if part == "router":  # no router launch: gate/up routes from the fixed logits
                return moe_gemv._launch_gemvs(h, w13, w2, top_k, torch.empty_like(ids), torch.empty_like(weights),
                                              logits=logits, renormalize=renormalize, **common)
            return moe_gemv._launch_gemvs(h, w13, w2, top_k, ids, weights, **common)  # router_route: fixed ids
        return f

    for part in ("router", "router_route", "experts", "router_route_experts"):
        variants[f"skip_{part}"] = {"patch": {(moe_gemv, "moe_one_row_triton"): moe_skipping(part)}, "rows": "one"}
    real_moe_kernels = moe_gemv._kernels
    # down's launch alone left out (gate/up still writes the ids and weights it would read)
    variants["skip_down"] = {"patch": {(moe_gemv, "_kernels"): lambda: (real_moe_kernels()[0], Noop())}, "rows": "one"}

    def combo(wqkv, wo, gate_up, down):
        return {"cfg": cfg_for({WQKV: wqkv, WO: wo}),
                "patch": {(moe_gemv, "gemv_config"): gemv(gate_up=gate_up, down=down)},
                "rows": "one"}

    # The shapes before 2026-12-05's fifth session (an A/B of its defaults: wqkv 4x1024w1, wo 2x4096w2,
    # gate_up 4x2048w1, down 1x1024w4), and combinations tried on the way.
    variants["before_small_weights"] = combo(one(8, 1024, num_warps=2), one(8, 2048),
                                             dict(BLOCK_N=4, BLOCK_K=2048, num_warps=2),
                                             dict(BLOCK_N=4, num_warps=4))
    variants["combo_a"] = combo(one(4, 1024, num_warps=2), one(2, 2048, num_warps=2),
                                dict(BLOCK_N=2, BLOCK_K=2048, num_warps=1), dict(BLOCK_N=2, num_warps=4))
    variants["combo_b"] = combo(one(2, 2048, num_warps=2), one(4, 2048, early_tile=True),
                                dict(BLOCK_N=2, BLOCK_K=2048, num_warps=1), dict(BLOCK_N=4, num_warps=8))
    variants["combo_c"] = combo(one(8, 1024, num_warps=2), one(8, 2048),
                                dict(BLOCK_N=2, BLOCK_K=2048, num_warps=1), dict(BLOCK_N=2, num_warps=4))
    for bn, w, early in ((1, 2, True), (4, 2, True), (2, 4, True), (2, 2, False), (8, 4, True), (2, 2, True)):
        variants[f"router:{bn}w{w}{'e' if early else ''}"] = {
            "patch": {(moe_gemv, "ROUTER_CONFIG"): dict(moe_gemv.ROUTER_CONFIG, block_n=bn, num_warps=w,
                                                         early_tile=early)},
            "rows": "one", "knob": ("router", dict(moe_gemv.ROUTER_CONFIG, block_n=bn, num_warps=w, early_tile=early))}

    def best_of_sweep():
        """The fastest of each knob swept so far (wqkv's, wo's, gate/up's, down's and the router's
        shapes) that saved at least 0.3 us a layer against the base runs, all together: one device
        call both sweeps and checks that the winners add up (the machine goes back seconds after a call)."""
        base = statistics.mean([r["step_us"] for r in out if r["variant"].startswith("base") and r["batch"] == batch])
        winners = {}
        for r in out:
            v = variants[r["variant"]]
            knob = v.get("knob") if isinstance(v, dict) else None  # (best itself is a function)
            if r["batch"] == batch and knob and (base - r["step_us"]) / c.num_layers >= 0.3:
                if knob[0] not in winners or r["step_us"] < winners[knob[0]][0]:
                    winners[knob[0]] = (r["step_us"], r["variant"], knob[1])
        print("best of sweep:", {k: w[1] for k, w in winners.items()}, flush=True)
        shapes = {s: cfg for k in ("wqkv", "wo") if k in winners for s, cfg in winners[k][2].items()}
        parts = {k: winners[k][2] for k in ("gate_up", "down") if k in winners}
        patch = {(moe_gemv, "gemv_config"): gemv(**parts)}
        if "router" in winners:
            patch[(moe_gemv, "ROUTER_CONFIG")] = winners["router"][2]
        return {"cfg": cfg_for(shapes), "patch": patch, "rows": "one", "winners": sorted(w[1] for w in winners.values())}
# Decode attention's launch config (all batches; 33-64 rows where the key loop is the longest).
# One stage (no software pipelining): less shared memory a program, so more of a 64-row
# batch's 512 programs fit on the SMs at once, trading each program's overlap of its own
# key blocks for more programs in flight. On an H200 every one was slower at 64 rows
# (-2.6 to -7.5 us a layer): with 105 registers and 39 KB the default already fits all.
for bn, w, st in ((32, 4, 3), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2),
                  (64, 4, 1), (32, 4, 1), (128, 4, 1), (64, 2, 1), (128, 8, 1)):
    variants[f"attn:{bn}w{w}s{st}"] = {
        "patch": {(pa, "decode_config"): lambda head_dim, fp8_cache=False, one_row=False, c=pa.DecodeConfig(bn, w, st): c}, "rows": "dot"}


def gate_in_w2(self, h, rope, k_cache, v_cache, meta):
    """The one-row block (``TritonOps.block_one_row``) as before 2026-12-01's second session: the gate in w2's prologue."""
    attention, ffn = self.attention, self.feed_forward
    qkv = sl.small_linear_triton(h, attention.wqkv.weight, norm_weight=self.attention_norm.weight, eps=self.attention_norm.eps)
    h = sl.small_linear_triton(attention.attend(qkv, rope, k_cache, v_cache, meta), attention.wo.weight, residual=h)
    gate_up = sl.small_linear_triton(h, ffn.w13.weight, norm_weight=self.ffn_norm.weight, eps=self.ffn_norm.eps)
    return sl.small_linear_triton(gate_up, ffn.w2.weight, gated=True, residual=h)


# On the model's ops object (an instance attribute: a plain function, called as block_one_row(block, h, ...)).
variants["gate_in_w2"] = {"patch": {(engine.model.ops, "block_one_row"): gate_in_w2}, "rows": "one"}
# The one-row shapes of w13 with the gate in its epilogue, and of w2 without a prologue.
_one = lambda bn, bk, **kw: C(bn, bk, **{"defer_reduce": False, **kw})  # noqa: E731
for name, shape, cfgs in [
    ("w13g", (I, D), [_one(8, 2048, num_warps=2), _one(4, 2048, num_warps=2), _one(8, 1024, num_warps=2),
                      _one(4, 2048), _one(16, 2048), _one(4, 1024), _one(8, 1024)]),
    ("w2p", (D, I), [_one(4, 2048), _one(8, 2048, num_warps=8), _one(8, 2048), _one(16, 2048), _one(4, 4096),
                     _one(4, 2048, num_warps=2), _one(4, 1024), _one(8, 2048, num_warps=2)]),
]:
    for cfg in cfgs:
        variants[f"{name}:{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}"] = {"cfg": cfg_for({shape: cfg}), "rows": "one"}
# ... and at batch 1 (a short context in a few partitions: each program walks one or two key blocks).
for bn, w, st in ((32, 4, 2), (32, 2, 2), (64, 2, 2), (64, 8, 2), (16, 4, 2), (32, 4, 1), (64, 4, 2), (128, 8, 1)):
    variants[f"attn1:{bn}w{w}s{st}"] = {
        "patch": {(pa, "decode_config"): lambda head_dim, fp8_cache=False, one_row=False, c=pa.DecodeConfig(bn, w, st): c}, "rows": "one"}
# The one-row config (128-key steps, one stage, empty partitions exiting) on 4 warps instead of 8: fewer
# warps for its head norms' and softmax's reductions to cross (8 barriers before its key loop, not 10).
variants["attn1:128w4s1e"] = {
    "patch": {(pa, "decode_config"): lambda head_dim, fp8_cache=False, one_row=False, c=pa.DecodeConfig(128, 4, 1, True):
              c if one_row else real_decode_config(head_dim, fp8_cache, one_row)}, "rows": "one"}
# Split-KV partitions of batch-1 decode attention (the heuristic picks 4 at a 272-token
# context; 1 drops the reduce kernel, one launch a layer).
for n in (1, 2, 8):
    variants[f"splits:{n}"] = {"choose": lambda b, h, ctx, n=n: n if b == 1 else real_choose(b, h, ctx), "rows": "one"}
# Fewer partitions of wider key blocks: at a 129-256-token context one 256-key block is the whole
# context, loaded before the wait (EARLY_LOADS), and with one partition no reduce launch follows.
for bn, w, st, n in ((256, 8, 1, 1), (256, 16, 1, 1), (128, 8, 1, 1), (128, 4, 2, 1), (128, 8, 1, 2), (128, 4, 1, 2)):
    variants[f"attn1:{bn}w{w}s{st}+splits:{n}"] = {
        "patch": {(pa, "decode_config"): lambda head_dim, fp8_cache=False, one_row=False, c=pa.DecodeConfig(bn, w, st): c},
        "choose": lambda b, h, ctx, n=n: n if b == 1 else real_choose(b, h, ctx), "rows": "one"}
# ... and at 33-64 rows, where one program per (sequence, kv head) walks every key serially.
for n in (2, 3, 4):
    variants[f"splits_rows:{n}"] = {"choose": lambda b, h, ctx, n=n: n if b > 16 else real_choose(b, h, ctx), "rows": "dot"}
# The vocabulary head at one row: small_linear's kernel in place of cuBLAS, in launch shapes of a wide
# weight (rows x columns, warps); "head_norm:" also takes the final norm into its prologue (one launch less).
real_logits = llama.LlamaModel.compute_logits
real_norm_forward = llama.RMSNorm.forward


def head_logits(cfg, norm):
    def compute_logits(self, hidden):
        if hidden.shape[0] != 1 or self.output is None:
            return real_logits(self, hidden)
        extra = dict(norm_weight=self.norm.weight, eps=self.norm.eps) if norm else {}
        return sl.small_linear_triton(hidden, self.output.weight, config=cfg, **extra).float()
    return compute_logits


def final_norm_in_head(self, x):
    return x if x.shape[0] == 1 and self is engine.model.norm else real_norm_forward(self, x)


def no_logits(self, hidden):
    """The head left out at one row: logits uninitialised (the tokens wrong by design)."""
    if hidden.shape[0] != 1 or self.output is None:
        return real_logits(self, hidden)
    return hidden.new_empty(1, self.output.weight.shape[0], dtype=torch.float32)


variants["skip_head"] = {"patch": {(llama.LlamaModel, "compute_logits"): no_logits}, "rows": "one"}
# Every block left out (its input passed on): what a step costs outside its layers (the embedding, the
# final norm, the head, the argmax and the graph's own launches), with and without the head.
variants["skip_layers"] = {"patch": {(engine.model.ops, "block_one_row"): lambda block, h, *rest: h}, "rows": "one"}
variants["skip_layers_head"] = {"patch": {(engine.model.ops, "block_one_row"): lambda block, h, *rest: h,
                                          (llama.LlamaModel, "compute_logits"): no_logits}, "rows": "one"}
for bn, bk, w in ((4, 2048, 4), (8, 2048, 4), (4, 2048, 2), (8, 2048, 8), (16, 2048, 4), (8, 1024, 2)):
    cfg = C(bn, bk, defer_reduce=False, num_warps=w)
    variants[f"head:{bn}x{bk}w{w}"] = {"patch": {(llama.LlamaModel, "compute_logits"): head_logits(cfg, False)},
                                        "rows": "one"}
    variants[f"head_norm:{bn}x{bk}w{w}"] = {"patch": {(llama.LlamaModel, "compute_logits"): head_logits(cfg, True),
                                                      (llama.RMSNorm, "forward"): final_norm_in_head},
                                             "rows": "one"}

# PDL's trigger ahead of the wait (the kernel after may launch, and load what is no kernel's output,
# while this one still waits): the router's and the split-KV reduce's (the defaults), each off, and
# wqkv's and wo's on; wo's weight loaded before its wait.
def evolved(by_shape):
    """default_config with fields of the launches of `by_shape` ({(n, k): {field: value}}) at the batch timed."""
    def f(m, n, k, **kw):
        cfg = real_cfg(m, n, k, **kw)
        return attrs.evolve(cfg, **by_shape[(n, k)]) if m == batch and (n, k) in by_shape else cfg
    return f


def triggers(first=(), last=(), wo_early=False):
    shapes = {shape: {"trigger_first": True} for name, shape in (("wqkv", WQKV), ("wo", WO)) if name in first}
    if wo_early:
        shapes.setdefault(WO, {})["early_tile"] = True
    patch = {}
    if "reduce" in first + last:
        patch[(pa, "REDUCE_TRIGGER_FIRST")] = "reduce" in first
    if "router" in first + last:
        patch[(moe_gemv, "ROUTER_CONFIG")] = dict(moe_gemv.ROUTER_CONFIG, trigger_first="router" in first)
    return {"cfg": evolved(shapes), "patch": patch, "rows": "one"}


variants["last:router"] = triggers(last=("router",))
variants["last:reduce"] = triggers(last=("reduce",))
variants["last:router+reduce"] = triggers(last=("router", "reduce"))
variants["first:wqkv"] = triggers(first=("wqkv",))
variants["first:wo"] = triggers(first=("wo",))
variants["wo_early"] = triggers(wo_early=True)
# (An L2 prefetch of each program's weight rows before its wait, prefetch.global.L2 line by line, was
# neutral for wo and cost 2.6 us a layer for wqkv on an H100: results 2026-12-06-h100-moe-sweep-all-2e7ede0.json.)
# (Kernels waiting on a count of the producer's programs in memory, a load-acquire spin, instead of on PDL's
# wait for the kernel before, were slower at every edge tried, on an H100 at batch 1: the router's programs
# ahead of gate/up's in one launch -6.8 us a layer, the down kernel on gate/up's count -4.5, wo on the split-KV
# reduce's -0.8, all three -11.3, with a 100-500 ns nanosleep between reads barely better; the waiting
# programs, resident by the thousand, take the SMs' issue slots and L2 from the ones they wait on. Removed:
# results 2026-12-07-h100-count-edges-7019197.json.)


def chunked_argmax(x, into):
    """The graphs' greedy argmax before kernels/argmax.py: the first maximum of 64 equal slices, then
    of the slices' maxima (four torch launches), and the ring's ``index_copy_``."""
    B, V = x.shape
    chunks = next(c for c in range(64, 0, -1) if V % c == 0)
    if chunks == 1 or B > 16:
        tokens = x.argmax(dim=-1)
    else:
        best, index = x.reshape(B, chunks, V // chunks).max(dim=-1)
        chunk = best.argmax(dim=-1, keepdim=True)
        tokens = (index.gather(1, chunk) + chunk * (V // chunks)).squeeze(1)
    return into[0].view(-1).index_copy_(0, into[1], tokens)


variants["chunked_argmax"] = {"patch": {(cuda_graphs, "greedy_tokens"): chunked_argmax}}
if preset == "qwen3-30b-a3b":
    variants["best"] = best_of_sweep  # last but base2: after every knob it picks from
variants["base2"] = {}
if only:
    variants = {k: v for k, v in variants.items() if k in only}
out = []
for batch in batches:
    for name, v in variants.items():
        if callable(v):  # made from the runs before it (best_of_sweep)
            v = v()
        if v.get("rows") == ("dot" if batch == 1 else "one"):
            continue  # a launch config for the other row count
        pa._kernels = v.get("kernels", real_kernels)
        pa.choose_num_splits = v.get("choose", real_choose)
        sl.small_linear_triton = v.get("sl", real_sl)
        sl.default_config = v.get("cfg", real_cfg)
        sl.EARLY_TILE_MAX_BYTES = v.get("early_max", real_early)
        flags = v.get("flags", {})
        pa.EARLY_LOADS = flags.get("keys", True)
        os.environ["SPARK_PDL"] = v.get("pdl", "1"); launch._pdl_device.cache_clear()
        saved = {key: getattr(*key) for key in v.get("patch", {})}
        for (owner, attr), value in v.get("patch", {}).items():
            setattr(owner, attr, value)
        try:  # a variant that fails to compile or run is reported, and the others still run
            engine.enable_cuda_graphs(max(batches)); engine.graphs.capture_all()
            rate = spark_decode(engine, batch, 3)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"variant": name, "batch": batch, "error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
            continue
        finally:
            for (owner, attr), value in saved.items():
                setattr(owner, attr, value)
        out.append({"variant": name, "batch": batch, "tok_s": round(rate, 1), "step_us": round(1e6 * batch / rate, 1),
                    **({"winners": v["winners"]} if "winners" in v else {})})
        print(json.dumps(out[-1]), flush=True)
for batch in batches:
    base = statistics.mean([r["step_us"] for r in out if r["variant"].startswith("base") and r["batch"] == batch])
    for r in out:
        if r["batch"] == batch:
            r["delta_us_per_layer"] = round((base - r["step_us"]) / c.num_layers, 2)
            print(f"b{batch:<3} {r['variant']:22} {r['tok_s']:9} tok/s  step {r['step_us']:8} us  saves {r['delta_us_per_layer']:6} us/layer")
batches_tag = "-".join(map(str, batches))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"ablate-{preset}-{mml}-b{batches_tag}.json"), "w"), indent=1)
