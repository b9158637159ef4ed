"""Megatron-core 0.19.2 GPTModel for GLM-MoE-DSA (MLA + DSA with index sharing + sigmoid MoE + MTP).

`transformer_config_from_hf` maps transformers' GlmMoeDsaConfig onto MLATransformerConfig;
`build_gpt_model` builds this pipeline stage with megatron's DSA layer spec. Megatron's own DSA
spec path asserts TransformerEngine. Without TE (the H200 machine has none) we build the same
per-layer specs through a backend that returns megatron's `post_training.modelopt.layers.Linear`
for `linear()` (the DSA indexer and q/kv down projections are plain duplicated linears), points
`absorbed_mla.Linear` at that class (absorbed_mla only imports it when TE is present), and builds
every norm with agentrl.train.norms, which runs on sequence-parallel shards (megatron's torch norms
refuse sequence parallelism, which AbsorbedMLA requires at TP > 1). Routed experts are grouped
GEMMs (agentrl.train.grouped_experts) instead of the SequentialMLP loop. On CPU the model builds
and trains inside agentrl.train.cpu_shims.cpu_megatron (REFERENCE section 9).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from agentrl.config.layout import Layout
from agentrl.models.mapping import arch_from_hf, dsa_schedule, num_mtp_layers

# Only HF rope types with a Megatron equivalent (MLATransformerConfig.rope_type "rope" / "yarn").
_YARN_KEYS = {"factor": "rotary_scaling_factor", "original_max_position_embeddings": "original_max_position_embeddings",
              "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim"}


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _rope_fields(hf_config: Any) -> dict[str, Any]:
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("model config has no rope_theta (rope_parameters.rope_theta); cannot set rotary_base")
    if kind == "default":
        return {"rope_type": "rope", "rotary_base": float(theta), "rotary_percent": 1.0}
    if kind == "yarn":
        return {"rope_type": "yarn", "rotary_base": float(theta),
                **{mg: rope[hf] for hf, mg in _YARN_KEYS.items() if hf in rope}}
    raise ValueError(f"rope_parameters.rope_type {kind!r} has no Megatron MLA equivalent (supported: default, yarn)")


def _parallel_fields(hf_config: Any, layout: Layout | None, recompute: str, cp_comm: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if recompute == "full":
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if layout is None:
        return fields
    if layout.num_layers != hf_config.num_hidden_layers:
        raise ValueError(f"the layout splits {layout.num_layers} layers; the model has {hf_config.num_hidden_layers}")
    stages = list(layout.pp_split)
    arch = arch_from_hf(hf_config)
    if bad := [s for s in layout.stage_first_layers if not arch.computes_index(s)]:
        raise ValueError(f"pipeline stages start at layers {bad}, which reuse a DSA top-k; valid starts: "
                         f"{arch.computing_layers()} (fix train.parallel.pp_layer_split / first / last)")
    fields.update({
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "context_parallel_size": layout.cp,
        "expert_model_parallel_size": layout.ep,
        "expert_tensor_parallel_size": layout.etp,
        "sequence_parallel": layout.sequence_parallel,
    })
    if len(stages) > 1:
        middle = stages[1:-1]
        if len(set(middle)) > 1:
            raise ValueError(f"Megatron splits pipelines as first / uniform middle / last; got stages {stages}")
        # THD packs differ in length: pipeline stages exchange each activation's shape first.
        fields["variable_seq_lengths"] = True
        fields["num_layers_in_first_pipeline_stage"] = stages[0]
        fields["num_layers_in_last_pipeline_stage"] = stages[-1]
    if layout.cp > 1:
        if cp_comm != "allgather":
            raise ValueError(f"train.parallel.cp_comm={cp_comm!r}: Megatron's DSAttention supports context "
                             "parallelism with all-gather only; set train.parallel.cp_comm=allgather")
        fields["cp_comm_type"] = "all_gather"
    return fields


def megatron_config_fields(hf_config: Any, layout: Layout | None = None, *, recompute: str = "none",
                           cp_comm: str = "allgather", use_te: bool = False, bf16: bool = True,
                           mtp_loss_scale: float = 0.1, expert_bias_update_rate: float = 0.0) -> dict[str, Any]:
    """The MLATransformerConfig keyword arguments for an HF GlmMoeDsaConfig (plain dict, testable).
    `layout`: the plan's trainer layout (None: one rank); `recompute` / `cp_comm`: train.parallel's."""
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ValueError("attention_bias / mlp_bias are set, but Megatron's DSA (AbsorbedMLA) has no linear biases")
    if hf_config.num_key_value_heads != hf_config.num_attention_heads:
        raise ValueError("MLA expects num_key_value_heads == num_attention_heads in the HF config")
    if hf_config.n_routed_experts and not hf_config.norm_topk_prob and hf_config.num_experts_per_tok > 1:
        raise ValueError("norm_topk_prob=False: Megatron's sigmoid router always normalises the top-k weights")
    freq, offset = dsa_schedule(hf_config)
    dtype = torch.bfloat16 if bf16 else torch.float32
    moe_layers = [1 if t == "sparse" else 0 for t in hf_config.mlp_layer_types]
    fields: dict[str, Any] = {
        # Trunk.
        "num_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        "ffn_hidden_size": hf_config.intermediate_size,
        "num_attention_heads": hf_config.num_attention_heads,
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "init_method_std": hf_config.initializer_range,
        "bf16": bf16,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "transformer_impl": "transformer_engine" if use_te else "local",
        "gradient_accumulation_fusion": False,  # needs apex/TE kernels
        # MLA: Megatron's qk_head_dim is the no-rope part; rope is MLA-interleaved inside attention.
        "multi_latent_attention": True,
        "q_lora_rank": hf_config.q_lora_rank,
        "kv_lora_rank": hf_config.kv_lora_rank,
        "qk_head_dim": hf_config.qk_nope_head_dim,
        "qk_pos_emb_head_dim": hf_config.qk_rope_head_dim,
        "v_head_dim": hf_config.v_head_dim,
        "qk_layernorm": True,  # q_a_layernorm / kv_a_layernorm
        "rotary_interleaved": False,
        "apply_rope_fusion": False,
        **_rope_fields(hf_config),
        # DSA, as transformers' GlmMoeDsaIndexer computes it: interleaved rope, no Hadamard
        # rotation, relu scoring, LayerNorm k_norm with eps 1e-6.
        "experimental_attention_variant": "dsa",
        "dsa_indexer_n_heads": hf_config.index_n_heads,
        "dsa_indexer_head_dim": hf_config.index_head_dim,
        "dsa_indexer_topk": hf_config.index_topk,
        "dsa_indexer_topk_freq": freq,
        "dsa_indexer_skip_topk_offset": offset,
        "dsa_indexer_rope_interleaved": True,
        "dsa_indexer_rotate_activation": False,
        "dsa_indexer_scoring_relu": True,
        "dsa_indexer_k_norm_epsilon": 1e-6,
        "dsa_indexer_loss_coeff": 0.0,  # indexer frozen in RL (REFERENCE section 2)
        # MoE: sigmoid scores, selection on score + expert bias, weights normalised then x scale.
        "num_moe_experts": hf_config.n_routed_experts or None,
        "moe_layer_freq": moe_layers,
        "moe_ffn_hidden_size": hf_config.moe_intermediate_size,
        "moe_shared_expert_intermediate_size": hf_config.moe_intermediate_size * hf_config.n_shared_experts or None,
        "moe_router_topk": hf_config.num_experts_per_tok,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        # 0: the bias stays what the inference engine routes with (RL must not drift the router).
        "moe_router_bias_update_rate": expert_bias_update_rate,
        "moe_router_topk_scaling_factor": hf_config.routed_scaling_factor,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": use_te,
        # The backend's loss is per token and already normalised over the step; the schedule must
        # leave it alone (agentrl.train.pipeline).
        "calculate_per_token_loss": True,
    }
    if hf_config.n_group and hf_config.n_group > 1:
        fields.update(moe_router_num_groups=hf_config.n_group, moe_router_group_topk=hf_config.topk_group)
    if num_mtp_layers(hf_config):
        fields.update(mtp_num_layers=num_mtp_layers(hf_config), mtp_loss_scaling_factor=mtp_loss_scale)
    fields.update(_parallel_fields(hf_config, layout, recompute, cp_comm))
    return fields


def transformer_config_from_hf(hf_config: Any, layout: Layout | None = None, *, recompute: str = "none",
                               cp_comm: str = "allgather", use_te: bool = False, bf16: bool = True,
                               mtp_loss_scale: float = 0.1, expert_bias_update_rate: float = 0.0,
                               **overrides: Any):
    """MLATransformerConfig for `hf_config`; `layout` is the plan's (None: one rank).

    `overrides` set any other TransformerConfig field (e.g. use_cpu_initialization)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = megatron_config_fields(hf_config, layout, recompute=recompute, cp_comm=cp_comm, use_te=use_te, bf16=bf16,
                                    mtp_loss_scale=mtp_loss_scale, expert_bias_update_rate=expert_bias_update_rate)
    fields.update(overrides)
    if fields.get("tensor_model_parallel_size", 1) > 1 and not fields.get("sequence_parallel"):
        raise ValueError("train.parallel.sequence_parallel=false with tp > 1: Megatron's AbsorbedMLA (DSA) "
                         "requires sequence parallelism at TP > 1; set train.parallel.sequence_parallel=true")
    return MLATransformerConfig(**fields)


