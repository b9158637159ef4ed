"""Tiny GLM-MoE-DSA state dicts for the mapping / sharding / prepare tests (CPU, seconds)."""

from __future__ import annotations

import torch

from agentrl.models.hf_config import hf_config_for


def tiny_config(mtp: int = 1, **overrides):
    """The named tiny model, with `mtp` MTP layers (the HF model itself never builds them)."""
    return hf_config_for("tiny", num_nextn_predict_layers=mtp, **overrides)


def tiny_hf_state(config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Real transformers parameter names and shapes, every tensor random (so a mix-up shows).

    MTP layers are taken from a deeper transformers model (its extra decoder layer has exactly the
    checkpoint's layer-N names), plus the MTP-only tensors of a released checkpoint."""
    from transformers import GlmMoeDsaForCausalLM

    n, k = config.num_hidden_layers, int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    deeper = hf_config_for("tiny", **{**_overrides(config), "num_hidden_layers": n + k,
                                       "num_nextn_predict_layers": 0})
    torch.manual_seed(seed)
    names = GlmMoeDsaForCausalLM(deeper).state_dict()
    gen = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(t.shape, generator=gen) for name, t in names.items()}
    h = config.hidden_size
    for j in range(n, n + k):
        p = f"model.layers.{j}."
        state[p + "enorm.weight"] = torch.randn(h, generator=gen)
        state[p + "hnorm.weight"] = torch.randn(h, generator=gen)
        state[p + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen)
        state[p + "shared_head.norm.weight"] = torch.randn(h, generator=gen)
        state[p + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        state[p + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    return state


def to_per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released-checkpoint layout: one gate/up/down tensor per routed expert."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"] = gate.clone()
                out[f"{base}{e}.up_proj.weight"] = up.clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e, w in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = w.clone()
        else:
            out[name] = t
    return out


def _overrides(config) -> dict:
    keys = ("num_hidden_layers", "n_routed_experts", "first_k_dense_replace", "index_topk_freq",
            "index_skip_topk_offset", "tie_word_embeddings")
    return {k: getattr(config, k) for k in keys if hasattr(config, k)}
