"""HF configs of the named GLM models agree with the ModelArch table; the tiny model runs on CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from agentrl.models.arch import GLM_5_2, NAMED_ARCHS, TINY
from agentrl.models.hf_config import computing_layers, glm_model_names, hf_config_for
from agentrl.models.tiny import build_tiny_model

GLM_NAMES = [name for name, arch in NAMED_ARCHS.items() if arch.has_dsa]


def test_every_named_glm_arch_has_a_config():
    assert sorted(glm_model_names()) == sorted(GLM_NAMES)


@pytest.mark.parametrize("name", GLM_NAMES)
def test_hf_config_matches_model_arch(name):
    arch = NAMED_ARCHS[name]
    cfg = hf_config_for(name)
    assert isinstance(cfg, GlmMoeDsaConfig)
    assert cfg.model_type == "glm_moe_dsa" and cfg.architectures == ["GlmMoeDsaForCausalLM"]
    assert cfg.num_hidden_layers == arch.num_layers
    assert cfg.hidden_size == arch.hidden_size and cfg.vocab_size == arch.vocab_size
    assert cfg.num_attention_heads == arch.num_attention_heads
    assert cfg.n_routed_experts == arch.n_routed_experts
    assert cfg.num_experts_per_tok == arch.experts_per_token
    assert cfg.moe_intermediate_size == arch.moe_intermediate_size
    assert cfg.intermediate_size == arch.dense_intermediate_size
    assert cfg.mlp_layer_types == ["dense"] * arch.num_dense_layers + ["sparse"] * (
        arch.num_layers - arch.num_dense_layers
    )
    assert cfg.index_topk == arch.index_topk
    assert (cfg.index_topk_freq, cfg.index_skip_topk_offset) == (
        arch.index_topk_freq,
        arch.index_skip_topk_offset,
    )
    assert cfg.num_nextn_predict_layers == arch.num_mtp_layers
    # The schedule transformers derives must be the one the planner and Megatron split assume.
    assert len(cfg.indexer_types) == arch.num_layers
    for layer in range(1, arch.num_layers + 1):
        assert (cfg.indexer_types[layer - 1] == "full") == arch.computes_index(layer), layer
    assert computing_layers(cfg) == arch.computing_layers()


def test_glm_5_2_numbers():
    cfg = hf_config_for("GLM-5.2")
    assert (cfg.q_lora_rank, cfg.kv_lora_rank) == (2048, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (192, 64, 256)
    assert (cfg.n_shared_experts, cfg.routed_scaling_factor, cfg.norm_topk_prob) == (1, 2.5, True)
    assert (cfg.index_n_heads, cfg.index_head_dim) == (32, 128)
    assert cfg.rope_parameters["rope_theta"] == 8_000_000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.indexer_types.count("full") == 21 and cfg.indexer_types.count("shared") == 57
    assert computing_layers(cfg)[:5] == [1, 2, 3, 7, 11] and computing_layers(cfg)[-1] == 75
    five = hf_config_for("GLM-5.2_5layer")
    assert five.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 2
    assert five.num_nextn_predict_layers == 0 and five.hidden_size == 6144


def test_glm_5_2_parameter_count_matches_arch_table():
    with torch.device("meta"):  # shapes only, no memory
        model = GlmMoeDsaForCausalLM(hf_config_for("GLM-5.2"))
    total_b = sum(p.numel() for p in model.parameters()) / 1e9
    # The MTP layer is not in the HF module tree; the published total (744 B) includes it.
    assert total_b == pytest.approx(GLM_5_2.total_params_b, rel=0.01)


def test_config_round_trip_keeps_schedule_and_mtp():
    cfg = hf_config_for("tiny", num_nextn_predict_layers=1)
    again = GlmMoeDsaConfig(**cfg.to_dict())
    assert again.indexer_types == cfg.indexer_types
    assert (again.index_topk_freq, again.index_skip_topk_offset, again.num_nextn_predict_layers) == (2, 2, 1)


def test_overrides_rederive_schedule_and_reject_typos():
    deeper = hf_config_for("tiny", num_hidden_layers=8)
    assert deeper.indexer_types == ["full", "full", "shared", "full", "shared", "full", "shared", "full"]
    assert hf_config_for("tiny").rope_parameters is not hf_config_for("tiny").rope_parameters
    with pytest.raises(ValueError, match="unknown GlmMoeDsaConfig field.*num_layers"):
        hf_config_for("tiny", num_layers=3)
    with pytest.raises(ValueError, match="not GLM-MoE-DSA"):
        hf_config_for("smollm2-135m")
    with pytest.raises(ValueError, match="unknown model name"):
        hf_config_for("GLM-9")


def test_tiny_config_exercises_every_feature():
    cfg = hf_config_for("tiny")
    assert cfg.q_lora_rank and cfg.kv_lora_rank  # MLA
    assert cfg.v_head_dim != cfg.qk_nope_head_dim
    assert "shared" in cfg.indexer_types and cfg.index_topk < 64  # DSA with sharing, sparse at short length
    assert cfg.n_shared_experts == 1 and cfg.first_k_dense_replace == TINY.num_dense_layers >= 1
    assert cfg.index_head_dim >= cfg.qk_rope_head_dim


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(seed=0)


def test_tiny_forward_backward_and_indexer_ownership(tiny):
    model = tiny
    model.train()
    ids = torch.randint(0, TINY.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 24, TINY.vocab_size) and torch.isfinite(out.loss)
    out.loss.backward()
    owners = sorted({int(n.split(".")[2]) + 1 for n, _ in model.named_parameters() if ".indexer." in n})
    assert owners == TINY.computing_layers() == [1, 2, 4]  # shared layers own no indexer weights
    for name, param in model.named_parameters():
        if ".indexer." in name:
            # transformers runs the indexer under no_grad: it is frozen in the torch path.
            assert param.grad is None, name
        else:
            assert param.grad is not None and torch.isfinite(param.grad).all(), name
    model.zero_grad(set_to_none=True)
    model.eval()


def test_tiny_attention_is_sparse_beyond_index_topk(tiny):
    ids = torch.randint(0, TINY.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    dense = build_tiny_model(seed=0)
    dense.config.index_topk = 1000  # every indexer then keeps all keys
    for layer in dense.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = 1000
    with torch.no_grad():
        sparse_logits, dense_logits = tiny(input_ids=ids).logits, dense(input_ids=ids).logits
    k = TINY.index_topk
    # Up to position k every key is selected anyway; after it, top-k drops keys and changes the output.
    torch.testing.assert_close(sparse_logits[:, :k], dense_logits[:, :k])
    assert not torch.allclose(sparse_logits[:, k:], dense_logits[:, k:])


def test_tiny_router_bias_is_random_and_changes_routing(tiny):
    biases = [b for n, b in tiny.named_buffers() if n.endswith("e_score_correction_bias")]
    assert len(biases) == TINY.num_layers - TINY.num_dense_layers
    assert all(b.abs().sum() > 0 for b in biases)
    ids = torch.randint(0, TINY.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    unbiased = build_tiny_model(seed=0)
    for name, buf in unbiased.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.zero_()
    with torch.no_grad():
        assert not torch.allclose(tiny(input_ids=ids).logits, unbiased(input_ids=ids).logits)


def test_tiny_init_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_model(seed=5).state_dict()
    after = torch.rand(1)
    assert torch.equal(before, after)
    b = build_tiny_model(seed=5).state_dict()
    c = build_tiny_model(seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
