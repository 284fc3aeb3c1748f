"""decode_plan: the decode kernel's config and split-KV partition count, from shapes alone."""

from spark.engine.kernels import decode_plan
from spark.engine.kernels.decode_plan import DecodeConfig, choose_num_splits, decode_config, one_row_fits


def test_choose_num_splits():
    # A batch that alone fills the GPU, or a context of one key block: no split.
    assert choose_num_splits(batch=256, num_kv_heads=8, max_context=32768) == 1
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=64) == 1
    # Batch 1 splits even a short context: a few programs would each walk it serially.
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=256) == 4
    # One long sequence: split, capped.
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=4096) == 32
    assert choose_num_splits(batch=1, num_kv_heads=1, max_context=1 << 20) == 32
    # Never more partitions than a minimum-size partition allows.
    assert choose_num_splits(batch=2, num_kv_heads=2, max_context=1024) == 16
    # ... of the launch's own key step: one row's 128 keys
    assert choose_num_splits(batch=1, num_kv_heads=4, max_context=272, min_keys=128) == 2
    assert choose_num_splits(batch=1, num_kv_heads=4, max_context=40960, min_keys=128) == 32


def test_decode_config_follows_head_dim():
    assert decode_config(128) == DecodeConfig(block_n=64, num_warps=4, num_stages=2)
    assert decode_config(64).num_warps == 2


def test_decode_config_of_one_row_takes_wider_steps():
    """Batch 1 (rope fused) over a bf16 cache: 128 keys a step on 8 warps, unpipelined, empty partitions
    returning at once; an fp8 cache
    keeps its own config."""
    assert decode_config(128, one_row=True) == DecodeConfig(block_n=128, num_warps=8, num_stages=1, exit_empty=True)
    assert decode_config(128, True, one_row=True) == decode_config(128, True)


def test_one_row_steps_only_where_each_program_has_an_sm():
    assert one_row_fits(1, 4, 128, 40960)  # Qwen3-30B-A3B: 4 kv heads x 32 partitions
    assert not one_row_fits(1, 8, 128, 40960)  # Llama-3.1-8B: 8 x 32 share SMs
    assert one_row_fits(1, 8, 128, 272)  # ... in 2 partitions, not
    assert not one_row_fits(2, 4, 128, 272) and not one_row_fits(1, 3, 64, 272)  # one row of 128-dim heads only


def test_decode_config_of_an_fp8_cache_steps_over_as_many_bytes():
    """fp8 keys are half of bf16's bytes: twice the keys a step, the rest as the bf16 config."""
    for head_dim in (64, 128):
        fp8, bf16 = decode_config(head_dim, True), decode_config(head_dim)
        assert fp8.block_n == decode_plan.FP8_BLOCK_N == 2 * bf16.block_n
        assert (fp8.num_warps, fp8.num_stages) == (bf16.num_warps, bf16.num_stages)
