"""Random-init tiny GLM-MoE-DSA models and checkpoints (transformers' GlmMoeDsaForCausalLM).

The tiny model exercises every GLM-5.2 feature at toy size (see hf_config._TINY_DIMS), so the whole
RL loop, weight sync and HF <-> Megatron mapping can be tested on a CPU in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.models.arch import TINY

if TYPE_CHECKING:
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

# transformers initialises e_score_correction_bias to zeros, which would leave the biased expert
# selection (score + bias) untested. Router scores are sigmoid(logits) with logits of ~0.2 at init,
# so a bias of std 0.1 changes which experts win for a good share of tokens without swamping them.
ROUTER_BIAS_STD = 0.1


def randomize_router_bias(model: torch.nn.Module, seed: int) -> int:
    """Fill every `e_score_correction_bias` buffer with N(0, ROUTER_BIAS_STD^2) noise drawn from its own
    generator (the global RNG is untouched). Returns the number of buffers filled."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    count = 0
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            noise = torch.randn(buffer.shape, generator=generator, dtype=torch.float32) * ROUTER_BIAS_STD
            with torch.no_grad():
                buffer.copy_(noise.to(buffer.dtype))
            count += 1
    return count


def build_tiny_model(
    seed: int = 0, *, mtp: bool = False, dtype: torch.dtype | None = None
) -> GlmMoeDsaForCausalLM:
    """A random-init tiny GlmMoeDsaForCausalLM; the same seed gives the same weights.

    With `mtp`, the config records one MTP layer (`num_nextn_predict_layers=1`); transformers has
    no MTP module, so the layer's weights exist only in checkpoints (write_tiny_checkpoint)."""
    import torch
    from transformers import GlmMoeDsaForCausalLM

    from agentrl.models.hf_config import hf_config_for

    config = hf_config_for(TINY.name, num_nextn_predict_layers=1 if mtp else 0)
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = GlmMoeDsaForCausalLM(config)
    randomize_router_bias(model, seed)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def tiny_mtp_state_dict(config: GlmMoeDsaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of one MTP layer under the name `model.layers.{num_hidden_layers}.*`, the layout
    of released GLM/DeepSeek checkpoints (GLM-5.2: model.layers.78.*): eh_proj, enorm, hnorm,
    shared_head.norm, plus one full decoder layer (MoE MLP, its own indexer). The embedding and the
    output head are shared with the main model and are not repeated."""
    import torch
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer

    from agentrl.models.hf_config import hf_config_for

    depth = config.num_hidden_layers
    # A config one layer deeper gives the MTP block transformers' own decoder layer at index `depth`;
    # the MTP block has no earlier layer to borrow a top-k from, so its indexer always computes.
    deeper = hf_config_for(
        TINY.name, num_hidden_layers=depth + 1, indexer_types=[*config.indexer_types, "full"]
    )
    hidden = config.hidden_size
    generator = torch.Generator().manual_seed(seed + 1)
    std = config.initializer_range
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        layer = GlmMoeDsaDecoderLayer(deeper, layer_idx=depth)
        # nn.Module init leaves some params uninitialised (torch.empty); give every matrix N(0, std).
        for name, param in layer.named_parameters():
            with torch.no_grad():
                if param.dim() >= 2:
                    param.copy_(torch.randn(param.shape, generator=generator) * std)
                elif "norm" in name and name.endswith("weight"):
                    param.fill_(1.0)
                else:
                    param.zero_()
    randomize_router_bias(layer, seed + 1)
    prefix = f"model.layers.{depth}."
    tensors = {prefix + k: v.detach().clone() for k, v in layer.state_dict().items()}
    tensors[prefix + "eh_proj.weight"] = torch.randn((hidden, 2 * hidden), generator=generator) * std
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[prefix + f"{norm}.weight"] = torch.ones(hidden)
    return tensors


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0, *, mtp: bool = False) -> Path:
    """Write a random-init tiny GLM checkpoint: model.safetensors, config.json, generation_config.json
    and the tiny tokenizer files. It loads offline with AutoModelForCausalLM/AutoTokenizer.from_pretrained.

    Refuses a folder that already holds a config.json, so an existing checkpoint is never overwritten."""
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    from agentrl.models.tokenizer import build_tiny_tokenizer, stop_token_ids

    out = Path(out_dir).expanduser()
    if (out / "config.json").exists():
        raise FileExistsError(
            f"{out / 'config.json'} exists; choose an empty or new folder for the tiny checkpoint"
        )
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(seed, mtp=mtp)
    tokenizer = build_tiny_tokenizer(out)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stop_token_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(str(out))
    if mtp:
        weights = out / "model.safetensors"
        tensors = load_file(str(weights))
        tensors.update(tiny_mtp_state_dict(model.config, seed))
        save_file(tensors, str(weights), metadata={"format": "pt"})
    (out / "agentrl_init.json").write_text(json.dumps({"model": TINY.name, "seed": seed, "mtp": mtp}) + "\n")
    return out
