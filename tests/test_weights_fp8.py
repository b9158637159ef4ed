"""FP8 weight sync: projection weights go as float8_e4m3fn + weight_scale_inv, and the embedded
engine dequantises them on receipt (logits close to a bf16 push of the same weights)."""

from __future__ import annotations

import pytest
import torch

from agentrl.rollout.embedded.weights import WeightUpdateError, dequantize_fp8_weights
from agentrl.sync.nccl_export import quantize_named
from agentrl.sync.weights import push_weights


def _llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


def test_naming_and_dequantisation_on_receipt():
    w = torch.randn(256, 128)
    part = torch.randn(100, 200)  # partial edge blocks: ceil(100/128) x ceil(200/128) scales
    named = [("model.layers.0.mlp.down_proj.weight", w), ("model.embed_tokens.weight", torch.randn(256, 128)),
             ("model.layers.0.input_layernorm.weight", torch.randn(128)),
             ("model.layers.0.mlp.gate.weight", torch.randn(128, 128)),  # MoE router stays as it is
             ("model.layers.0.self_attn.o_proj.weight", part)]
    out = dict(quantize_named(named, fp8=True))
    assert list(out) == ["model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv",
                         "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                         "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.o_proj.weight",
                         "model.layers.0.self_attn.o_proj.weight_scale_inv"]
    back = dequantize_fp8_weights(out)
    assert all(t.dtype != torch.float8_e4m3fn for t in back.values()) and len(back) == 5
    for name, orig in (("model.layers.0.mlp.down_proj.weight", w), ("model.layers.0.self_attn.o_proj.weight", part)):
        q, s = out[name], out[name + "_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert s.shape == (-(-orig.shape[0] // 128), -(-orig.shape[1] // 128))
        step = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:orig.shape[0], :orig.shape[1]]
        # e4m3 round to nearest: half an ulp of 3 mantissa bits, or half the subnormal step 2^-9
        assert ((back[name] - orig).abs() <= orig.abs() * 2 ** -4 + step * 2 ** -10 + 1e-7).all()
    torch.testing.assert_close(out["model.layers.0.mlp.down_proj.weight_scale_inv"][1, 0], w[128:].abs().max() / 448)


def test_unpaired_or_misshapen_fp8_tensors_are_rejected():
    q = torch.zeros(128, 256).to(torch.float8_e4m3fn)
    with pytest.raises(WeightUpdateError, match="a.weight_scale_inv is missing"):
        dequantize_fp8_weights({"a.weight": q})
    with pytest.raises(WeightUpdateError, match="not of shape"):
        dequantize_fp8_weights({"a.weight": q, "a.weight_scale_inv": torch.ones(1, 1)})
    with pytest.raises(WeightUpdateError, match="no matching FP8 tensor"):
        dequantize_fp8_weights({"b.weight_scale_inv": torch.ones(1, 1)})


async def test_fp8_push_to_embedded_engine_matches_bf16_push(tmp_path):
    from agentrl.rollout.embedded.server import EmbeddedEngineServer

    served = _llama(0)
    new = {n: t.detach().to(torch.bfloat16) for n, t in _llama(1).state_dict().items()}
    server = EmbeddedEngineServer(served, model_path="test-fp8", max_batch_size=4)
    url = await server.start()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    try:
        before = served(ids).logits.detach()
        r = await push_weights([url], list(new.items()), 1, scratch_dir=str(tmp_path))
        assert not r["failed_engines"]
        bf16_logits = served(ids).logits.detach()
        bf16_bytes = r["sync_bytes"]
        r = await push_weights([url], list(new.items()), 2, scratch_dir=str(tmp_path), fp8=True)
        assert not r["failed_engines"]
        fp8_logits = served(ids).logits.detach()
    finally:
        await server.stop()
    assert not torch.allclose(before, bf16_logits)  # the push changed the model
    # 2 layers x 7 projections: their bytes halve (plus one fp32 scale per block)
    assert r["sync_bytes"] < 0.7 * bf16_bytes, (r["sync_bytes"], bf16_bytes)
    err = (fp8_logits - bf16_logits).abs().max() / bf16_logits.abs().max()
    assert 0 < err < 0.05, float(err)
    assert list(tmp_path.iterdir()) == []  # scratch buckets removed
