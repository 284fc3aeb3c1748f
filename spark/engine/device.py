"""Which device an engine runs on, checked where a user can act on it, and its CPU threads."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("spark.engine")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def checked_device(device: str | torch.device) -> torch.device:
    """``device`` as torch's, or a ``ValueError`` a user can act on (torch's would be a bare
    ``AssertionError: Torch not compiled with CUDA enabled`` from deep inside the load)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {str(device)!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
        raise ValueError(f"device {str(device)!r}: this torch ({torch.__version__}) has {why}; use --device cpu")
    return device


def use_cpu_threads(device: str | None, threads: int) -> None:
    """Give torch ``threads`` intra-op threads when this process's engine runs on the CPU (``device``;
    None: the default device)."""
    on_cpu = torch.device(device).type == "cpu" if device else default_device().type == "cpu"
    if on_cpu and torch.get_num_threads() != threads:
        log.info("cpu engine: %d torch threads", threads)
        torch.set_num_threads(threads)
