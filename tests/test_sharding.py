"""TP / EP / PP shard and unshard of the tiny GLM's Megatron state dict, on CPU, bitwise."""

from __future__ import annotations

import pytest
import torch
from glm_fixtures import tiny_config, tiny_hf_state

from agentrl.config.layout import Layout
from agentrl.models.mapping import MegatronNaming, hf_to_megatron
from agentrl.models.sharding import RankCoord, shard_state_dict, tp_kind, unshard_state_dict


def ShardLayout(tp: int = 1, ep: int = 1, etp: int = 1, pp_split: tuple[int, ...] = (5,)) -> Layout:
    """A layout with these sharding sizes (DP fills the world so EP x ETP fits a stage)."""
    return Layout(tp=tp, pp=len(pp_split), cp=1, ep=ep, etp=etp, dp=max(1, ep * etp // tp), pp_split=pp_split)


@pytest.fixture(scope="module")
def config():
    return tiny_config(mtp=1)


@pytest.fixture(scope="module")
def mg_state(config):
    return hf_to_megatron(tiny_hf_state(config), config)


def _round_trip(state, config, layout):
    shards = shard_state_dict(state, config, layout)
    back = unshard_state_dict(shards, config, layout)
    assert set(back) == set(state)
    for k in state:
        assert torch.equal(back[k], state[k]), k
    return shards


def test_tp2(config, mg_state):
    shards = _round_trip(mg_state, config, ShardLayout(tp=2))
    r0, r1 = shards[RankCoord(0, 0, 0)], shards[RankCoord(0, 1, 0)]
    proj = "decoder.layers.2.self_attention.linear_proj.weight"  # row parallel
    assert torch.equal(torch.cat([r0[proj], r1[proj]], dim=1), mg_state[proj])
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"  # GLU: each rank holds [gate_r; up_r]
    gate, up = mg_state[fc1].chunk(2)
    assert torch.equal(r1[fc1], torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    kv_up = "decoder.layers.0.self_attention.linear_kv_up_proj.weight"  # whole heads per rank
    assert r0[kv_up].shape[0] == mg_state[kv_up].shape[0] // 2
    assert r0["embedding.word_embeddings.weight"].shape[0] == 512  # vocab parallel
    wk = "decoder.layers.0.self_attention.core_attention.indexer.linear_wk.weight"
    assert torch.equal(r0[wk], r1[wk])  # duplicated indexer
    expert = "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"  # etp 1: whole
    assert torch.equal(r1[expert], mg_state[expert])


def test_ep2(config, mg_state):
    shards = _round_trip(mg_state, config, ShardLayout(ep=2))
    r1 = shards[RankCoord(0, 0, 1)]
    assert torch.equal(r1["decoder.layers.4.mlp.experts.local_experts.0.linear_fc2.weight"],
                       mg_state["decoder.layers.4.mlp.experts.local_experts.4.linear_fc2.weight"])
    assert not any("local_experts.4." in k for k in r1)
    assert torch.equal(r1["mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.3.linear_fc1.weight"],
                       mg_state["mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.7.linear_fc1.weight"])


def test_pp2_obeys_the_dsa_rule_and_renumbers_layers(config, mg_state):
    shards = _round_trip(mg_state, config, ShardLayout(pp_split=(3, 2)))  # stage 2 starts at layer 4
    first, last = shards[RankCoord(0, 0, 0)], shards[RankCoord(1, 0, 0)]
    assert "output_layer.weight" not in first and "decoder.final_layernorm.weight" in last
    assert "embedding.word_embeddings.weight" in first and "embedding.word_embeddings.weight" in last  # MTP
    assert torch.equal(last["decoder.layers.0.self_attention.core_attention.indexer.linear_wk.weight"],
                       mg_state["decoder.layers.3.self_attention.core_attention.indexer.linear_wk.weight"])
    assert not any(k.startswith("decoder.layers.2.") for k in last)
    assert any(k.startswith("mtp.layers.0.") for k in last) and not any(k.startswith("mtp.") for k in first)
    with pytest.raises(ValueError, match=r"starting at layers \[3\].*\[1, 2, 4\]"):
        shard_state_dict(mg_state, config, ShardLayout(pp_split=(2, 3)))


def test_pp2_without_mtp_keeps_embedding_on_first_stage_only():
    config = tiny_config(mtp=0)
    state = hf_to_megatron(tiny_hf_state(config, seed=2), config)
    shards = _round_trip(state, config, ShardLayout(pp_split=(3, 2)))
    assert "embedding.word_embeddings.weight" not in shards[RankCoord(1, 0, 0)]


def test_tp2_ep2_pp2_with_te_names_and_expert_tp(config):
    te = MegatronNaming.for_backend(use_te=True)
    state = hf_to_megatron(tiny_hf_state(config, seed=3), config, te)
    shards = _round_trip(state, config, ShardLayout(tp=2, ep=2, etp=2, pp_split=(3, 2)))
    assert len(shards) == 8
    local = shards[RankCoord(1, 1, 1)]["decoder.layers.1.mlp.experts.linear_fc2.weight2"]
    full = state["decoder.layers.4.mlp.experts.linear_fc2.weight6"]
    assert torch.equal(local, full.chunk(2, dim=1)[1])  # expert fc2 row-split over etp


def test_inconsistent_replicas_are_detected(config, mg_state):
    layout = ShardLayout(tp=2)
    shards = shard_state_dict(mg_state, config, layout)
    name = "decoder.layers.1.input_layernorm.weight"
    shards[RankCoord(0, 1, 0)][name] = shards[RankCoord(0, 1, 0)][name] + 1
    with pytest.raises(ValueError, match="replicated copies differ"):
        unshard_state_dict(shards, config, layout)


def test_indivisible_sizes_are_rejected(config, mg_state):
    with pytest.raises(ValueError, match="does not divide 8 routed experts"):
        shard_state_dict(mg_state, config, ShardLayout(ep=3))
    with pytest.raises(ValueError, match="does not split 3 ways"):
        shard_state_dict(mg_state, config, ShardLayout(tp=3))


def test_tp_kinds():
    assert tp_kind("output_layer.weight") == "column"
    assert tp_kind("decoder.layers.3.self_attention.linear_q_down_proj.weight") == "replicated"
    assert tp_kind("mtp.layers.0.eh_proj.weight") == "column"
    assert tp_kind("decoder.layers.2.mlp.shared_experts.linear_fc2.weight") == "row"


def test_pp2_with_tied_weights_gives_the_last_stage_a_copy_of_the_embedding():
    config = tiny_config(mtp=0, tie_word_embeddings=True)
    hf = {k: v for k, v in tiny_hf_state(config).items() if k != "lm_head.weight"}  # tied: one tensor
    state = hf_to_megatron(hf, config)
    assert "output_layer.weight" not in state
    shards = _round_trip(state, config, ShardLayout(tp=2, pp_split=(3, 2)))
    for tp in (0, 1):
        head = shards[RankCoord(1, tp, 0)]["output_layer.weight"]
        assert torch.equal(head, shards[RankCoord(0, tp, 0)]["embedding.word_embeddings.weight"])
        assert "embedding.word_embeddings.weight" not in shards[RankCoord(1, tp, 0)]
