"""HF GlmMoeDsaConfig -> Megatron MLATransformerConfig field mapping (the model itself builds on GPU)."""

from __future__ import annotations

import pytest
import torch
from glm_fixtures import tiny_config

from agentrl.config.layout import Layout
from agentrl.models.hf_config import hf_config_for
from agentrl.models.megatron_builder import megatron_config_fields


def test_glm_5_2_fields_match_the_reference_architecture():
    f = megatron_config_fields(hf_config_for("GLM-5.2"))
    expected = {
        "num_layers": 78, "hidden_size": 6144, "num_attention_heads": 64, "ffn_hidden_size": 12288,
        "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_head_dim": 192, "qk_pos_emb_head_dim": 64,
        "v_head_dim": 256, "layernorm_epsilon": 1e-5, "normalization": "RMSNorm", "qk_layernorm": True,
        "rope_type": "rope", "rotary_base": 8_000_000.0, "rotary_interleaved": False,
        "experimental_attention_variant": "dsa", "dsa_indexer_n_heads": 32, "dsa_indexer_head_dim": 128,
        "dsa_indexer_topk": 2048, "dsa_indexer_topk_freq": 4, "dsa_indexer_skip_topk_offset": 3,
        "dsa_indexer_rope_interleaved": True, "dsa_indexer_rotate_activation": False,
        "dsa_indexer_k_norm_epsilon": 1e-6, "num_moe_experts": 256, "moe_router_topk": 8,
        "moe_ffn_hidden_size": 2048, "moe_shared_expert_intermediate_size": 2048,
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": 2.5, "moe_router_dtype": "fp32", "mtp_num_layers": 1,
        "add_bias_linear": False, "gated_linear_unit": True, "bf16": True, "params_dtype": torch.bfloat16,
        "transformer_impl": "local", "moe_router_bias_update_rate": 0.0,
    }
    assert {k: f[k] for k in expected} == expected
    assert f["moe_layer_freq"] == [0, 0, 0] + [1] * 75
    assert f["activation_func"] is torch.nn.functional.silu
    assert "moe_router_num_groups" not in f  # n_group 1: plain top-k


def test_reference_parallel_layout():
    layout = Layout.resolve(world=32, tp=2, pp=4, cp=4, ep=8, pp_split=[18, 20, 20, 20], num_layers=78,
                            num_heads=64, n_experts=256)
    f = megatron_config_fields(hf_config_for("GLM-5.2"), layout, recompute="full", use_te=True)
    assert {k: f[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                              "context_parallel_size", "expert_model_parallel_size",
                              "expert_tensor_parallel_size", "sequence_parallel",
                              "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                              "recompute_granularity", "cp_comm_type", "moe_grouped_gemm",
                              "transformer_impl")} == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4, "context_parallel_size": 4,
        "expert_model_parallel_size": 8, "expert_tensor_parallel_size": 1, "sequence_parallel": True,
        "num_layers_in_first_pipeline_stage": 18, "num_layers_in_last_pipeline_stage": 20,
        "recompute_granularity": "full", "cp_comm_type": "all_gather", "moe_grouped_gemm": True,
        "transformer_impl": "transformer_engine"}


def test_pipeline_split_breaking_the_dsa_rule_is_rejected():
    layout = Layout.resolve(world=4, pp=4, pp_split=[20, 20, 20, 18], num_layers=78)  # starts 21, 41, 61
    with pytest.raises(ValueError, match=r"start at layers \[21, 41, 61\]"):
        megatron_config_fields(hf_config_for("GLM-5.2"), layout)


def test_tiny_and_five_layer_models():
    tiny = megatron_config_fields(tiny_config(mtp=0), bf16=False)
    assert tiny["moe_layer_freq"] == [0, 0, 1, 1, 1] and "mtp_num_layers" not in tiny
    assert (tiny["dsa_indexer_topk_freq"], tiny["dsa_indexer_skip_topk_offset"]) == (2, 2)
    assert tiny["qk_head_dim"] == 24 and tiny["params_dtype"] is torch.float32
    five = megatron_config_fields(hf_config_for("GLM-5.2_5layer", n_routed_experts=8))
    assert five["num_layers"] == 5 and five["num_moe_experts"] == 8 and five["hidden_size"] == 6144


def test_yarn_rope_and_unsupported_settings():
    yarn = hf_config_for("tiny", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 4096})
    f = megatron_config_fields(yarn)
    assert (f["rope_type"], f["rotary_scaling_factor"], f["original_max_position_embeddings"]) == ("yarn", 4.0, 4096)
    with pytest.raises(ValueError, match="attention_bias"):
        megatron_config_fields(hf_config_for("tiny", attention_bias=True))
    with pytest.raises(ValueError, match="norm_topk_prob"):
        megatron_config_fields(hf_config_for("tiny", norm_topk_prob=False))


@pytest.mark.slow  # imports megatron-core (~20-30 s on the shared dev machine)
def test_megatron_config_and_local_dsa_specs_build_on_cpu():
    from megatron.core.post_training.modelopt.layers import Linear

    from agentrl.models.megatron_builder import (
        local_dsa_backend,
        local_layer_specs,
        transformer_config_from_hf,
    )

    layout = Layout.resolve(world=4, pp=2, ep=2, pp_split=[3, 2], num_layers=5, n_experts=8)
    config = transformer_config_from_hf(tiny_config(mtp=1), layout, bf16=False)
    assert config.num_layers_in_first_pipeline_stage == 3 and config.mtp_num_layers == 1
    block = local_layer_specs(config, local_dsa_backend(qk_norm_eps=1e-6), pp_rank=1)
    assert len(block.layer_specs) == 2
    attn = block.layer_specs[0].submodules.self_attention
    assert attn.submodules.linear_q_down_proj is Linear
    assert attn.submodules.core_attention.submodules.indexer.submodules.linear_wk is Linear
    norm = attn.submodules.q_layernorm(config=config, hidden_size=8, eps=1e-5)
    # The project's sequence-parallel-capable norm, RMS for the MLA latents, with the override eps.
    from agentrl.train.norms import SequenceParallelNorm

    assert isinstance(norm, SequenceParallelNorm) and norm.kind == "RMSNorm" and norm.eps == 1e-6
