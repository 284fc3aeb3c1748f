"""Run a benchmark script with kernel module flags set, to measure a flag before it becomes the default.

    python benchmarks/with_flags.py moe_gemv.ROUTER_IN_GATE_UP,paged_attention.REDUCE_COUNT moe_decode.py --batches 1

Each flag names a module of spark.engine.kernels and a boolean constant in it, set to True before the
script runs as __main__ with the remaining arguments.
"""
import importlib
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

flags, script, *args = sys.argv[1:]
for flag in filter(None, flags.split(",")):
    module_name, constant = flag.rsplit(".", 1)
    module = importlib.import_module(f"spark.engine.kernels.{module_name}")
    if not isinstance(getattr(module, constant, None), bool):
        sys.exit(f"with_flags: {flag} is not a boolean constant of spark.engine.kernels.{module_name}")
    setattr(module, constant, True)
    print(f"with_flags: {flag} = True", flush=True)
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
