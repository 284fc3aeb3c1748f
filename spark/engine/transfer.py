"""Copies between host and device that never make the host wait for the device.

CUDA copies from pageable host memory only after all work queued on the stream
has finished; from pinned memory the copy is queued like a kernel. Every input
of a step goes through here, and its samples come back through ``HostCopy``,
so that the host can prepare and launch step N+1 while the device runs step N.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, without a host sync on a GPU."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: through pinned memory, asynchronously, on a GPU."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def upload_into(dst: torch.Tensor, values) -> None:
    """``dst[:len(values)] = values`` (a list of numbers in ``dst``'s dtype), without a host sync
    on a GPU: a static buffer, such as a CUDA graph's input, filled in one copy."""
    host = torch.tensor(values, dtype=dst.dtype)
    if dst.is_cuda:
        host = host.pin_memory()
    dst[: len(values)].copy_(host, non_blocking=True)


class HostCopy:
    """Device tensors on their way to the host: the copies are queued at once, ``read`` waits for them."""

    def __init__(self, tensors: Sequence[torch.Tensor | None]):
        self._ready = None  # a CUDA event after the copies
        if any(t is not None and t.is_cuda for t in tensors):
            self._tensors = [None if t is None else _to_pinned(t) for t in tensors]
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._tensors = list(tensors)

    def read(self) -> list[list | None]:
        """Each tensor as a (nested) list, None where there was none."""
        if self._ready is not None:
            self._ready.synchronize()
        return [None if t is None else t.tolist() for t in self._tensors]


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
