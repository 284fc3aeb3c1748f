"""One config type for every Llama-family model Spark runs.

Llama 2/3.x, SmolLM2 and Mistral share one block; Qwen2/2.5 add a bias to the
q/k/v projections; Qwen3 adds a per-head RMSNorm on q and k; Qwen3-MoE and Mixtral
replace the MLP by routed experts (``num_experts > 0``). The differences are
flags and sizes here, so the model code stays two files (``llama.py``, ``moe.py``).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@attrs.frozen
class ModelConfig:
    """Shapes and flags of a Llama-family decoder.

    Built from an HF ``config.json`` (``spark.engine.weights.hf``), from GGUF
    metadata (``spark.engine.weights.gguf``) or inline for dummy weights.
    """

    arch: str  # a key of spark.engine.models.ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Qwen3-MoE, Mixtral); 0 experts: a dense model.
    num_experts: int = 0  # routed experts per sparse layer
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # one expert's SwiGLU width (``intermediate_size`` stays the dense layers')
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model whose MLP is dense (Qwen3-MoE's mlp_only_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s feed-forward is the routed experts rather than a dense MLP."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def shard(self, world_size: int) -> "ModelConfig":
        """One rank's slice under tensor parallelism over ``world_size`` ranks: its attention heads,
        KV heads and MLP width (``spark.engine.parallel``). The vocabulary is split apart from this
        (padded to a multiple of the ranks), so ``vocab_size`` stays the model's.

        Raises:
          ValueError: a model these ranks cannot split, in one line.
        """
        if world_size < 1:
            raise ValueError(f"world size {world_size}: needs at least 1 rank")
        if world_size == 1:
            return self
        if self.num_experts:
            raise ValueError(f"world size {world_size}: {self.arch} is a mixture of experts, which tensor "
                             f"parallelism does not split yet; serve it with world size 1")
        for what, n in (("attention heads", self.num_heads), ("KV heads", self.num_kv_heads),
                        ("MLP width", self.intermediate_size)):
            if n % world_size:
                raise ValueError(f"world size {world_size}: the model's {n} {what} do not divide over "
                                 f"{world_size} ranks")
        return attrs.evolve(self, num_heads=self.num_heads // world_size,
                            num_kv_heads=self.num_kv_heads // world_size,
                            intermediate_size=self.intermediate_size // world_size)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes one token occupies in the KV cache over all layers (K and V)."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