def local_dsa_backend(qk_norm_eps: float | None = None, grouped_experts: bool = True):
    """BackendSpecProvider for the DSA spec without TransformerEngine.

    Every norm is agentrl.train.norms' sequence-parallel-capable one (input, pre-MLP, final, MTP,
    MLA q/kv latent, indexer k_norm). qk_norm_eps: epsilon of the q/kv latent RMSNorms. Megatron
    uses layernorm_epsilon (as SGLang does with rms_norm_eps); transformers' GlmMoeDsa uses 1e-6
    there, so parity runs against transformers pass 1e-6. grouped_experts: routed experts as
    agentrl.train.grouped_experts (two grouped GEMMs), else megatron's SequentialMLP loop."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.post_training.modelopt.layers import Linear

    from agentrl.train.norms import norm_class

    norm, latent_norm = norm_class(), norm_class(qk_norm_eps)

    class LocalDsaSpecProvider(LocalSpecProvider):
        def linear(self) -> type:
            return Linear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
            # The MLA latent norms are the RMS for_qk ones; the indexer's k_norm is for_qk LayerNorm.
            return latent_norm if rms_norm and for_qk and qk_norm_eps is not None else norm

        def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
            if grouped_experts:
                from agentrl.train.grouped_experts import GroupedExperts

                return GroupedExperts
            return super().grouped_mlp_modules(moe_use_grouped_gemm)

    return LocalDsaSpecProvider()


def _point_absorbed_mla_at_local_linear() -> None:
    """absorbed_mla imports modelopt's Linear only when TE is installed, and checks the spec's down
    projections against it; without TE its name is None and the DSA spec is rejected. Process-wide
    and idempotent: it only fills the missing name with the class the spec uses."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla

    if absorbed_mla.Linear is None:
        absorbed_mla.Linear = Linear
    elif absorbed_mla.Linear is not Linear:
        raise RuntimeError(f"absorbed_mla.Linear is {absorbed_mla.Linear}, not megatron's modelopt Linear")


