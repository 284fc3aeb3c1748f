"""How a decode attention launch walks its keys, chosen from shapes alone (so a CUDA graph can
hold it): the kernel's config (`decode_config`) and its split-KV partition count
(`choose_num_splits`). paged_attention.py launches by them; benchmarks patch them there.
"""

import functools

import attrs

# Keys per inner-loop step; pages are gathered token by token, so it need not match page_size.
_BLOCK_N = 64
# Split-KV heuristic: aim for this many programs in flight (about 2 per H200 SM), and
# give every partition at least one key block. At batch 1 on an H200, a 192-token
# context took 8.3 us unsplit and 5.6 us in 4 partitions (benchmarks/attention_bench.py).
_TARGET_PROGRAMS = 264
_MIN_KEYS_PER_SPLIT = _BLOCK_N
_MAX_SPLITS = 32
# Keys per step over an fp8 cache (decode_config); a module value for A/B runs
# (benchmarks/kv_dtype_decode.py --fp8-block-n), read when the first fp8 launch asks. Untimed yet:
# at 8B shapes (sm_90, benchmarks/decode_sass.py) 128 keys are 804 instructions and 194 registers
# (2 programs an SM), 64 keys 452 and 142 (3): fewer instructions a byte, fewer programs.
FP8_BLOCK_N = 128
# Keys per step of a one-row (batch 1) decode over a bf16 cache (decode_config); a module value for A/B runs
ONE_ROW_BLOCK_N = 128


@attrs.frozen
class DecodeConfig:
    """How the decode kernel walks keys.

    Attributes:
      block_n: keys per step of the online softmax.
      num_warps: warps per program.
      num_stages: software-pipelining depth of the key loop on a GPU: the page ids and
        K/V of the next steps are in flight while this one computes. A decode program
        walks a short context serially, so without it every step waits out a round trip
        to memory for its page ids and then one for its keys. 0 keeps a plain loop
        (the interpreter's only choice).
      exit_empty: the programs of split-KV partitions that hold no key return at once, before
        the wait on the kernel before (the reduce merges only the partitions holding keys either
        way). Under a server's 40960-key table a short context leaves 28 of 32 partitions
        empty: Qwen3-30B-A3B at batch 1 on an H100 (decode_ablation.py), one-row steps took
        340.5 tok/s with it against 328.5 without; 64-key pipelined steps lost by it, 331.8
        against 338.9 at batch 1 and 725.0 against 727.4 at batch 8 (the branch keeps the
        loads of the rest behind the lengths' round trip).
    """

    block_n: int = _BLOCK_N
    num_warps: int = 4
    num_stages: int = 2
    exit_empty: bool = False


@functools.cache  # asked at every launch; a frozen value, shared
def decode_config(head_dim: int, fp8_cache: bool = False, one_row: bool = False) -> DecodeConfig:
    """The fastest config of `benchmarks/attention_bench.py` on an H200 (bf16, page size
    16), batch 1 to 256: Llama-3.1-8B's 128-dim heads want 4 warps, SmolLM2's 64-dim 2.

    An fp8 cache's keys are half the bytes: `FP8_BLOCK_N` keys a step move the bytes of the
    bf16 config's 64, so that each step's fixed costs (the page ids, the softmax's reductions,
    the loop-carried wait) are paid per as many bytes, and as many bytes are in flight.

    One row (batch 1, rope fused, where `one_row_fits`) over a bf16 cache: `ONE_ROW_BLOCK_N` keys
    a step on 8 warps, one stage, in partitions of at least a step (`choose_num_splits`'
    `min_keys`). Its first block loads before the wait on the projection (EARLY_LOADS), so a
    wider one takes more of a short context off the critical path, in fewer partitions for the
    reduce to merge. Timed alone it is slower (7.9 us against 5.5 for Qwen3-30B-A3B over 256 keys,
    attention_bench.py --one-row): its gain is in the chain. Graphed batch-1 steps on an H100
    (decode_ablation.py, against 64-key steps on 4 warps, 2 stages, results
    2026-12-06-h100-landed-one-row-7f77d69.json): Qwen3-30B-A3B 344.6 tok/s against 343.2 under
    a 272-key block table, 340.0 against 335.5 under a server's 40960-key one; Llama-3.1-8B 184.8
    against 184.5 (272 keys, with empty partitions exiting under every config). 256 keys in one
    partition (no reduce launch) lost, 333.7."""
    if one_row and not fp8_cache:
        return DecodeConfig(block_n=ONE_ROW_BLOCK_N, num_warps=8, num_stages=1, exit_empty=True)
    return DecodeConfig(block_n=FP8_BLOCK_N if fp8_cache else _BLOCK_N, num_warps=4 if head_dim >= 128 else 2)


def one_row_fits(batch: int, num_kv_heads: int, head_dim: int, max_context: int) -> bool:
    """Whether a decode launch takes `decode_config`'s one-row steps: one sequence of 128-dim heads
    whose programs (kv heads x partitions of a one-row step) each have an SM to themselves (about
    half of `_TARGET_PROGRAMS`). Sharing SMs over a long context, 8 warps of unpipelined loads
    lose to 4 pipelined: Llama-3.1-8B (8 kv heads, 32 partitions of a 40960-key table) at batch 1
    on an H100 took 73.2 us over a 32768-key context against 60.2 (attention_bench.py --one-row);
    Qwen3-30B-A3B's 4 kv heads, 128 programs, 40.6 us against 41.3."""
    if batch != 1 or head_dim < 128:
        return False
    return num_kv_heads * choose_num_splits(1, num_kv_heads, max_context, ONE_ROW_BLOCK_N) <= _TARGET_PROGRAMS // 2


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, min_keys: int = _MIN_KEYS_PER_SPLIT) -> int:
    """Pick the split-KV partition count from shapes alone (graph-capturable).

    Args:
      batch: sequences in the batch.
      num_kv_heads: kv heads, i.e. programs per sequence without splitting.
      max_context: the most keys a sequence can hold (block-table width * page size).
      min_keys: the fewest keys a partition holds: the launch's keys per step (partitions are
        whole steps).

    Returns:
      1 when the batch alone fills the GPU or contexts are short, else enough
      partitions to reach about `_TARGET_PROGRAMS` programs, each of at least
      `min_keys` keys, at most `_MAX_SPLITS`.
    """
    programs = batch * num_kv_heads
    by_occupancy = -(-_TARGET_PROGRAMS // max(programs, 1))
    by_length = max_context // min_keys
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def reduce_num_warps(block_s: int, block_d: int) -> int:
    """Warps of a split-KV reduce program (one query head: ``block_s`` partitions of ``block_d`` dims).

    One warp up to 1024 values: the partitions sit in each thread's registers and the merge is
    reductions inside threads, where 4 warps spread them across warps and merged through shared
    memory, four barriers a program (sm_90 SASS), on the critical path between attention and wo.
    Wider merges (a 40960-key table's 32 partitions) keep more warps for their loads."""
    return max(1, min(4, block_s * block_d // 1024))

