"""What every Triton launcher here asks about the device before a launch.

Programmatic dependent launch (Hopper and later): a kernel launched with it may be
scheduled while the kernel before it in the stream is still running, and waits
(`griddepcontrol.wait`) before touching anything that kernel wrote. Decode at small
batch is a chain of short kernels, each paying a launch and a ramp-up that the
previous kernel's tail can hide; the CUDA graphs of decode keep the dependency
edges. ``SPARK_PDL=0`` turns it off (for measuring it, or for a driver that
mishandles it).
"""

from __future__ import annotations

import functools
import os

import torch

triton = None  # bound by jit_wait_for_previous() on first use: TRITON_INTERPRET is read when @triton.jit runs
tl = None


# These run at every launch, several times a layer of an eager step, where each microsecond of
# Python is host time the GPU may wait on: what they ask is looked up once.


@functools.cache
def _interpreted_function() -> type:
    # Imported once: an import statement in `interpreting` cost 2 us a call.
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction


def interpreting(kernel) -> bool:
    """Whether ``kernel`` runs in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return isinstance(kernel, _interpreted_function())


@functools.cache
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and os.environ.get("SPARK_PDL", "1") != "0"


_PDL_ON = {"PDL": True, "launch_pdl": True}  # shared, never changed: callers unpack them
_PDL_OFF = {"PDL": False}


def pdl(kernel, x: torch.Tensor) -> dict:
    """Launch arguments for a kernel that takes a ``PDL`` constexpr: ``PDL=True`` and
    ``launch_pdl=True`` on a Hopper GPU, ``PDL=False`` elsewhere (the interpreter too).

    A kernel with ``PDL`` set must wait on the kernel before (``jit_wait_for_previous``) before its
    first load of anything an earlier kernel wrote, and before its first store.
    """
    # get_device(): a CUDA tensor's index, without building a torch.device.
    on = x.is_cuda and not interpreting(kernel) and _pdl_device(x.get_device())
    return _PDL_ON if on else _PDL_OFF


@functools.cache
def jit_wait_for_previous():
    """The @triton.jit ``wait_for_previous(TRIGGER_FIRST)``, JIT-ed once, for the kernels of the decode chain.

    It waits on the kernel before (PDL's ``griddepcontrol.wait``: that kernel done, its writes
    visible) and lets the kernel after launch, after the wait or, with ``TRIGGER_FIRST``, ahead of it:
    the next kernel's programs are then resident, their launch paid, while this one still waits (a
    short kernel between two long ones: ``small_linear.Config.trigger_first``, the split-KV reduce).
    """
    global triton, tl
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401 (tl.extra.cuda)

    @triton.jit
    def wait_for_previous(TRIGGER_FIRST: tl.constexpr):
        if TRIGGER_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not TRIGGER_FIRST:
            tl.extra.cuda.gdc_launch_dependents()

    return wait_for_previous