def local_layer_specs(config: Any, backend: Any, pp_rank: int | None = None, vp_stage: int | None = None):
    """TransformerBlockSubmodules of one pipeline stage, built through `backend` (no TE needed)."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as eav
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    specs = eav.get_transformer_layer_with_experimental_attention_variant_spec(config=config, backend=backend)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    local_ids = range(offset, offset + count)
    eav._validate_dsa_index_share_pipeline_split(config, local_ids)
    return TransformerBlockSubmodules(layer_specs=[specs[i] for i in local_ids],
                                      layer_norm=backend.layer_norm(rms_norm=True, for_qk=False))


def build_gpt_model(hf_config: Any, layout: Layout | None = None, use_te: bool | None = None, *,
                    qk_norm_eps: float | None = None, grouped_experts: bool = True, **config_kwargs: Any):
    """GPTModel of this pipeline stage. Needs torch.distributed and megatron parallel_state
    initialised with the sizes of `layout` (None: one rank), and a CUDA device (or cpu_megatron).

    use_te: None picks TransformerEngine when importable. `config_kwargs` go to
    transformer_config_from_hf (bf16, mtp_loss_scale, or any TransformerConfig field).

    Forward with packed_seq_params (THD), one PackedSeqParams object per microbatch. Megatron
    0.19.2's DSA stores each forward's shared top-k as an attribute of packed_seq_params, else of
    the attention_mask tensor, else of the shared config. Measured on an H200 with full recompute:
    a mask tensor fails (recompute detaches it, dropping the top-k: "Holder has layers []"); the
    config works for one microbatch but, with several forwards before a backward (pipeline
    schedules), a recomputed layer would read a later microbatch's top-k; packed_seq_params is
    per microbatch and survives recompute. The model is fp32-normed: see
    to_bf16_keeping_fp32_router_bias."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_mtp_block_spec,
        get_gpt_mtp_block_spec_for_backend,
    )

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("initialise torch.distributed and megatron parallel_state before build_gpt_model")
    use_te = te_available() if use_te is None else use_te
    config = transformer_config_from_hf(hf_config, layout, use_te=use_te, **config_kwargs)
    if use_te:
        if qk_norm_eps is not None:
            raise ValueError("qk_norm_eps is only supported on the local (non-TE) backend")
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        block_spec = get_transformer_block_with_experimental_attention_variant_spec(config)
        mtp_spec = get_gpt_mtp_block_spec(config, block_spec, use_transformer_engine=True) if config.mtp_num_layers else None
    else:
        _point_absorbed_mla_at_local_linear()
        backend = local_dsa_backend(qk_norm_eps, grouped_experts)
        block_spec = local_layer_specs(config, backend)
        mtp_spec = get_gpt_mtp_block_spec_for_backend(config, block_spec, backend) if config.mtp_num_layers else None
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope",  # MLA applies rope inside attention; no model-level table
        rotary_base=int(config.rotary_base),
        mtp_block_spec=mtp_spec,
        parallel_output=True,
    )


def to_bf16_keeping_fp32_router_bias(model: torch.nn.Module) -> torch.nn.Module:
    """Cast a built model to bf16 as megatron's Float16Module does (without its `module.` wrapper,
    so parameter names stay those of mapping.py), keeping router.expert_bias in fp32 as the router
    itself does. Needed without TE: megatron's torch norms are created in fp32 regardless of
    params_dtype (seen on the H200: the DSA indexer k_norm rejected bf16 input)."""
    biases = {name: buf.detach().float().clone() for name, buf in model.named_buffers() if name.endswith("expert_bias")}
    model.bfloat16()
    for name, buf in model.named_buffers():
        if name in biases:
            buf.data = biases[name]
    return model
