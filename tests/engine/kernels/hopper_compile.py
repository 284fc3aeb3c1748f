"""Compile, without running, the decode chain's counted kernels for Hopper on a machine with no GPU.

    python -m tests.engine.kernels.hopper_compile      (TRITON_INTERPRET unset; prints one JSON line a kernel)

The interpreter runs a kernel's Python, not the PTX it compiles to: it runs programs one after another,
so a count's acquire and release, PDL's grid controls and inline PTX (the waits' nanosleep) never meet
a compiler there. Triton ships ptxas, so the compile itself needs no GPU: this module makes Triton's
active driver report an sm_90 target and turns every launch into a compile (``warmup``), with PDL on as
on an H100 or H200, then takes scripts/gpu_count_edges_check.py's chains through it on CPU tensors, each
edge alone and together, and with the waits sleeping. A kernel that fails to compile fails here; the
compiled PTX is reported by the instructions that carry the edges, for test_hopper_compile.py to check.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

HOPPER = ("cuda", 90, 32)  # GPUTarget(backend, arch, warp size)
# The PTX of the edges: PDL's wait and trigger, the count's load-acquire and release add, the waits' sleep.
MARKS = {"gdc_wait": "griddepcontrol.wait", "gdc_trigger": "griddepcontrol.launch_dependents",
         "acquire": ".acquire.", "release": ".release.", "nanosleep": "nanosleep."}


class _HopperDriver:
    """Triton's active driver as far as a compile asks it: an sm_90 target, device 0, no stream."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(*HOPPER)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def compile_only() -> list:
    """Make every later launch compile for Hopper instead of running; returns the list each compile joins
    as (kernel name, its integer and boolean constexprs, the compiled kernel)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from spark.engine.kernels import launch

    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "the interpreter compiles nothing"
    driver.set_active(_HopperDriver())
    compiled = []
    run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        constexprs = {k: v for k, v in kwargs.items() if k.isupper() and isinstance(v, (bool, int))}
        compiled.append((self.fn.__name__, constexprs, kernel))
        return kernel

    JITFunction.run = compile_instead
    launch.pdl = lambda kernel, x: launch._PDL_ON  # CPU tensors: PDL as on a Hopper GPU
    return compiled


def main() -> int:
    compiled = compile_only()
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
    import gpu_count_edges_check as check

    from spark.engine.kernels import launch

    check.replayed = lambda step, replays: (step(), 0)  # once: the launches compile, nothing runs
    gen = torch.Generator().manual_seed(0)
    chain = check.moe_chain(gen)
    for sleep in (0, check.SLEEP_NS):
        launch.COUNT_WAIT_SLEEP_NS = sleep
        for flags in (("ROUTER_IN_GATE_UP",), ("DOWN_COUNT",), ("ROUTER_IN_GATE_UP", "DOWN_COUNT")):
            check.moe_case(chain, 1, 0, flags)
        check.attention_case(gen, 1, 0)
    seen = set()
    for name, constexprs, kernel in compiled:
        key = (name, tuple(sorted(constexprs.items())))
        if key not in seen:
            seen.add(key)
            ptx = kernel.asm["ptx"]
            print(json.dumps({"kernel": name, "constexprs": constexprs,
                              "ptx": {mark: ptx.count(text) for mark, text in MARKS.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
