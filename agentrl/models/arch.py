"""Architecture facts of the named models that the planner and capacity model need.

This is the single table of named models; agentrl.models builds HF configs from it.
GLM-5.2 numbers: REFERENCE.md section 2.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArch:
    name: str
    family: str  # "glm_moe_dsa" or "causal_lm" (a generic HF model without DSA/MoE)
    num_layers: int  # transformer layers, MTP excluded
    hidden_size: int
    vocab_size: int
    num_dense_layers: int = 0  # first k layers use a dense MLP
    n_routed_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    dense_intermediate_size: int = 0
    num_attention_heads: int = 0
    index_topk_freq: int = 1  # DSA: a computing layer every `freq` layers after the offset
    index_skip_topk_offset: int = 0  # DSA: the first `offset` layers all compute
    index_topk: int = 0
    num_mtp_layers: int = 0
    total_params_b: float | None = None  # billions, when known
    active_params_b: float | None = None

    @property
    def has_dsa(self) -> bool:
        return self.family == "glm_moe_dsa"

    def computes_index(self, layer: int) -> bool:
        """Whether 1-indexed `layer` computes its own DSA top-k (others reuse the latest one).

        Layer L computes iff max(L - offset, 0) % freq == 0; with offset 3, freq 4 that is
        1, 2, 3, 7, 11, ..., 75 for GLM-5.2."""
        if not 1 <= layer <= self.num_layers:
            raise ValueError(f"layer {layer} outside 1..{self.num_layers}")
        if not self.has_dsa:
            return True
        return max(layer - self.index_skip_topk_offset, 0) % self.index_topk_freq == 0

    def computing_layers(self) -> list[int]:
        return [layer for layer in range(1, self.num_layers + 1) if self.computes_index(layer)]


GLM_5_2 = ModelArch(
    name="GLM-5.2",
    family="glm_moe_dsa",
    num_layers=78,
    hidden_size=6144,
    vocab_size=154880,
    num_dense_layers=3,
    n_routed_experts=256,
    experts_per_token=8,
    moe_intermediate_size=2048,
    dense_intermediate_size=12288,
    num_attention_heads=64,
    index_topk_freq=4,
    index_skip_topk_offset=3,
    index_topk=2048,
    num_mtp_layers=1,
    total_params_b=744.0,
    active_params_b=40.0,
)

# The pruned smoke-test model: the first 5 layers (3 dense + 2 MoE) at real widths, no MTP.
GLM_5_2_5LAYER = ModelArch(
    **{**GLM_5_2.__dict__, "name": "GLM-5.2_5layer", "num_layers": 5, "num_mtp_layers": 0,
       "total_params_b": None, "active_params_b": None}
)

# Every GLM feature at toy size: MLA, DSA with index sharing, sigmoid router, shared expert,
# dense first layers. Layers 1, 2, 4 compute the index; 3 and 5 reuse it.
TINY = ModelArch(
    name="tiny",
    family="glm_moe_dsa",
    num_layers=5,
    hidden_size=64,
    vocab_size=1024,
    num_dense_layers=2,
    n_routed_experts=8,
    experts_per_token=2,
    moe_intermediate_size=32,
    dense_intermediate_size=128,
    num_attention_heads=4,
    index_topk_freq=2,
    index_skip_topk_offset=2,
    index_topk=8,
    num_mtp_layers=0,
)

SMOLLM2_135M = ModelArch(
    name="smollm2-135m",
    family="causal_lm",
    num_layers=30,
    hidden_size=576,
    vocab_size=49152,
    num_attention_heads=9,
    dense_intermediate_size=1536,
    total_params_b=0.135,
    active_params_b=0.135,
)

# Gemma 3 270M (agentrl/models/gemma3.py): 18 layers, 4 query heads / 1 KV head of dim 256, sliding window
# 512 on 5 of 6 layers, a 262k vocabulary (170 M of its 268 M parameters are the tied embedding).
GEMMA3_270M = ModelArch(
    name="gemma3-270m",
    family="causal_lm",
    num_layers=18,
    hidden_size=640,
    vocab_size=262144,
    num_attention_heads=4,
    dense_intermediate_size=2048,
    total_params_b=0.268,
    active_params_b=0.268,
)

NAMED_ARCHS: dict[str, ModelArch] = {
    a.name: a for a in (GLM_5_2, GLM_5_2_5LAYER, TINY, SMOLLM2_135M, GEMMA3_270M)
}


def get_arch(name: str) -> ModelArch:
    try:
        return NAMED_ARCHS[name]
    except KeyError:
        raise ValueError(f"unknown model name {name!r}; known: {', '.join(NAMED_ARCHS)}") from None
