"""Parameter counts of a GLM-MoE-DSA model per pipeline stage and per GPU, as the Megatron backend
lays it out (agentrl.models.sharding, agentrl.train.megatron_backend), for the memory accounting.

Per GPU of a stage: tensor-parallel weights (MLA up/out projections, dense and shared-expert MLPs,
embedding and LM head rows, MTP eh_proj) divided by TP; duplicated ones (q/kv down projections,
the DSA indexer, norms, the router) whole on every TP rank; routed experts divided by EP (ETP 1).
The first stage holds the embedding; the last the final norm, the LM head and the MTP layers,
plus a copy of the embedding when there is MTP (or tied weights) and more than one stage.
Frozen (no grad, no optimizer state): the indexer (its inputs are detached, indexer loss 0) and the
MTP layers (megatron_backend.MTP_LOSS_SCALE); the embedding copy is trained.

Pure arithmetic on the model's shapes: no torch. `shapes_of` reads a named model's table or any
object with the HF GlmMoeDsaConfig attribute names (the backend passes its HF config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShapes:
    hidden: int
    vocab: int
    layers: int
    dense_layers: int  # the first k layers have a dense MLP
    heads: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    index_heads: int
    index_dim: int
    index_freq: int
    index_offset: int
    n_experts: int
    experts_per_token: int
    moe_inter: int
    dense_inter: int
    n_shared: int
    mtp_layers: int
    tied: bool

    def computes_index(self, layer: int) -> bool:
        """1-indexed; Megatron's rule (dsa.is_dsa_skip_topk_layer)."""
        if self.index_freq <= 1:
            return True
        return max(layer - max(self.index_offset, 1), 0) % self.index_freq == 0


def shapes_of(model: Any) -> ModelShapes:
    """ModelShapes of a named GLM model ("GLM-5.2", "tiny", ...) or of an HF GlmMoeDsaConfig."""
    if isinstance(model, str):
        from agentrl.models.arch import get_arch
        from agentrl.models.hf_config import _GLM_DIMS

        arch = get_arch(model)
        if model not in _GLM_DIMS:
            raise KeyError(f"{model}: no GLM-MoE-DSA shapes (a {arch.family} model)")
        d = _GLM_DIMS[model]
        return ModelShapes(arch.hidden_size, arch.vocab_size, arch.num_layers, arch.num_dense_layers,
                           arch.num_attention_heads, d["q_lora_rank"], d["kv_lora_rank"], d["qk_nope_head_dim"],
                           d["qk_rope_head_dim"], d["v_head_dim"], d["index_n_heads"], d["index_head_dim"],
                           arch.index_topk_freq, arch.index_skip_topk_offset, arch.n_routed_experts,
                           arch.experts_per_token, arch.moe_intermediate_size, arch.dense_intermediate_size,
                           d.get("n_shared_experts", 1), arch.num_mtp_layers, bool(d.get("tie_word_embeddings")))
    c = model
    return ModelShapes(c.hidden_size, c.vocab_size, c.num_hidden_layers, int(c.first_k_dense_replace),
                       c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
                       c.v_head_dim, c.index_n_heads, c.index_head_dim, int(getattr(c, "index_topk_freq", 1) or 1),
                       int(getattr(c, "index_skip_topk_offset", 0) or 0), c.n_routed_experts, c.num_experts_per_tok,
                       c.moe_intermediate_size, c.intermediate_size, c.n_shared_experts,
                       int(getattr(c, "num_nextn_predict_layers", 0) or 0), bool(c.tie_word_embeddings))


@dataclass(frozen=True)
class GpuParams:
    """Parameters one GPU of a stage holds."""

    trainable: int
    frozen: int
    experts: int  # of `trainable`: routed experts (their optimizer state is per EP rank)

    @property
    def total(self) -> int:
        return self.trainable + self.frozen


def _layer(s: ModelShapes, moe: bool, indexer: bool, tp: int, ep: int) -> tuple[int, int, int]:
    """(trainable, indexer, routed-expert) params of one decoder layer on one GPU."""
    h = s.hidden
    split = s.q_lora * s.heads * (s.qk_nope + s.qk_rope) + s.kv_lora * s.heads * (s.qk_nope + s.v_head) \
        + s.heads * s.v_head * h
    dup = h * s.q_lora + h * (s.kv_lora + s.qk_rope) + 2 * h + s.q_lora + s.kv_lora  # down projections, 4 norms
    experts = 0
    if moe:
        split += 3 * h * s.moe_inter * s.n_shared
        dup += s.n_experts * h  # router
        experts = s.n_experts // ep * 3 * h * s.moe_inter
    else:
        split += 3 * h * s.dense_inter
    idx = s.q_lora * s.index_heads * s.index_dim + h * s.index_dim + h * s.index_heads + 2 * s.index_dim \
        if indexer else 0
    return split // tp + dup + experts, idx, experts


def gpu_params(s: ModelShapes, layers: range, *, first: bool, last: bool, tp: int, ep: int) -> GpuParams:
    """What one GPU of the stage holding 0-indexed decoder `layers` holds."""
    trainable = frozen = experts = 0
    for i in layers:
        t, idx, e = _layer(s, i >= s.dense_layers, s.computes_index(i + 1), tp, ep)
        trainable, frozen, experts = trainable + t, frozen + idx, experts + e
    emb = s.vocab * s.hidden // tp
    multi_stage = not (first and last)
    if first:
        trainable += emb
    if last:
        trainable += s.hidden + (0 if s.tied else emb)  # final norm, LM head
        if multi_stage and (s.mtp_layers or s.tied):
            trainable += emb  # the embedding's copy, kept equal by the embedding-group all-reduce
        for _ in range(s.mtp_layers):  # Megatron builds it from the last layer's spec; its indexer computes
            t, idx, e = _layer(s, s.layers - 1 >= s.dense_layers, True, tp, ep)
            frozen += t + idx + 2 * s.hidden * s.hidden // tp + 3 * s.hidden  # eh_proj, enorm, hnorm, final norm
    return GpuParams(trainable, frozen, experts)


def stage_gpu_params(s: ModelShapes, stages: list[range], tp: int, ep: int) -> list[GpuParams]:
    """gpu_params of every stage of a layout's pipeline split."""
    last = len(stages) - 1
    return [gpu_params(s, r, first=i == 0, last=i == last, tp=tp, ep=ep) for i, r in enumerate(stages)]
