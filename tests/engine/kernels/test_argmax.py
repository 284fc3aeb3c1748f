import pytest
import torch

from spark.engine.kernels import argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 100, argmax.BLOCK, 3 * argmax.BLOCK + 17])
def test_argmax_matches_torch(dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(3, width, generator=gen).to(dtype)
    assert torch.equal(argmax.argmax_triton(x), argmax.argmax_reference(x))


def test_argmax_takes_the_first_maximum_and_nan_as_torch_does():
    width = 2 * argmax.BLOCK + 5
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (7, width), generator=gen).float()  # ties within and across the blocks
    x[1, argmax.BLOCK + 3] = float("nan")  # NaN is the maximum
    x[1, 2 * argmax.BLOCK + 1] = float("nan")  # ... the first of them
    x[2] = 1.0  # one value everywhere: index 0
    x[3] = float("-inf")  # every score -inf: index 0 (the padding's -inf never wins)
    x[4, :] = -0.0
    x[4, 9] = 0.0  # -0.0 and +0.0 are equal: the first, index 0
    x[5, :] = -1.0
    x[5, width - 1] = float("inf")  # the last column of a partial block
    x[6, :] = -3.0
    x[6, argmax.BLOCK] = -2.5  # a negative maximum at a block's first column
    got = argmax.argmax_triton(x)
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))
    assert got.tolist()[1:] == [argmax.BLOCK + 3, 0, 0, 0, width - 1, argmax.BLOCK]


def test_argmax_of_strided_rows_and_no_rows():
    x = torch.randn(4, 2 * 3000).view(4, 2, 3000)[:, 1]  # rows 6000 apart
    assert torch.equal(argmax.argmax_triton(x), x.argmax(dim=-1))
    assert argmax.argmax_triton(torch.empty(0, 10)).shape == (0,)


def test_argmax_writes_each_row_where_its_index_says():
    # The CUDA graphs' ring: row r's token at table.flat[indices[r]], the rest of the table untouched.
    x = torch.randn(3, 2 * argmax.BLOCK + 9, generator=torch.Generator().manual_seed(5))
    table = torch.full((4, 3), -7, dtype=torch.int64)
    indices = torch.tensor([8, 6, 7])  # ring row 2, its columns out of order
    assert argmax.argmax_triton(x, table, indices) is table
    want = torch.full((4, 3), -7, dtype=torch.int64)
    want.view(-1)[indices] = x.argmax(dim=-1)
    assert torch.equal(table, want)


def test_greedy_tokens_into_a_table_off_the_triton_path():
    from spark.engine.sampler import greedy_tokens

    x = torch.randn(2, 50, generator=torch.Generator().manual_seed(6))  # a CPU tensor: torch's argmax
    table = torch.zeros(2, 2, dtype=torch.int64)
    assert greedy_tokens(x, into=(table, torch.tensor([3, 2]))) is table
    assert table.view(-1).tolist() == [0, 0, *x.argmax(dim=-1).tolist()[::-1]]
