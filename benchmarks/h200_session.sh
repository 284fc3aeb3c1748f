#!/bin/bash
# One device call's worth of H200 measurements, the steps named in order, each under its own time limit:
#
#   bash benchmarks/h200_session.sh serving-cold spec-verify spec-check      (device tool, carry .whl)
#
# Spark's own dependencies travel as wheels in .whl/ (the machine has torch, triton, transformers, httpx;
# fill it with `pip download --no-deps --only-binary :all: --python-version 3.12 --platform
# manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl PKG` for Spark's dependencies, and for
# xgrammar's: apache-tvm-ffi, pydantic, pydantic-core, annotated-types, typing-inspection). The
# grammar steps want the default model's tokenizer, whose wheel is over the carry limit: export it
# beside the tree first (smol_tok/: `Tokenizer.from_gguf(default_model_path()).backend.save(
# "smol_tok/tokenizer.json")` and a tokenizer_config.json naming eos_token "<|im_end|>");
# each step writes its JSON and its log under $OUT and prints the log's last lines, so one step that
# fails or runs out of time leaves the others' results.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
echo "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"  # .clean trees carry COMMIT
cd benchmarks
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc in $((SECONDS - t0)) s"
    grep -v -i "warning\|^\s*$" "$OUT/$name.log" | tail -n 14
}
poisson() {  # poisson NAME SECONDS [FLAGS...]: issue 24's load (dummy 8B, 256 streams); later flags win
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" python poisson_serving.py --model dummy:llama-3.1-8b --requests 1000 --rate 32 \
        --concurrency-cap 256 --max-batch-size 256 --max-prefill-tokens 8192 --new 128 --out "$OUT/$name.json" "$@"
}
for name in "$@"; do
    case $name in
        serving-cold) step "$name" 360 python serving.py --cold --out "$OUT/serving-cold.json" ;;
        startup) step "$name" 120 python startup.py --runs 1 --out "$OUT/startup.json" ;;
        spec-verify) step "$name" 240 python spec_verify.py --ks 1,2,3,4,6,8 --compare-eager --out "$OUT/spec-verify.json" ;;
        spec-check) step "$name" 90 python ../scripts/gpu_spec_check.py --model dummy:llama-3.1-8b \
            --out "$OUT/spec-check.json" ;;
        poisson) poisson "$name" 560 ;;
        poisson-tbt) poisson "$name" 420 --spark-args="--tbt-deadline-ms 40" ;;
        poisson-tbt-short) poisson "$name" 200 --requests 500 --warmup 16 --spark-args="--tbt-deadline-ms 40" ;;
        poisson-bound) poisson "$name" 300 --policies slai --spark-args="--ttft-bound 2" ;;
        # chat-like prompt lengths (log-normal, median 256, 128..4096), arrivals above what the server drains
        poisson-chat) poisson "$name" 300 --prompt-dist lognormal --rate 48 --spark-args="--tbt-deadline-ms 45" ;;
        poisson-chat-slai55) poisson "$name" 170 --prompt-dist lognormal --rate 48 --policies slai \
            --spark-args="--tbt-deadline-ms 55" ;;
        poisson-chat30) poisson "$name" 240 --prompt-dist lognormal --rate 48 --spark-args="--tbt-deadline-ms 30" ;;
        poisson-chat-slai40) poisson "$name" 130 --prompt-dist lognormal --rate 48 --policies slai \
            --spark-args="--tbt-deadline-ms 40" ;;
        poisson-chat-slow) export SPARK_SLOW_TURN_MS=35  # SLAI 40 ms, each core-loop turn over 35 ms logged
            poisson "$name" 130 --prompt-dist lognormal --rate 48 --policies slai --spark-args="--tbt-deadline-ms 40"
            unset SPARK_SLOW_TURN_MS
            grep -c "slow turn" "$OUT/$name.log" ;;
        poisson-chat50) export SPARK_SLOW_TURN_MS=60  # FIFO and SLAI 50 ms; turns over 60 ms and late compiles logged
            poisson "$name" 300 --prompt-dist lognormal --rate 48 --spark-args="--tbt-deadline-ms 50"
            unset SPARK_SLOW_TURN_MS
            grep -c "slow turn" "$OUT/$name.log"; grep "Triton compiles" "$OUT/$name.log" | cut -c1-1500 ;;
        poisson-chat40) export SPARK_SLOW_TURN_MS=100  # FIFO and SLAI 40 ms; turns over 100 ms and late compiles logged
            poisson "$name" 300 --prompt-dist lognormal --rate 48 --spark-args="--tbt-deadline-ms 40"
            unset SPARK_SLOW_TURN_MS
            grep -c "slow turn" "$OUT/$name.log"; grep "Triton compiles" "$OUT/$name.log" | cut -c1-300 ;;
        # ~256 streams at a rate the GPU can prefill: 512 new tokens each, Poisson 20/s, SLAI held to ~2x a decode step
        poisson-long) export SPARK_SLOW_TURN_MS=100
            poisson "$name" 330 --prompt-dist lognormal --rate 20 --requests 800 --new 512 \
                --spark-args="--tbt-deadline-ms 25" --step-trace "$OUT"  # every step logged: <policy>-steps.jsonl
            unset SPARK_SLOW_TURN_MS
            grep -c "slow turn" "$OUT/$name.log"; grep "Triton compiles" "$OUT/$name.log" | cut -c1-300 ;;
        # issue 24's load at 22/s and 26/s: past this H100's capacity (both policies' clients wait for a slot;
        # the results files named *-factor18 ran them with a decode-relative SLAI target, since reverted)
        poisson-256) poisson "$name" 360 --prompt-dist lognormal --rate 26 --requests 1000 --new 512 \
                --spark-args="--tbt-deadline-ms 25" --step-trace "$OUT" ;;
        poisson-22) export SPARK_SLOW_TURN_MS=30
            poisson "$name" 360 --prompt-dist lognormal --rate 22 --requests 1000 --new 512 \
                --spark-args="--tbt-deadline-ms 25" --step-trace "$OUT"
            unset SPARK_SLOW_TURN_MS
            grep -c "slow turn" "$OUT/$name.log"; grep "slow turn" "$OUT/$name.log" | head -n 12 | cut -c1-400 ;;
        # issue 23's batch 1 in the chain: each launch shape of the one-row MoE block against the base
        moe-ablate) step "$name" 420 python decode_ablation.py qwen3-30b-a3b 272 1 \
            base,skip_attention,skip_wqkv,skip_wo,no_early_tile,no_early_loads,splits:1,splits:2,wqkv:4x2048w2,wqkv:8x2048w2,wqkv:4x1024w2,wqkv:2x2048w2,wqkv:8x1024w2e,wqkv:4x2048w4,wo:4x2048w4,wo:4x4096w4,wo:2x4096w4,wo:4x2048w2,wo:2x2048w2,wo:8x2048w4e,wo:4x2048w4e,wo:8x1024w2,gate_up:2x2048w2,gate_up:8x2048w2,gate_up:4x2048w4,gate_up:4x1024w2,gate_up:2x2048w1,gate_up:8x2048w4,gate_up:2x1024w1,down:2x1024w4,down:8x1024w4,down:4x1024w2,down:4x1024w8,down:2x1024w2,down:8x1024w8,down:16x1024w8,router:1w2e,router:4w2e,router:2w4e,router:2w2,router:8w4e,base2 ;;
        moe-ablate2) step "$name" 300 python decode_ablation.py qwen3-30b-a3b 272 1 \
            base,gate_up:2x2048w1,gate_up:1x2048w1,gate_up:4x2048w1,gate_up:1x1024w1,gate_up:2x2048w1s1,gate_up:2x2048w1s2,gate_up:2x2048w1s4,down:2x1024w4,down:2x1024w8,down:1x1024w4,down:1x1024w2,down:2x1024w1,wqkv:4x1024w2,wqkv:2x1024w2,wqkv:2x1024w1,wqkv:4x1024w1,wqkv:2x2048w1,wo:2x2048w2,wo:2x2048w2e,wo:2x4096w2,wo:1x4096w2,wo:2x2048w1,combo_a,combo_b,combo_c,base2 ;;
        moe-ablate4) step "$name" 120 python decode_ablation.py qwen3-30b-a3b 272 1 base,gate_up:2x2048w1,down:2x1024w1,base2 ;;
        # batch-1 decode attention's launch configs inside the MoE step, and wider key blocks in fewer partitions
        moe-attn1) step "$name" 240 python decode_ablation.py qwen3-30b-a3b 272 1 \
            base,attn1:256w8s1+splits:1,attn1:256w16s1+splits:1,attn1:128w8s1+splits:1,attn1:128w4s2+splits:1,attn1:128w8s1+splits:2,attn1:128w4s1+splits:2,attn1:32w4s2,attn1:32w2s2,attn1:64w2s2,attn1:64w8s2,attn1:32w4s1,base2 ;;
        # batch-1 decode attention alone as the engine launches it (8B and Qwen3-MoE heads, 256 to 32k keys),
        # and 8B's batch-1 decode
        attn-one-row) step "$name" 120 python attention_bench.py --one-row --out "$OUT/attn-one-row.json" ;;
        b1-8b) step "$name" 150 python offline_decode.py --only llama-3.1-8b:1 --no-hf --out "$OUT/b1-8b.json" ;;
        # batch 1 in the chain under a 40960-key block table (a server's max length: 32 partitions), the
        # one-row 128-key steps against the 64-key ones before them
        b1-wide-table) step "$name-8b" 120 python decode_ablation.py llama-3.1-8b 40960 1 base,attn1:64w4s2,attn1:128w8s1,base2
            step "$name-moe" 120 python decode_ablation.py qwen3-30b-a3b 40960 1 base,attn1:64w4s2,attn1:128w8s1,base2 ;;
        # batch 1 in the chain, 8B and Qwen3-MoE, under the benchmarks' 272-key table and a server's 40960-key one
        b1-wide-pair) for preset in qwen3-30b-a3b llama-3.1-8b; do
                step "$name-$preset" 60 python decode_ablation.py $preset 40960 1 base,attn1:64w4s2
            done ;;
        b1-tables|b1-tables-wide) for mml in $([ $name = b1-tables ] && echo 272) 40960; do
                for preset in qwen3-30b-a3b llama-3.1-8b; do
                    step "$name-$preset-$mml" 100 python decode_ablation.py $preset $mml 1 base,attn1:64w4s2,attn1:128w8s1,base2
                done
            done ;;
        # 8 and 64 rows in the chain under both tables (decode attention's split path past the one-row launch)
        rows-tables) for mml in 272 40960; do
                for preset in qwen3-30b-a3b llama-3.1-8b; do
                    step "$name-$preset-$mml" 100 python decode_ablation.py $preset $mml 8,64 base,base2
                done
            done ;;
        # Qwen3-MoE's batch 1 under both tables (the base twice), and the in-chain cost of each piece of its
        # one-row layer: the router's launch, the routing in gate/up, the experts, attention, wqkv, wo
        moe-tables) for mml in 272 40960; do
                step "$name-$mml" 60 python decode_ablation.py qwen3-30b-a3b $mml 1 base,base2
            done ;;
        b1-8b-272) step "$name" 60 python decode_ablation.py llama-3.1-8b 272 1 base,base2 ;;
        # the one-row MoE layer's launch shapes next to its defaults (wqkv 4x1024w1, wo 2x4096w2, router 2w2e,
        # gate/up 4x2048w1, down 1x1024w4), after the routing became one int32 max a round
        moe-sweep) step "$name" 200 python decode_ablation.py qwen3-30b-a3b 272 1 \
            base,wqkv:2x1024w1,wqkv:4x2048w1,wqkv:8x1024w1,wqkv:4x1024w1e,wo:1x4096w2,wo:2x4096w1,wo:4x4096w2,wo:2x4096w2e,gate_up:2x2048w1,gate_up:8x2048w1,gate_up:2x1024w1,down:1x1024w2,down:1x1024w8,down:2x1024w4,down:2x1024w2,router:1w2e,router:4w2e,router:2w4e,base2 ;;
        moe-parts) step "$name" 150 python decode_ablation.py qwen3-30b-a3b 272 1 \
            base,skip_router,skip_router_route,skip_experts,skip_router_route_experts,skip_down,skip_attention,skip_wqkv,skip_wo,base2 ;;
        # the vocabulary head at batch 1 in small_linear's kernel (alone, and with the final norm in its prologue)
        head) for preset in qwen3-30b-a3b llama-3.1-8b; do
                step "$name-$preset" 150 python decode_ablation.py $preset 272 1 base,head:4x2048w4,head:8x2048w4,head:4x2048w2,head:8x2048w8,head:16x2048w4,head:8x1024w2,head_norm:4x2048w4,head_norm:8x2048w4,head_norm:4x2048w2,head_norm:8x2048w8,base2
            done ;;
        # small_linear's flat one-row product (Config.flat_row): small weights only (base), nowhere, everywhere
        flat-rows) for preset in smollm2-135m qwen3-30b-a3b llama-3.1-8b; do
                step "$name-$preset" 90 python decode_ablation.py $preset 272 1 base,flat_none,flat_all,base2
            done
            step "$name-moe-40960" 60 python decode_ablation.py qwen3-30b-a3b 40960 1 base,flat_none,base2 ;;
        # the split-KV reduce on one warp (base) against four, and the one-row attention on 4 or 2 warps against 8
        reduce-warps) for preset in qwen3-30b-a3b llama-3.1-8b; do
                step "$name-$preset" 90 python decode_ablation.py $preset 272 1 base,reduce_warps4,attn1:128w4s1e,base2
            done
            step "$name-moe-40960" 60 python decode_ablation.py qwen3-30b-a3b 40960 1 base,reduce_warps4,attn1:128w4s1e,base2
            step "$name-rows" 90 python decode_ablation.py qwen3-30b-a3b 40960 8,64 base,reduce_warps4,base2 ;;
        # the one-token down kernel's launch shapes next to its default, on its pipelined picks
        down-shapes) step "$name" 90 python decode_ablation.py qwen3-30b-a3b 272 1 \
                base,down:1x1024w1,down:2x1024w4,down:2x1024w8,down:4x1024w4,down:4x1024w8,base2 ;;
        rows-moe-wide) step "$name" 60 python decode_ablation.py qwen3-30b-a3b 40960 8 base,base2 ;;
        # PDL's trigger ahead of the wait (the router's and the reduce's, on by default), the greedy argmax
        # before kernels/argmax.py, and the kernel chain's end-to-end costs (profile_decode --graphs)
        pdl-first) step "$name-moe" 150 python decode_ablation.py qwen3-30b-a3b 272 1 \
                base,last:router,last:reduce,last:router+reduce,chunked_argmax,first:wqkv,first:wo,wo_early,base2
            step "$name-8b" 120 python decode_ablation.py llama-3.1-8b 272 1 base,chunked_argmax,last:reduce,base2 ;;
        chain) step "$name" 120 python profile_decode.py --model dummy:qwen3-30b-a3b --batch 1 --context 192 --graphs \
                --out "$OUT/chain.json" ;;
        # the H200's own sweep of the one-row MoE block's knobs at the tree measured (its balance of latency
        # against bandwidth differs from the H100's, where most defaults were chosen)
        h200-knobs) step "$name" 240 python decode_ablation.py qwen3-30b-a3b 272 1 \
            base,first:wo,first:wqkv,wqkv:4x1024w1e,wo:2x4096w2e,router:2w2e,gate_up:8x2048w1,gate_up:2x2048w1,down:1x1024w2,last:router,last:reduce,base2 ;;
        # what the MoE batch-1 step costs outside its blocks, and each piece of a block in the chain
        moe-outside) step "$name" 200 python decode_ablation.py qwen3-30b-a3b 272 1 \
            base,skip_head,skip_layers,skip_layers_head,skip_attention,skip_wqkv,skip_wo,skip_router,skip_experts,skip_down,skip_router_route_experts,base2 ;;
        # every one-row knob of the MoE step's batch 1 (about 2 s each after the load), the best of each together
        moe-sweep-all) step "$name" 585 python decode_ablation.py qwen3-30b-a3b 272 1 \
            base,flat_none,flat_all,no_early_loads,no_early_tile,skip_attention,skip_wqkv,skip_wo,wqkv:4x2048w2,\
