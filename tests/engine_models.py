"""Small random models the embedded-engine tests serve (a GLM-MoE-DSA and a Llama)."""

from __future__ import annotations

import torch

VOCAB = 512


def glm_model(seed: int = 0):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    # 32 indexer heads: with very few heads DSA scores tie at exactly 0 after ReLU and top-k
    # tie-breaking then depends on the kernel path (measured: 0.045 logit drift with 4 heads).
    cfg = GlmMoeDsaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
        q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, index_topk=8, index_head_dim=32,
        index_n_heads=32, first_k_dense_replace=1, index_topk_freq=2, index_skip_topk_offset=1,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return GlmMoeDsaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


def llama_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


def gemma3_model(seed: int = 0, sliding_window: int = 4):
    """Gemma 3's text stack with a 4-token sliding window on every layer but the last (the real
    270M model: 512 tokens on 5 of every 6 layers), so short prompts already cross the window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=sliding_window,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return Gemma3ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
