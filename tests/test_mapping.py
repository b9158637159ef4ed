"""HF <-> Megatron weight mapping of the tiny GLM-MoE-DSA: names, layouts, exact round trip."""

from __future__ import annotations

import pytest
import torch
from glm_fixtures import tiny_config, tiny_hf_state, to_per_expert

from agentrl.models.mapping import (
    MegatronNaming,
    arch_from_hf,
    dsa_schedule,
    hf_to_megatron,
    megatron_computes_index,
    megatron_to_hf,
)


@pytest.fixture(scope="module")
def config():
    return tiny_config(mtp=1)


@pytest.fixture(scope="module")
def hf_state(config):
    return tiny_hf_state(config)


def _assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k, t in a.items():
        assert t.dtype == b[k].dtype and torch.equal(t, b[k]), k


def test_round_trip_is_bitwise(config, hf_state):
    mg = hf_to_megatron(hf_state, config)
    _assert_same(megatron_to_hf(mg, config), hf_state)


def test_round_trip_keeps_bf16_and_fp32_dtypes(config, hf_state):
    mixed = {k: (v if "gate.weight" in k or "e_score" in k else v.to(torch.bfloat16)) for k, v in hf_state.items()}
    _assert_same(megatron_to_hf(hf_to_megatron(mixed, config), config), mixed)


def test_per_expert_checkpoint_layout_maps_to_the_same_megatron_state(config, hf_state):
    per_expert = to_per_expert(hf_state)
    mg = hf_to_megatron(per_expert, config)
    _assert_same(mg, hf_to_megatron(hf_state, config))
    _assert_same(megatron_to_hf(mg, config, hf_experts="per_expert"), per_expert)


def test_indexer_only_on_computing_layers_and_mtp(config, hf_state):
    mg = hf_to_megatron(hf_state, config)
    with_indexer = sorted({int(k.split(".")[2]) for k in mg
                           if k.startswith("decoder.layers.") and ".indexer." in k})
    assert with_indexer == [0, 1, 3]  # tiny: layers 1, 2, 4 compute (offset 2, freq 2)
    assert [layer - 1 for layer in arch_from_hf(config).computing_layers()] == with_indexer
    assert "mtp.layers.0.mtp_model_layer.self_attention.core_attention.indexer.linear_wk.weight" in mg


def test_fused_and_renamed_tensors(config, hf_state):
    mg = hf_to_megatron(hf_state, config)
    p = "model.layers.0.mlp."
    assert torch.equal(mg["decoder.layers.0.mlp.linear_fc1.weight"],
                       torch.cat([hf_state[p + "gate_proj.weight"], hf_state[p + "up_proj.weight"]]))
    gate_up = hf_state["model.layers.3.mlp.experts.gate_up_proj"]
    assert torch.equal(mg["decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"], gate_up[5])
    assert torch.equal(mg["decoder.layers.3.mlp.router.expert_bias"],
                       hf_state["model.layers.3.mlp.gate.e_score_correction_bias"])
    assert torch.equal(mg["decoder.layers.2.self_attention.linear_kv_up_proj.weight"],
                       hf_state["model.layers.2.self_attn.kv_b_proj.weight"])
    assert torch.equal(mg["mtp.layers.0.final_layernorm.weight"], hf_state["model.layers.5.shared_head.norm.weight"])
    assert not any("router" in k for k in mg if k.startswith(("decoder.layers.0.", "decoder.layers.1.")))
    assert not any("embed_tokens" in k or "shared_head.head" in k for k in mg)


def test_transformer_engine_naming(config, hf_state):
    te = MegatronNaming.for_backend(use_te=True)
    mg = hf_to_megatron(hf_state, config, te)
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in mg
    assert "decoder.layers.0.pre_mlp_layernorm.weight" not in mg
    assert "decoder.layers.2.pre_mlp_layernorm.weight" in mg  # MoE layers keep a separate norm
    assert "decoder.layers.2.mlp.experts.linear_fc2.weight7" in mg
    _assert_same(megatron_to_hf(mg, config, te), hf_state)


def test_missing_and_unexpected_names_are_reported(config, hf_state):
    broken = dict(hf_state)
    del broken["model.layers.3.self_attn.indexer.wk.weight"]
    broken["model.layers.2.self_attn.indexer.wk.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing 1 .*layers\.3\.self_attn\.indexer\.wk.*unexpected 1 .*layers\.2"):
        hf_to_megatron(broken, config)


def test_mtp_embedding_copy_must_equal_the_main_one(config, hf_state):
    broken = dict(hf_state)
    broken["model.layers.5.embed_tokens.weight"] = broken["model.layers.5.embed_tokens.weight"] + 1
    with pytest.raises(ValueError, match="embed_tokens.*differs"):
        hf_to_megatron(broken, config)


def test_checkpoint_without_mtp_copies_still_maps(config, hf_state):
    trimmed = {k: v for k, v in hf_state.items() if "layers.5.embed_tokens" not in k and "shared_head.head" not in k}
    mg = hf_to_megatron(trimmed, config)
    _assert_same(megatron_to_hf(mg, config, mtp_aliases=False), trimmed)


def test_model_without_mtp():
    config = tiny_config(mtp=0)
    state = tiny_hf_state(config, seed=1)
    mg = hf_to_megatron(state, config)
    assert not any(k.startswith("mtp.") for k in mg)
    _assert_same(megatron_to_hf(mg, config), state)


def test_megatron_rule_matches_hf_schedule_for_glm_5_2():
    from agentrl.models.arch import GLM_5_2

    for layer in range(1, 79):
        assert megatron_computes_index(layer, 4, 3) == GLM_5_2.computes_index(layer)


def test_schedule_that_megatron_cannot_express_is_rejected():
    config = tiny_config(mtp=0)
    config.indexer_types = ["full", "shared", "full", "full", "shared"]
    with pytest.raises(ValueError, match="indexer_types"):
        dsa_schedule(config)
