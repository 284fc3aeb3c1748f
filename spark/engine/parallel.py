"""Tensor parallelism: which slice of the model a rank holds, and the collectives that join the slices.

Megatron's split of a Llama block over N ranks: ``wqkv`` and ``w13`` are column-parallel
(each rank computes its own heads and its share of the MLP width, K/V heads and their
cache pages included), ``wo`` and ``w2`` row-parallel (each rank's partial product, summed
by one all-reduce), so a block costs two all-reduces of ``[T, D]``. The embedding and the
head split the vocabulary: each rank looks up (and scores) its own rows, the lookup is
all-reduced and the logits gathered.

Every rank ends a forward with the same hidden states and logits, bit for bit (an
all-reduce hands every rank the same sum; a gather the same rows), so each rank's
sampler, seeded alike, picks the same tokens and no token travels back to rank 0.

The collectives run on the forward's stream and never wait on the host: a decode step's
all-reduces and gather are captured in its CUDA graph like any kernel. The plans rank 0
sends its followers go over a second group, gloo over TCP (``spark.engine.ranks``).
"""

from __future__ import annotations

import datetime
import os
import random
import socket

import attrs
import torch
import torch.distributed as dist

# A follower waits on the leader's next message for as long as the server is idle.
_IDLE_TIMEOUT = datetime.timedelta(days=365)


@attrs.frozen
class TensorParallel:
    """This process's place in a tensor-parallel group (rank 0 of 1 when there is none).

    Attributes:
      rank, world_size: this process's rank and the group's size.
      device: the device this rank computes on (``cuda:<local rank>`` on GPUs).
      group: the forward's collectives (NCCL on GPUs, gloo on the CPU); None alone.
      control: gloo, for what rank 0 tells its followers; None alone.
      seed: drawn by rank 0, the same on every rank: their engines draw request seeds alike.
    """

    rank: int = 0
    world_size: int = 1
    device: torch.device | None = None
    group: object = None
    control: object = None
    seed: int | None = None

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of the vocabulary each rank holds (the last rank's padded past the vocabulary)."""
        return -(-vocab_size // self.world_size)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel product over the ranks, in place.

        ``x`` [T, D], or split-K partials [S, T, D] in fp32 (``Ops.project``): those are summed
        here first and come back as one partial [1, T, D], which the next add-norm takes as it
        takes any partials, so the sum is rounded once, after the ranks' parts are in.
        """
        if self.world_size == 1:
            return x
        if x.dim() == 3:
            x = x.sum(0, keepdim=True)
        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, embedding: torch.nn.Module, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rows of ``ids`` [T] from a vocabulary split by rows: each rank looks up the ids in its
        slice (zeros elsewhere) and the sum over ranks is the lookup. Returns [T, D]."""
        if self.world_size == 1:
            return embedding(ids)
        rows = self.vocab_rows(vocab_size)
        local = ids - self.rank * rows
        mine = (local >= 0) & (local < rows)
        x = embedding(local.clamp(0, rows - 1)).masked_fill(~mine[:, None], 0)
        return self.reduce(x)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Each rank's logits [N, V / ranks] -> every rank's [N, V] (the padding cut off)."""
        if self.world_size == 1:
            return logits
        n, rows = logits.shape
        out = logits.new_empty(self.world_size * n, rows)
        _all_gather_single(out, logits.contiguous(), group=self.group)
        full = out.view(self.world_size, n, rows).permute(1, 0, 2).reshape(n, self.world_size * rows)
        return full if full.shape[1] == vocab_size else full[:, :vocab_size].contiguous()

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the KV pages each rank's memory allows)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def tell(self, message: object) -> None:
        """Rank 0: send ``message`` to every follower."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def hear(self) -> object:
        """A follower: the next message rank 0 sends (waits as long as it takes)."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


SINGLE = TensorParallel()
# torch 2.13 renamed all_gather_into_tensor (a warning each call); the GPU machine's 2.11 may not have the new name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def free_port() -> int:
    """A TCP port free on this host now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world_size: int, device: str | torch.device | None) -> TensorParallel:
    """Join the group of ``world_size`` ranks as ``rank``; every rank calls this, in any order.

    The rendezvous is torch's ``env://``: ``MASTER_ADDR`` and ``MASTER_PORT`` name rank 0's
    store, as ``torchrun`` sets them (or ``ranks.start_followers`` on one host). On GPUs the
    rank computes on ``cuda:<LOCAL_RANK>`` (its rank when unset) over NCCL, else on the CPU
    over gloo.
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}  # NCCL connects eagerly, before capture
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, **kwargs)
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    box = [random.getrandbits(63) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=control)
    return TensorParallel(rank, world_size, device, dist.group.WORLD, control, box[0])


def leave() -> None:
    """Leave the group (a rank's last act)."""
    if dist.is_initialized():
        dist.destroy_process_group()