wqkv:8x2048w2,wqkv:4x1024w2,wqkv:2x2048w2,wqkv:8x1024w2e,wqkv:4x2048w4,wqkv:2x1024w2,wqkv:2x1024w1,\
wqkv:4x1024w1,wqkv:2x2048w1,wqkv:8x1024w1,wqkv:4x2048w1,wqkv:4x1024w1e,wo:4x2048w4,wo:4x4096w4,\
wo:2x4096w4,wo:4x2048w2,wo:2x2048w2,wo:8x2048w4e,wo:4x2048w4e,wo:8x1024w2,wo:2x2048w2e,wo:2x4096w2,\
wo:1x4096w2,wo:2x2048w1,wo:4x4096w2,wo:2x4096w1,wo:4x4096w1,wo:2x4096w2e,gate_up:2x2048w2,\
gate_up:8x2048w2,gate_up:4x2048w4,gate_up:4x1024w2,gate_up:2x2048w1,gate_up:8x2048w4,\
gate_up:2x1024w1,gate_up:1x2048w1,gate_up:4x2048w1,gate_up:1x1024w1,gate_up:8x2048w1,\
gate_up:16x2048w1,gate_up:2x2048w1s1,gate_up:2x2048w1s2,gate_up:2x2048w1s4,down:2x1024w4,\
down:8x1024w4,down:4x1024w2,down:4x1024w8,down:2x1024w2,down:8x1024w8,down:16x1024w8,down:2x1024w8,\
down:1x1024w4,down:1x1024w2,down:2x1024w1,down:4x1024w1,down:8x1024w1,down:1x1024w8,down:1x1024w1,\
down:4x1024w4,skip_router,skip_router_route,skip_experts,skip_router_route_experts,skip_down,\
router:1w2e,router:4w2e,router:2w4e,router:2w2,router:8w4e,router:2w2e,attn1:32w4s2,attn1:32w2s2,\
attn1:64w2s2,attn1:64w8s2,attn1:16w4s2,attn1:32w4s1,attn1:64w4s2,attn1:128w8s1,attn1:128w4s1e,\
splits:1,splits:2,splits:8,attn1:256w8s1+splits:1,attn1:256w16s1+splits:1,attn1:128w8s1+splits:1,\
attn1:128w4s2+splits:1,attn1:128w8s1+splits:2,attn1:128w4s1+splits:2,skip_head,skip_layers,\
skip_layers_head,head:4x2048w4,head_norm:4x2048w4,head:8x2048w4,head_norm:8x2048w4,head:4x2048w2,\
head_norm:4x2048w2,head:8x2048w8,head_norm:8x2048w8,head:16x2048w4,head_norm:16x2048w4,head:8x1024w2,\
head_norm:8x1024w2,last:router,first:wqkv,first:wo,wo_early,chunked_argmax,best,base2 ;;
        # the H200's in-chain parts of the one-row block (as moe-parts) and a sweep of its other launch shapes
        # (down's was swept there on 2026-12-06), in one process: more rows or warps a program hold more bytes
        # in flight, which the H200's bus wants at the same latency; about a minute after the load on an H100 (2026-12-06)
        h200-shapes) step "$name" 585 python decode_ablation.py qwen3-30b-a3b 272 1 \
            base,skip_wqkv,skip_wo,skip_attention,skip_experts,wqkv:4x2048w2,wqkv:8x2048w2,wqkv:4x2048w4,wqkv:2x2048w1,wo:4x4096w2,wo:2x4096w1,wo:4x4096w1,wo:1x4096w2,gate_up:2x2048w1,gate_up:8x2048w1,gate_up:8x2048w2,gate_up:4x2048w4,router:2w2e,router:1w2e,best,base2 ;;
        # a graphed decode's greedy tokens (ring, unpacking, embedding under PDL) against the eager engine's,
        # and against another tree's (GRAPH_TOKENS_AGAINST: its graph-tokens.json)
        graph-tokens) step "$name" 240 python ../scripts/gpu_graph_tokens_check.py --out "$OUT/graph-tokens.json" \
                ${GRAPH_TOKENS_AGAINST:+--against "$GRAPH_TOKENS_AGAINST"} ;;
        moe-b1) step "$name" 240 python moe_decode.py --batches 1 --no-hf --out "$OUT/moe-b1.json" ;;
        moe-ablate3) step "$name" 300 python decode_ablation.py qwen3-30b-a3b 272 1 \
            base,before_small_weights,wqkv:8x1024w1,wqkv:4x2048w1,wo:4x4096w2,wo:2x4096w1,wo:4x4096w1,gate_up:8x2048w1,gate_up:16x2048w1,gate_up:2x2048w1,down:4x1024w1,down:8x1024w1,down:1x1024w1,down:1x1024w4,base2 ;;
        # issue 24's acceptance load at the rate this H100 sustains (20/s: FIFO's clients never wait for a slot)
        poisson-20) poisson "$name" 330 --prompt-dist lognormal --rate 20 --requests 800 --new 512 \
                --spark-args="--tbt-deadline-ms 23" --step-trace "$OUT" ;;
        piecewise-check) step "$name" 120 python piecewise_check.py --model dummy:llama-3.1-8b --max-tokens 1024 ;;
        kv-dtype) step "$name" 300 python kv_dtype_decode.py --out "$OUT/kv-dtype.json" ;;
        # issue 22's decode attention alone (8B, 32 x 4k and 1 x 32k): bf16 vs fp8 cache, and fp8 configs swept
        kv-attn) step "$name" 240 python attention_bench.py --kv-dtypes --out "$OUT/kv-attn.json" ;;
        kv-dtype-bn64) step "$name" 300 python kv_dtype_decode.py --fp8-block-n 64 --out "$OUT/kv-dtype-bn64.json" ;;
        moe) step "$name" 420 python moe_decode.py --out "$OUT/moe.json" ;;
        moe-short) step "$name" 300 python moe_decode.py --out "$OUT/moe.json" ;;
        # batch 1: the one-row MoE block against the generic path (both with q/k norms in the decode launch)
        moe-b1-ab) step "$name" 400 bash -c 'python moe_decode.py --batches 1 --no-hf --out "$OUT/moe-b1.json" &&
            SPARK_MOE_ONE_ROW=0 python moe_decode.py --batches 1 --no-hf --out "$OUT/moe-b1-generic.json"' ;;
        moe-gemv) step "$name" 150 python moe_gemv_bench.py --out "$OUT/moe-gemv.json" ;;
        moe-gemv-sweep) step "$name" 240 python moe_gemv_bench.py --sweep --out "$OUT/moe-gemv-sweep.json" ;;
        step-cost) step "$name" 120 python step_cost.py --out "$OUT/step-cost.json" ;;
        step-cost-short) step "$name" 90 python step_cost.py --rows 64,256 --prefill 0,128,512,2048 --steps 8 \
            --out "$OUT/step-cost.json" ;;
        profile-moe) step "$name" 150 python profile_decode.py --model dummy:qwen3-30b-a3b --batch 1 --context 128 \
            --top 30 --out "$OUT/profile-moe.json" ;;
        profile-fp8) step "$name" 90 python profile_decode.py --batch 32 --context 4096 --top 12 \
                --out "$OUT/profile-kv-auto.json"
            step "$name-fp8" 90 python profile_decode.py --batch 32 --context 4096 --top 12 --kv-dtype fp8 \
                --out "$OUT/profile-kv-fp8.json" ;;
        # the same, as a server decodes: replays of the captured decode graphs (one-row blocks)
        profile-moe-graphs) SPARK_PIECEWISE_GRAPHS=0 step "$name" 200 python profile_decode.py \
            --model dummy:qwen3-30b-a3b --batch 1 --context 128 --graphs --top 30 --out "$OUT/profile-moe-graphs.json" ;;
        profile-moe-graphs-nopdl) SPARK_PDL=0 SPARK_PIECEWISE_GRAPHS=0 step "$name" 200 python profile_decode.py \
            --model dummy:qwen3-30b-a3b --batch 1 --context 128 --graphs --top 30 --out "$OUT/$name.json" ;;
        profile-host) step "$name" 120 python profile_host.py --rows 32 --prefill 0,128 ;;
        # issue 21: constrained vs free decode (dummy 8B, 64 rows of forced calls and JSON), with a third
        # kind of run, the grammars as xgrammar writes them (bounded repeats unchained), alternated in one process
        grammar-chains) step "$name" 300 python ../scripts/gpu_grammar_check.py --repeats 3 --compare-chains \
            $([ -d ../smol_tok ] && echo --tokenizer ../smol_tok) \
            --out "$OUT/grammar-chains.json" ;;
        *) echo "unknown step $name" ;;
    esac
done
