"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral.

The block is the Llama family's (``llama.py``: attention, norms, the residual stream),
its feed-forward swapped for routed experts: a linear router scores the experts, each
token takes its top-k of the softmax (renormalised to sum to 1 where the config says,
which Mixtral always does), and its output is the weighted sum of those experts' SwiGLU
MLPs. Qwen3-MoE keeps a dense MLP on the layers its config lists (``dense_layers``).

Checkpoints hold one ``[I, D]`` tensor per expert and projection; at load time they are
stacked into the layout the fused kernel reads (``kernels/fused_moe.py``): ``w13``
[E, 2I, D] (gate rows, then up) and ``w2`` [E, D, I]. On the CPU the experts stay dense
in the runtime's dtype (the packed formats leave them alone).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from spark.engine.config import ModelConfig
from spark.engine.models import ARCHITECTURES
from spark.engine.models.llama import Block, LlamaModel, hf_weight_shapes
from spark.engine.models.ops import Ops
from spark.engine.models.runtime import Runtime


class SparseMoe(nn.Module):
    routed = True  # what ``ops.block_one_row`` asks a feed-forward

    def __init__(self, config: ModelConfig, ops: Ops):
        super().__init__()
        self.ops = ops
        e, d, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(d, e, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, d))  # per expert: gate rows, then up
        self.w2 = nn.Parameter(torch.empty(e, d, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] -> [T, D]
        return self.ops.moe(x, self.gate, self.w13, self.w2, self.top_k, self.renormalize)


class MoeModel(LlamaModel):
    """A Llama-family decoder whose sparse layers' feed-forward is ``SparseMoe``."""

    def __init__(self, config: ModelConfig, runtime: Runtime):
        super().__init__(config, runtime)
        # Batch-1 decode: the one-row block, where the ops fuse an MoE block's too (the GPU's); the
        # CPU's is the dense MLP's. SPARK_MOE_ONE_ROW=0 keeps the generic path (for measuring it).
        self.one_row = (self.one_row and runtime.ops.fuses_moe_one_row
                        and os.environ.get("SPARK_MOE_ONE_ROW", "1") != "0")

    def make_block(self, config: ModelConfig, ops: Ops, layer: int) -> nn.Module:
        block = Block(config, ops)
        if config.is_sparse(layer):
            block.feed_forward = SparseMoe(config, ops)
        return block

    @staticmethod
    def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        c = config
        module, gate, up, down = ARCHITECTURES[c.arch].moe_names
        i = c.moe_intermediate_size
        shapes = {}
        for name, shape in hf_weight_shapes(c).items():
            layer = _layer(name)
            if layer is None or not c.is_sparse(layer) or ".mlp." not in name:
                shapes[name] = shape
            elif name.endswith("mlp.down_proj.weight"):  # the last of the dense MLP: the experts go here
                p = f"model.layers.{layer}.{module}."
                shapes[p + "gate.weight"] = (c.num_experts, c.hidden_size)
                for e in range(c.num_experts):
                    shapes[f"{p}experts.{e}.{gate}.weight"] = (i, c.hidden_size)
                    shapes[f"{p}experts.{e}.{up}.weight"] = (i, c.hidden_size)
                    shapes[f"{p}experts.{e}.{down}.weight"] = (c.hidden_size, i)
        return shapes

    def weight_target(self, name: str) -> tuple[str, int | tuple[int, int] | None]:
        c = self.config
        module, gate, up, down = ARCHITECTURES[c.arch].moe_names
        layer = _layer(name)
        if layer is None or not c.is_sparse(layer):
            return super().weight_target(name)
        rest = name.split(".", 3)[3]  # e.g. mlp.experts.3.gate_proj.weight
        prefix = f"layers.{layer}.feed_forward."
        if rest == f"{module}.gate.weight":
            return prefix + "gate.weight", None
        if rest.startswith(f"{module}.experts."):
            e, proj, _ = rest.removeprefix(f"{module}.experts.").split(".")
            if proj in (gate, up):
                return prefix + "w13", (int(e), 0 if proj == gate else c.moe_intermediate_size)
            if proj == down:
                return prefix + "w2", (int(e), 0)
        if rest.startswith(module + "."):
            raise KeyError(f"unexpected weight {name}")
        return super().weight_target(name)


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[1] == "layers" else None
