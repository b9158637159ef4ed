"""Which tensors an update sends in FP8, and the quantisation itself.

The reference way (REFERENCE.md section 3): engines serve a pre-converted block-FP8 HF checkpoint
(`prepare --fp8`, agentrl.models.prepare.write_fp8_checkpoint), and each update quantises exactly
the tensors that checkpoint holds in FP8: the names come from its `<name>_scale_inv` keys
(`fp8_names_of_checkpoint`). `fp8_rule` is what `prepare` converts in the first place, and the set
used when the engines load a named model that has no checkpoint on disk (the embedded engine):
- FP8: 2-D projection weights of attention and MLPs (dense, shared and routed experts), and the
  DSA indexer's `wq_b` / `wk` (SGLang 0.5.23 builds both with the model's quant_config:
  layers/attention/dsa/dsa_indexer.py);
- kept as they are: embeddings, the LM head, every norm, the MoE router (`mlp.gate`, plain
  ReplicatedLinear there), the indexer's `weights_proj` (bf16 params_dtype in SGLang; quantising it
  would perturb which keys the indexer selects) and the MTP layer's `eh_proj` (a plain nn.Linear in
  SGLang's nextn model).

Quantisation: kernels.fp8_quant (Triton) on CUDA, its bitwise-equal torch reference on CPU.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from agentrl.sync.buckets import SCALE_SUFFIX, TensorSpec

_KEPT = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "indexer.weights_proj", "eh_proj")
_INDEXER_FP8 = ("indexer.wq_b.weight", "indexer.wk.weight")


def fp8_rule(spec: TensorSpec) -> bool:
    """True for the tensors a block-FP8 checkpoint of a GLM/DeepSeek model stores in FP8."""
    if len(spec.shape) != 2 or any(k in spec.name for k in _KEPT):
        return False
    return spec.name.endswith("_proj.weight") or spec.name.endswith(_INDEXER_FP8)


def _safetensors_keys(path: Path) -> list[str]:
    """Tensor names of one .safetensors file, from its JSON header (no tensor is read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return [k for k in header if k != "__metadata__"]


def checkpoint_keys(folder: str | Path) -> list[str]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no model.safetensors.index.json and no .safetensors file")
    return [k for f in files for k in _safetensors_keys(f)]


def fp8_names_of_checkpoint(folder: str | Path) -> frozenset[str]:
    """Names of the weights a block-FP8 HF checkpoint stores in FP8: every `<name>` that has a
    `<name>_scale_inv` beside it. Empty for a bf16 checkpoint."""
    keys = set(checkpoint_keys(folder))
    return frozenset(k.removesuffix(SCALE_SUFFIX) for k in keys
                     if k.endswith(SCALE_SUFFIX) and k.removesuffix(SCALE_SUFFIX) in keys)


def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 128x128 block scales) of a 2-D weight; weight = q * scale_inv."""
    if t.is_cuda:
        from kernels.fp8_quant import fp8_block_quant

        return fp8_block_quant(t)
    from kernels.fp8_quant import reference_fp8_block_quant

    return reference_fp8_block_quant(t)


def to_wire(name: str, t: torch.Tensor, fp8: bool) -> list[tuple[str, torch.Tensor]]:
    """The wire tensors of one HF tensor (buckets.wire_entries' names and dtypes, with data)."""
    if not fp8:
        return [(name, t)]
    q, s = quantize(t)
    return [(name, q), (name + SCALE_SUFFIX, s)]
