"""HF configs (transformers' GlmMoeDsaConfig) of the named GLM models.

ModelArch (arch.py) holds what the planner needs; the attention widths that only the model itself
needs live in `_GLM_DIMS` below. `hf_config_for` joins the two, so the table in arch.py and the HF
config cannot drift apart (tests/test_models_config.py checks every named GLM arch).

Facts about transformers 5.24's GlmMoeDsa that shape this module:
- The DSA sharing schedule is given as the kwargs `index_topk_freq` / `index_skip_topk_offset`;
  the config derives `indexer_types` ("full" computes the top-k, "shared" reuses the latest one)
  with the same rule as ModelArch.computes_index. Both kwargs are also kept on the config (and in
  config.json), so the schedule survives a save/load round trip.
- Without the offset kwarg transformers assumes offset 2, so it is always passed explicitly.
- RoPE is always interleaved in this model (no config switch); `head_dim` is overwritten with
  qk_rope_head_dim by the config itself.
- Only "full" layers own indexer weights (`self_attn.indexer` is None on "shared" layers), and the
  indexer runs under torch.no_grad: in the torch path its weights get no gradient (a frozen indexer,
  i.e. indexer-loss coefficient 0).
- MTP layers are not part of the HF module tree: `num_nextn_predict_layers` is kept as a plain
  config attribute (as in the released config.json), and transformers ignores `model.layers.78.*`
  when loading GLM-5.2 weights.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from agentrl.models.arch import GLM_5_2, GLM_5_2_5LAYER, TINY, ModelArch, get_arch

if TYPE_CHECKING:
    from transformers import GlmMoeDsaConfig

ARCHITECTURE = "GlmMoeDsaForCausalLM"
MODEL_TYPE = "glm_moe_dsa"

# Schedule/MTP kwargs that GlmMoeDsaConfig accepts without declaring them as fields.
_EXTRA_KWARGS = frozenset({"index_topk_freq", "index_skip_topk_offset", "num_nextn_predict_layers"})

# GLM-5.2: REFERENCE.md section 2.
_GLM_5_2_DIMS: dict[str, Any] = {
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "rope_parameters": {"rope_type": "default", "rope_theta": 8_000_000.0},
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 202752,
    "tie_word_embeddings": False,
}

# Every feature at toy size. v_head_dim (16) != qk_nope_head_dim (24) as in the real model, so a
# mix-up of the two widths fails loudly; index_head_dim must be >= qk_rope_head_dim (the indexer
# rotates its first qk_rope_head_dim dims). Token ids are those of agentrl.models.tokenizer.
_TINY_DIMS: dict[str, Any] = {
    "num_key_value_heads": TINY.num_attention_heads,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    # 32 indexer heads, as in GLM-5.2: with 4, many keys score exactly 0 after the ReLU and
    # top-k breaks those ties differently in cached decode and in a full forward (measured:
    # up to 0.09 logprob gap between engine and trainer; 2e-7 with 32 heads).
    "index_n_heads": 32,
    "index_head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": [2, 4, 6],  # <|endoftext|>, <|user|>, <|observation|>
}

_GLM_DIMS: dict[str, dict[str, Any]] = {
    GLM_5_2.name: _GLM_5_2_DIMS,
    GLM_5_2_5LAYER.name: _GLM_5_2_DIMS,
    TINY.name: _TINY_DIMS,
}


def glm_model_names() -> list[str]:
    """Names that `hf_config_for` accepts."""
    return list(_GLM_DIMS)


def _arch_kwargs(arch: ModelArch) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE],
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "intermediate_size": arch.dense_intermediate_size,
        "moe_intermediate_size": arch.moe_intermediate_size,
        "n_routed_experts": arch.n_routed_experts,
        "num_experts_per_tok": arch.experts_per_token,
        "first_k_dense_replace": arch.num_dense_layers,
        "index_topk": arch.index_topk,
        "index_topk_freq": arch.index_topk_freq,
        "index_skip_topk_offset": arch.index_skip_topk_offset,
        "num_nextn_predict_layers": arch.num_mtp_layers,
    }


def hf_config_for(name: str, **overrides: Any) -> GlmMoeDsaConfig:
    """transformers' GlmMoeDsaConfig of a named GLM model ("GLM-5.2", "GLM-5.2_5layer", "tiny").

    `overrides` replace single fields, e.g. `hf_config_for("tiny", num_nextn_predict_layers=1)` for a
    tiny model with an MTP layer, or `num_hidden_layers=...`; `indexer_types` is re-derived from the
    (possibly overridden) depth, freq and offset unless it is overridden itself."""
    from transformers import GlmMoeDsaConfig

    if name not in _GLM_DIMS:
        arch = get_arch(name)  # raises for unknown names with the list of known ones
        raise ValueError(
            f"model {arch.name!r} is a {arch.family} model, not GLM-MoE-DSA; its config comes from its "
            f"checkpoint. GLM names: {', '.join(_GLM_DIMS)}"
        )
    known = {f.name for f in dataclasses.fields(GlmMoeDsaConfig)} | _EXTRA_KWARGS
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"unknown GlmMoeDsaConfig field(s) {unknown} in overrides of {name!r}; "
            f"valid: {', '.join(sorted(known))}"
        )
    kwargs = {**_arch_kwargs(get_arch(name)), **_GLM_DIMS[name], **overrides}
    # Deep-copy the one mutable value so a caller's config cannot change the table.
    kwargs["rope_parameters"] = dict(kwargs["rope_parameters"])
    return GlmMoeDsaConfig(**kwargs)


def computing_layers(config: GlmMoeDsaConfig) -> list[int]:
    """1-indexed layers whose indexer computes its own top-k ("full"), as in ModelArch.computing_layers."""
    return [i + 1 for i, kind in enumerate(config.indexer_types) if kind == "full"]
