import pytest
import torch

from spark.engine.kernels import embedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 2048, 3000])
def test_embedding_matches_torch(dtype, dim):
    gen = torch.Generator().manual_seed(dim)
    weight = torch.randn(50, dim, generator=gen).to(dtype)
    ids = torch.tensor([0, 49, 7, 7, 23])
    got = embedding.embedding_triton(ids, weight)
    assert got.dtype == dtype and torch.equal(got, embedding.embedding_reference(ids, weight))


def test_embedding_of_strided_rows_and_no_tokens():
    weight = torch.randn(10, 2 * 300).view(10, 2, 300)[:, 1]  # rows 600 apart
    ids = torch.tensor([9, 0, 4])
    assert torch.equal(embedding.embedding_triton(ids, weight), weight[ids])
    assert embedding.embedding_triton(torch.empty(0, dtype=torch.int64), weight).shape == (0, 300)
