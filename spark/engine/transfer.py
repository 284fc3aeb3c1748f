"""Host-to-device copies that never make the host wait for the device.

CUDA copies from pageable host memory only after all work queued on the stream
has finished; from pinned memory the copy is queued like a kernel. Every input
of a step goes through here, so that the host can prepare and launch step N+1
while the device still runs step N.
"""

from __future__ import annotations

import torch


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, without a host sync on a GPU."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: through pinned memory, asynchronously, on a GPU."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
