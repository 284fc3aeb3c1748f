"""The decode chain's counted kernels compile for Hopper (sm_90, PDL on), and their PTX carries each edge.

The interpreter, where every other kernel test runs, compiles nothing; hopper_compile.py compiles the
kernels of scripts/gpu_count_edges_check.py's chains with Triton's own ptxas, in a process of its own
(TRITON_INTERPRET unset there). What the edges must compile to:
- a kernel that waits on a count has dropped PDL's wait (that is the edge) but still triggers its
  dependents, and reads the count with a load-acquire, sleeping between reads where asked;
- a kernel that counts its programs done does so with a release;
- a kernel with no count keeps PDL's wait and trigger, and no acquire, release or sleep.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PLAIN = {"gdc_wait": 1, "gdc_trigger": 1, "acquire": 0, "release": 0, "nanosleep": 0}


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.engine.kernels.hopper_compile"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def _ptx(compiled, kernel, **constexprs):
    """The PTX marks of every compiled ``kernel`` whose constexprs include ``constexprs``; at least one."""
    found = [c["ptx"] for c in compiled
             if c["kernel"] == kernel and all(c["constexprs"].get(k) == v for k, v in constexprs.items())]
    assert found, f"{kernel} {constexprs} was not compiled"
    return found


@pytest.mark.parametrize("sleep", [0, 500])
def test_waiting_kernels_drop_pdls_wait_for_a_load_acquire(compiled, sleep):
    nap = int(sleep > 0)
    for ptx in _ptx(compiled, "moe_gemv_down_kernel", WAIT_COUNT=1536, WAIT_SLEEP_NS=sleep):
        assert ptx == {"gdc_wait": 0, "gdc_trigger": 1, "acquire": 2, "release": 0, "nanosleep": nap}
    for ptx in _ptx(compiled, "small_linear_kernel", WAIT_COUNT=32, WAIT_SLEEP_NS=sleep):
        assert ptx == {"gdc_wait": 0, "gdc_trigger": 1, "acquire": 2, "release": 0, "nanosleep": nap}
    # The router in gate/up's grid: its programs count (a release) and gate/up's wait on them (an acquire);
    # both kinds of program keep PDL's wait, for x.
    for ptx in _ptx(compiled, "moe_gemv_gate_up_kernel", ROUTER_PROGRAMS=32, COUNT_DONE=False, WAIT_SLEEP_NS=sleep):
        assert ptx["acquire"] == 2 and ptx["release"] == 1 and ptx["gdc_wait"] == 2 and ptx["nanosleep"] == nap


def test_counting_kernels_release_their_count(compiled):
    for ptx in _ptx(compiled, "moe_gemv_gate_up_kernel", ROUTER_PROGRAMS=0, COUNT_DONE=True):
        assert ptx == {**PLAIN, "release": 1}
    for ptx in _ptx(compiled, "moe_gemv_gate_up_kernel", ROUTER_PROGRAMS=32, COUNT_DONE=True):
        assert ptx["release"] == 2  # the router's programs' and gate/up's own
    for ptx in _ptx(compiled, "reduce_kernel", COUNT=True):
        assert ptx == {**PLAIN, "release": 1}


def test_kernels_without_a_count_keep_pdls_edges(compiled):
    for kernel, off in (("moe_gemv_gate_up_kernel", dict(ROUTER_PROGRAMS=0, COUNT_DONE=False)),
                        ("moe_gemv_down_kernel", dict(WAIT_COUNT=0)), ("small_linear_kernel", dict(WAIT_COUNT=0)),
                        ("reduce_kernel", dict(COUNT=False)), ("decode_kernel", {})):
        for ptx in _ptx(compiled, kernel, **off):
            assert ptx == PLAIN, kernel
