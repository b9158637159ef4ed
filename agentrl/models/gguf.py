"""GGUF checkpoints as plain, trainable HF models: the shared steps of the registry's small models.

transformers keeps a GGUF-loaded model tagged with its GGUF quantizer, which marks it neither
trainable nor serializable (and, with the `kernels` package present, keeps weights packed). The
de-quantised weights are therefore moved into a model built from the same config without the
quantization entry.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def load_dequantized(gguf: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The model in the .gguf file `gguf`, de-quantised to `dtype`, as a plain AutoModelForCausalLM."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=dtype, local_files_only=True,
        quantization_config=GgufConfig(dequantize=True),
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    # Non-persistent buffers (rotary inv_freq, Gemma's embedding scale) are not in the state dict.
    for name, buffer in loaded.named_buffers():
        module_name, _, buffer_name = name.rpartition(".")
        plain.get_submodule(module_name).register_buffer(buffer_name, buffer, persistent=False)
    return plain


def export_plain(out_dir: str | Path, load_tokenizer: Callable[[], Any],
                 load_model: Callable[[torch.dtype], PreTrainedModel]) -> Path:
    """De-quantise once into a plain HF folder (safetensors + tokenizer) at `out_dir`: written to a
    temporary sibling and renamed into place, so `out_dir` is either complete or absent."""
    import torch

    out = Path(out_dir).expanduser()
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it or load it with load_policy({str(out)!r})")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        load_tokenizer().save_pretrained(str(tmp))
        load_model(torch.float32).save_pretrained(str(tmp))
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
