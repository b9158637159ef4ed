"""Fail-fast validation of a GLM checkpoint folder before any node loads it.

A wrong folder (another model, a pruned copy, a repo that needs remote code) would otherwise surface
minutes later as a shape mismatch deep inside Megatron or SGLang on every node at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentrl.models.arch import NAMED_ARCHS, get_arch
from agentrl.models.hf_config import ARCHITECTURE, MODEL_TYPE


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used; the message names the file, the field and the fix."""


def _mismatch(config_file: Path, field: str, found: Any, expected: Any, fix: str) -> CheckpointError:
    return CheckpointError(f"{config_file}: field {field!r} is {found!r}, expected {expected!r}; {fix}")


def validate_glm_checkpoint(path: str | Path, model_name: str = "GLM-5.2") -> dict[str, Any]:
    """Check that `path` holds an HF checkpoint of the named GLM model and return its config.json.

    Requires model_type "glm_moe_dsa", architectures ["GlmMoeDsaForCausalLM"], num_hidden_layers equal
    to the named model's depth (78 for GLM-5.2, 5 for GLM-5.2_5layer) and no `auto_map` (transformers
    ships the model; remote code would be a second, unreviewed copy). Raises CheckpointError."""
    arch = get_arch(model_name)
    if not arch.has_dsa:
        raise ValueError(
            f"model {model_name!r} is not a GLM-MoE-DSA model; validate_glm_checkpoint checks GLM models"
        )
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(
            f"checkpoint folder {folder} does not exist (or is not a folder); set model.path to the folder "
            f"that holds the {model_name} config.json and *.safetensors"
        )
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"{config_file} not found; {folder} is not an HF checkpoint: point model.path at the folder that "
            f"holds the {model_name} config.json"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{config_file} is not valid JSON ({exc}); re-download or re-export the checkpoint's config.json"
        ) from None
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{config_file} holds a JSON {type(config).__name__}, expected an object; "
            "re-download or re-export the checkpoint's config.json"
        )

    found = config.get("model_type")
    if found != MODEL_TYPE:
        raise _mismatch(
            config_file,
            "model_type",
            found,
            MODEL_TYPE,
            f"this is not a {model_name} checkpoint; point model.path at a GLM-MoE-DSA checkpoint",
        )
    found = config.get("architectures")
    if found != [ARCHITECTURE]:
        raise _mismatch(
            config_file,
            "architectures",
            found,
            [ARCHITECTURE],
            f'set "architectures": ["{ARCHITECTURE}"] (the causal-LM head transformers and SGLang load)',
        )
    found = config.get("num_hidden_layers")
    if found != arch.num_layers:
        glm = [a for a in NAMED_ARCHS.values() if a.has_dsa and a.name != model_name]
        matching = [a.name for a in glm if a.num_layers == found]
        hint = (
            f"it matches model.name {' or '.join(matching)}"
            if matching
            else "GLM names and depths: " + ", ".join(f"{a.name} ({a.num_layers})" for a in glm)
        )
        raise _mismatch(
            config_file,
            "num_hidden_layers",
            found,
            arch.num_layers,
            f"the checkpoint is not {model_name}: set the matching model.name or point at the right folder ({hint})",
        )
    if "auto_map" in config:
        raise CheckpointError(
            f"{config_file}: field 'auto_map' is present ({config['auto_map']!r}), expected no auto_map; "
            "agentrl uses transformers' own GlmMoeDsa implementation and never runs remote code: "
            "delete the auto_map entry (and any modeling_*.py next to it)"
        )
    return config
