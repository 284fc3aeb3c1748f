"""What a piecewise step launches from the host per layer: Triton kernels and torch ops, on the CPU.

    TRITON_INTERPRET=1 python benchmarks/attention_launches.py [--preset tiny-llama] [--decodes 4] [--prompt 12]

A step with a prompt chunk runs through ``PiecewiseGraphs``: one graph replay per segment and the
layer's attention eagerly between (``piecewise.py``). On a GPU each eager launch costs tens of
microseconds of Python, so the count per layer is what this measures: a mixed step (decode rows,
then one prompt chunk) through the runner with the GPU's ops (``TritonOps``; kernels in Triton's
interpreter), its segments stubbed out (a replay is one launch on a GPU). It counts

- Triton launches (``kernel[grid](...)``),
- torch ops that run a kernel on a GPU (``sub``, ``cat``, ``copy_``, ``zero_``/``fill_``, ...),
- torch ops that only make a tensor or a view (``empty``, ``slice``, ``view``, ...): no kernel, but
  each one is a trip through the dispatcher on the host.

It also times the eager part per layer with the kernels stubbed (not run): the Python of the
launch sites alone, a relative figure (a GPU's launcher adds its own cost per launch).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout: spark, tests

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# aten ops that allocate or alias and launch nothing on a GPU.
NO_KERNEL = {
    "empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
    "new_empty_strided.default", "view.default", "_unsafe_view.default", "slice.Tensor", "select.int",
    "split.Tensor", "split_with_sizes.default", "as_strided.default", "alias.default", "detach.default",
    "unsqueeze.default", "squeeze.dim", "expand.default", "t.default", "transpose.int", "permute.default",
    "reshape(view)", "lift_fresh.default", "_reshape_alias.default",
}


class Counter(TorchDispatchMode):
    """Counts aten ops, apart for those inside a layer's ``attention.attend`` (``scope`` "layer")."""

    def __init__(self):
        super().__init__()
        self.ops = {"layer": collections.Counter(), "step": collections.Counter()}
        self.paused = False
        self.scope = "step"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            self.ops[self.scope][op_name(func, args, out)] += 1
        return out


def op_name(func, args, out) -> str:
    """An aten op's name as these counts key it: "overload.name", a reshape told apart as
    "reshape(view)" or "reshape(copy)" (seen whole under inference_mode: a view, or a copy kernel)."""
    name = func._overloadpacket.__name__ + "." + func._overloadname
    if name == "reshape.default":
        same = out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()
        name = "reshape(view)" if same else "reshape(copy)"
    return name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-llama")
    ap.add_argument("--decodes", type=int, default=4, help="decode rows of the mixed step")
    ap.add_argument("--prompt", type=int, default=12, help="tokens of its prompt chunk")
    ap.add_argument("--repeats", type=int, default=200, help="stubbed-kernel runs timed")
    args = ap.parse_args()

    from triton.runtime.interpreter import InterpretedFunction

    from spark.engine.models.ops import TritonOps
    from spark.engine.piecewise import PiecewiseGraphs
    from spark.engine.weights import resolve_model
    from tests.engine.kernels.test_model_ops import _model, _step

    source = resolve_model(f"dummy:{args.preset}")
    model, cache = _model(source, TritonOps(), torch.float32, num_seqs=args.decodes + 1)
    tokens = args.decodes + args.prompt
    runner = PiecewiseGraphs(model, max_tokens=tokens, device="cpu", dtype=torch.float32)
    runner.capture_all()
    replays = collections.Counter()
    for b, segments in runner.ready.items():  # a replay on a GPU: one launch, nothing of the host's
        runner.ready[b] = [lambda: replays.update(["replay"]) for _ in segments]
    chunks = [(b, 8, 1) for b in range(args.decodes)] + [(args.decodes, 0, args.prompt)]
    # A fresh metadata object a step, as the engine builds one: what it caches is built once a step.
    steps = [_step(chunks, decode_only=False) for _ in range(args.repeats + 2)]
    positions = steps[0][0]
    ids = torch.zeros(tokens, dtype=torch.int64)

    counter, stub = Counter(), [False]
    launches = {"layer": collections.Counter(), "step": collections.Counter()}
    run = InterpretedFunction.run

    def counted_run(self, *a, **kw):
        launches[counter.scope][self.__name__] += 1
        if stub[0]:
            return None
        counter.paused = True  # the interpreter's own tensor traffic is no launch of ours
        try:
            return run(self, *a, **kw)
        finally:
            counter.paused = False

    # What runs inside a layer's attention, apart from the step's own: the runner calls
    # ``attend_heads`` (``attend`` before the heads' views were made once a step).
    name = "attend_heads" if hasattr(model.layers[0].attention, "attend_heads") else "attend"
    for layer in model.layers:
        attend = getattr(layer.attention, name)

        def scoped(*a, attend=attend, **kw):
            counter.scope = "layer"
            try:
                return attend(*a, **kw)
            finally:
                counter.scope = "step"

        setattr(layer.attention, name, scoped)
    InterpretedFunction.run = counted_run
    try:
        with torch.inference_mode():
            runner.forward(ids, positions, cache.layers, steps[0][1])  # warm-up: JIT, caches
            for c in launches.values():
                c.clear()
            with counter:
                runner.forward(ids, positions, cache.layers, steps[1][1])
            counted = {scope: dict(c) for scope, c in launches.items()}
            stub[0] = True
            t0 = time.perf_counter()
            for _, meta in steps[2:]:
                runner.forward(ids, positions, cache.layers, meta)
            host_s = (time.perf_counter() - t0) / args.repeats
    finally:
        InterpretedFunction.run = run

    layers = len(model.layers)

    def split(scope: str, per: int) -> dict:
        ops = counter.ops[scope]
        kernels = {k: v for k, v in ops.items() if k not in NO_KERNEL}
        views = {k: v for k, v in ops.items() if k in NO_KERNEL}
        return {
            "triton_launches": sum(counted[scope].values()) / per, "torch_kernel_ops": sum(kernels.values()) / per,
            "torch_view_or_alloc_ops": sum(views.values()) / per,
            "detail": {"triton": counted[scope], "torch_kernel_ops": kernels, "torch_view_or_alloc_ops": views},
        }

    print(json.dumps({
        "preset": args.preset, "layers": layers, "decodes": args.decodes, "prompt": args.prompt,
        # Inside the layers' attention, per layer (the details: over all layers of the step).
        "per_layer": split("layer", layers),
        # The rest of the step's eager part, once a step (the segments' replays not counted).
        "per_step": split("step", 1),
        "host_us_per_layer_stubbed": round(host_s / layers * 1e6, 1),
    }))

if __name__ == "__main__":
    main()
