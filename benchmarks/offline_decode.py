"""Offline decode speed against the memory-bandwidth roofline, beside HF transformers.

    python benchmarks/offline_decode.py [--quick] [--no-hf] [--hf-models P1,P2] [--out FILE]

Dummy (random, never zero) bf16 weights of real shapes; 128-token random
prompts, 128 new tokens, greedy, no EOS stop. Spark's decode rate is timed over
the decode steps only (prefill excluded), after a warm-up, median of 3 runs;
transformers' ``generate`` with a static cache runs in the same process on the
same GPU. The roofline of a step: bytes it must move (weights once + KV read +
KV written) over 4.25 TB/s, or FLOPs over 783 TFLOP/s, whichever is larger
(../shared/PERF.md); the run also times this machine's own copy rate (``copy_tb_s``),
since H200 machines differ. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

BANDWIDTH = 4.25e12  # bytes/s, measured device-to-device copy on one H200
MATMUL = 783e12  # bf16 FLOP/s, measured 8192^3 on one H200
PROMPT, NEW = 128, 128
CASES = [("llama-3.1-8b", (1, 8, 64, 256)), ("smollm2-135m", (1, 64))]


def roofline_tok_s(config, num_params: int, batch: int, dtype_bytes: int = 2) -> float:
    """Tokens/s a decode step of ``batch`` sequences could reach at best, averaged over the generation."""
    kv_tok = config.kv_bytes_per_token(dtype_bytes)
    avg_context = PROMPT + NEW / 2
    step_bytes = num_params * dtype_bytes + batch * avg_context * kv_tok + batch * kv_tok
    step_flops = 2 * num_params * batch + 4 * batch * avg_context * config.num_heads * config.head_dim * config.num_layers
    step_s = max(step_bytes / BANDWIDTH, step_flops / MATMUL)
    return batch / step_s


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """This GPU's device-to-device copy rate, bytes read + written per second (median of
    ``reps`` after a warm-up): H200 machines differ by several percent, and the roofline
    uses PERF.md's 4.25 TB/s for all of them, so a run records its own machine's figure."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()  # never zeros
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(seconds)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefilled(engine, alloc, batch: int, prompt: int, params, gen: torch.Generator, tag: tuple) -> list:
    """Add ``batch`` sequences of ``prompt`` random token ids (drawn from ``gen``) and prefill them, at most
    8192 prompt tokens a step, on pages of ``alloc``; returns their ids (``tag`` + index). The prefill's
    first tokens are sampled: what follows is decode."""
    from spark.core.plan import Chunk, StepPlan

    ids = [(*tag, i) for i in range(batch)]
    for sid in ids:
        engine.add_sequence(sid, torch.randint(0, engine.config.vocab_size, (prompt,), generator=gen).tolist(), params)
    per_step = max(1, 8192 // prompt)
    for start in range(0, batch, per_step):
        group = ids[start:start + per_step]
        engine.step(StepPlan(tuple(Chunk(s, prompt, alloc.allocate(s, prompt)) for s in group)))
    return ids


def decode_once(engine, batch: int, prompt: int, new: int, seed: int) -> tuple[float, float]:
    """(decode tokens/s, ms per step) of ``batch`` random prompts of ``prompt`` tokens decoding ``new`` tokens
    each, launched two steps deep as the server does; the prefill is not timed (CUDA events on a GPU)."""
    from spark.core.plan import Chunk, StepPlan
    from spark.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    alloc = engine.new_page_allocator()
    ids = prefilled(engine, alloc, batch, prompt, params, torch.Generator().manual_seed(seed), tag=("bench", seed))
    # step() already returned the prefill's first tokens: the rest are decode steps
    cuda = engine.device.type == "cuda"
    sync(engine.device)
    if cuda:
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_ev.record()
    t0 = time.perf_counter()
    tokens, launched, steps = 0, 0, 0
    live = list(ids)
    while launched or (live and steps < new - 1):
        # Step N+1 is launched before step N's tokens are read back, as the server does. Not past the
        # last token (the prefill gave the first): the engine would drop that step's rows, a launch
        # that computes nothing, and the ms per step would count it.
        if live and launched < 2 and steps < new - 1:
            chunks = tuple(Chunk(s, 1, alloc.append(s, engine.num_tokens(s))) for s in live)
            engine.launch(StepPlan(chunks))
            launched, steps = launched + 1, steps + 1
            if launched < 2:
                continue
        outs = engine.collect()
        launched -= 1
        tokens += len(outs)
        ended = {o.seq_id for o in outs if o.finish_reason is not None}
        live = [s for s in live if s not in ended]
    if cuda:
        end_ev.record()
        end_ev.synchronize()
        seconds = start_ev.elapsed_time(end_ev) / 1e3
    else:
        seconds = time.perf_counter() - t0
    return tokens / seconds, seconds / steps * 1e3


def spark_decode(engine, batch: int, reps: int) -> float:
    """Median decode tokens/s of ``batch`` sequences over NEW tokens (prefill not timed), after a warm-up run."""
    rates = [decode_once(engine, batch, PROMPT, NEW, seed=1000 * batch + rep)[0] for rep in range(reps + 1)]
    return statistics.median(rates[1:])


def hf_decode(preset_config, batch: int, new_tokens: int) -> float | None:
    """transformers generate, static cache, same shapes; tokens/s including its prefill."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    c = preset_config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=PROMPT + new_tokens + 8, tie_word_embeddings=c.tie_word_embeddings,
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
    ids = torch.randint(0, c.vocab_size, (batch, PROMPT), device="cuda")
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static")
    # Warm up with the very same call: transformers compiles the static-cache forward for
    # the cache's length, so a shorter warm-up would leave a recompile inside the timing.
    model.generate(ids, **kwargs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, **kwargs)
    torch.cuda.synchronize()
    rate = batch * new_tokens / (time.perf_counter() - t0)
    del model
    torch.cuda.empty_cache()
    return rate


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one rep, fewer batches")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-models", default=None, help="comma list of presets to run transformers on (default: all)")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="the commit measured (when the tree has no .git)")
    ap.add_argument("--only", default=None, metavar="PRESET:B1,B2",
                    help="one preset and its batches instead of every case, e.g. llama-3.1-8b:1,8 (for an A/B)")
    args = ap.parse_args()
    from spark import gc_tuning
    from spark.engine.engine import Engine

    results = []
    args.copy_tb_s = round(copy_bandwidth() / 1e12, 3)
    print(f"device-to-device copy: {args.copy_tb_s} TB/s (the roofline assumes {BANDWIDTH / 1e12})", file=sys.stderr)
    cases = CASES
    if args.only:
        preset, _, batches = args.only.partition(":")
        cases = [(preset, tuple(int(b) for b in batches.split(",")))]
    for preset, batches in cases:
        t0 = time.perf_counter()
        engine = Engine.load(f"dummy:{preset}", device="cuda", progress=False, max_model_len=PROMPT + NEW + 16,
                             kv_cache_bytes=max(batches) * (PROMPT + NEW + 32) * 2 * 2 * 32 * 1024 * 4)
        num_params = sum(p.numel() for p in engine.model.parameters())
        gc_tuning.settle()  # as spark serve's engine process does once loaded
        if not args.no_graphs:
            engine.enable_cuda_graphs(max(batches))
            engine.graphs.capture_all()
        print(f"{preset}: loaded and captured in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        for batch in batches:
            tok_s = spark_decode(engine, batch, 1 if args.quick else 3)
            roof = roofline_tok_s(engine.config, num_params, batch)
            results.append({"bench": "offline_decode", "model": preset, "batch": batch, "tok_s": round(tok_s, 1),
                            "roofline_tok_s": round(roof, 1), "roofline_frac": round(tok_s / roof, 3), "hf_tok_s": None})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
            _write(args, results)
        config = engine.config
        del engine
        torch.cuda.empty_cache()
        if not args.no_hf and (args.hf_models is None or preset in args.hf_models.split(",")):
            for r in results:
                if r["model"] == preset:
                    hf = hf_decode(config, r["batch"], 16 if preset == "llama-3.1-8b" and r["batch"] == 1 else NEW)
                    r["hf_tok_s"] = None if hf is None else round(hf, 1)
                    print(f"hf {preset} batch {r['batch']}: {r['hf_tok_s']}", file=sys.stderr, flush=True)
                    _write(args, results)  # partial results survive a run cut short

    _write(args, results)
    print(f"this GPU copies at {args.copy_tb_s} TB/s; the roofline assumes {BANDWIDTH / 1e12}")
    print(f"{'model':14} {'batch':>5} {'tok/s':>9} {'roofline':>9} {'frac':>6} {'hf tok/s':>9}")
    for r in results:
        print(f"{r['model']:14} {r['batch']:>5} {r['tok_s']:>9} {r['roofline_tok_s']:>9} {r['roofline_frac']:>6} {str(r['hf_tok_s']):>9}")
    return 0


def _write(args, results: list) -> None:
    doc = {
        "gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
        "commit": args.commit or git_commit(), "command": " ".join(["python"] + sys.argv),
        "copy_tb_s": args.copy_tb_s, "results": results,
    }
    out = args.out or f"benchmarks/results/{doc['date']}-{doc['gpu'].split()[-1].lower()}.json"
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


def write_results(doc: dict, name: str, out: str | None = None) -> str:
    """Write ``doc`` to ``out``, or to benchmarks/results/<date>-<name>-<gpu or cpu>.json; returns the path."""
    gpu = doc["device"].split()[-1].lower() if doc["device"] != "cpu" else "cpu"
    out = out or f"benchmarks/results/{doc['date']}-{name}-{gpu}.json"
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    return out


def git_commit() -> str:
    """The measured tree's commit, for a results file: the ``COMMIT`` file that a tree exported with
    ``git archive`` carries at its root (h200_session.sh's .clean trees, inside a checkout of another
    commit), else HEAD's hash ("unknown" outside a checkout)."""
    marker = Path(__file__).resolve().parents[1] / "COMMIT"
    if marker.is_file():
        return marker.read_text().strip()
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
