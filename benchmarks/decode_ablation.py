"""In-chain cost of each piece of a graphed decode step, and A/Bs of kernel knobs, on a GPU.

    python benchmarks/decode_ablation.py [PRESET] [MAX_MODEL_LEN] [BATCH] [VARIANT,VARIANT...]
    e.g. python benchmarks/decode_ablation.py llama-3.1-8b 272 1 base,skip_wo,no_early_loads,base2

Times the CUDA-graphed decode step (offline_decode's loop, median of 3) with one piece
skipped (its output left uninitialised: the tokens are wrong by design, the time is
that piece's cost inside the PDL chain) or one knob changed (early loads, early weight
tiles, a projection's launch config). Prints us/layer saved against the base runs;
writes JSON to $OUT (or the current directory).
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_decode import spark_decode
from spark.engine.engine import Engine
from spark.engine.kernels import paged_attention as pa, small_linear as sl, launch
import spark.engine.models.llama as llama

preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
mml = int(sys.argv[2]) if len(sys.argv) > 2 else 272
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
only = sys.argv[4].split(",") if len(sys.argv) > 4 else None
engine = Engine.load(f"dummy:{preset}", device="cuda", progress=False, max_model_len=mml,
                     kv_cache_bytes=4 << 30)
real_sl = sl.small_linear_triton
real_kernels = pa._kernels
real_choose = pa.choose_num_splits
real_attn = llama.paged_decode_attention_rope

class Noop:
    def __getitem__(self, grid):
        return lambda *a, **k: None

def skip_shape(shape):
    def f(x, weight, **kw):
        if tuple(weight.shape) == shape and x.shape[0] == 1:
            return x.new_empty(x.shape[0], weight.shape[0])
        return real_sl(x, weight, **kw)
    return f

c = engine.config
D, I = c.hidden_size, c.intermediate_size
qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
real_cfg = sl.default_config
real_early = sl.EARLY_TILE_MAX_BYTES
def cfg_for(shape, cfg):
    def f(m, n, k, **kw):
        return cfg if (m == 1 and (n, k) == shape) else real_cfg(m, n, k, **kw)
    return f
C = sl.Config
WQKV, WO, W13, W2 = (qkv, D), (D, c.num_heads * c.head_dim), (2 * I, D), (D, I)
variants = {
    "base": {},
    "no_early_loads": {"flags": {"keys": False}},
    "no_early_tile": {"early_max": 0},
}
if preset == "llama-3.1-8b":
    for name, shape, cfgs in [
        ("wqkv", WQKV, [C(8, 512, num_warps=2), C(8, 1024, defer_reduce=False, num_warps=2), C(4, 1024, num_warps=2)]),
        ("w13", W13, [C(8, 1024, defer_reduce=False, num_warps=2)]),
        ("w2", W2, [C(4, 2048, defer_reduce=False, num_warps=2)]),
        ("wo", WO, [C(4, 1024, num_warps=2)]),
    ]:
        for cfg in cfgs:
            variants[f"{name}:{cfg.block_n}x{cfg.block_k}{'d' if cfg.defer_reduce else ''}w{cfg.num_warps}"] = {"cfg": cfg_for(shape, cfg)}
variants["base2"] = {}
if only:
    variants = {k: v for k, v in variants.items() if k in only}
out = []
for name, v in variants.items():
    llama.paged_decode_attention_rope = v.get("attn", real_attn)
    pa._kernels = v.get("kernels", real_kernels)
    pa.choose_num_splits = v.get("choose", real_choose)
    sl.small_linear_triton = v.get("sl", real_sl)
    sl.default_config = v.get("cfg", real_cfg)
    sl.EARLY_TILE_MAX_BYTES = v.get("early_max", real_early)
    flags = v.get("flags", {})
    pa.EARLY_LOADS = flags.get("keys", True)
    os.environ["SPARK_PDL"] = v.get("pdl", "1"); launch._pdl_device.cache_clear()
    engine.enable_cuda_graphs(batch); engine.graphs.capture_all()
    rate = spark_decode(engine, batch, 3)
    out.append({"variant": name, "tok_s": round(rate, 1), "step_us": round(1e6 * batch / rate, 1)})
    print(json.dumps(out[-1]), flush=True)
base = statistics.mean([r["step_us"] for r in out if r["variant"].startswith("base")])
for r in out:
    r["delta_us_per_layer"] = round((base - r["step_us"]) / c.num_layers, 2)
    print(f"{r['variant']:12} {r['tok_s']:8} tok/s  step {r['step_us']:8} us  saves {r['delta_us_per_layer']:6} us/layer")
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"ablate-{preset}-{mml}-b{batch}.json"), "w"), indent=1)
