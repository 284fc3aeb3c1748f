"""The decode attention kernel's sm_90 machine code, counted, on any machine (no GPU needed).

    python benchmarks/decode_sass.py [--cache bf16|fp8] [--block-n 64] [--v-late] [--sass FILE]

Compiles the rope + KV-write decode kernel (split, 8B shapes: head dim 128, group 4, page 16,
4 warps, 2 stages) with Triton's bundled ptxas for an H100, and prints its registers, shared memory
and the instructions of its key loop (the longest backward branch) by opcode: what one step of
BLOCK_N keys costs every thread. What issue 22's fp8 decode was bound by shows here: the bf16 loop
is 478 instructions a 64-key step; the fp8 one was 1008 on a cache of half the bytes (128 F2F
conversions to bf16, 64 byte-wide shared loads of V), 803 with fp16 dots, 452 with V converted early.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile


def compile_decode(cache: str, block_n: int, v_early: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from spark.engine.kernels import paged_attention as pa

    kernel, _ = pa._kernels()
    cache_ty = {"bf16": "bf16", "fp8": "fp8e4nv"}[cache]
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "positions_ptr": "*i64", "inv_freq_ptr": "*fp32",
                "slot_ptr": "*i64", "k_cache_ptr": f"*{cache_ty}", "v_cache_ptr": f"*{cache_ty}",
                "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "partial_max_ptr": "*fp32",
                "partial_sum_ptr": "*fp32", "partial_out_ptr": "*fp32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    unit_strides = {"stride_qd", "stride_kd", "stride_vd", "stride_cd", "stride_od", "stride_f"}  # launches specialize 1s
    odd_ints = {"group", "num_splits", "qk_scale_log2"}
    constants = dict(PAGE_SIZE=16, BLOCK_G=16, BLOCK_D=128, BLOCK_N=block_n, SPLIT=True, HALF_DOT=True,
                     PRECISION="tf32", ROPE=True, SCALED=cache == "fp8", FP8_V_EARLY=v_early, EARLY_LOADS=False,
                     NUM_STAGES=2, PDL=False, QK_NORM=False, EXIT_EMPTY=False)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants or name in unit_strides:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants.get(name, 1)
        elif name == "qk_scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = pointers.get(name, "i32")
            if name not in odd_ints:  # pointers 16-byte aligned, strides and sizes multiples of 16, as at 8B
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 2})


def key_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (a branch back to an earlier address)."""
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]+);", sass)]
    loops = [(int(m.group(1), 16), a) for a, op in code if (m := re.search(r"BRA\s+0x([0-9a-f]+)", op))
             and int(m.group(1), 16) < a]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return [op for a, op in code if start <= a <= end]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", choices=("bf16", "fp8"), default="fp8")
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--v-late", action="store_true", help="fp8: V converted in the dot's operand layout")
    ap.add_argument("--sass", default=None, help="write the disassembly here")
    args = ap.parse_args()
    import triton

    compiled = compile_decode(args.cache, args.block_n, not args.v_late)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([f"{tools}/cuobjdump", "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([f"{tools}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    if args.sass:
        with open(args.sass, "w") as out:
            out.write(sass)
    loop = key_loop(sass)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", op).split()[0] for op in loop)
    registers = re.search(r"REG:(\d+)", usage)
    print(f"{args.cache} block_n {args.block_n}{' v-late' if args.v_late else ''}: "
          f"{registers.group(1) if registers else '?'} registers, {compiled.metadata.shared} B shared, "
          f"key loop {len(loop)} instructions")
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(24)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
