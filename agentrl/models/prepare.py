"""`prepare` and `prepare-cp`: HF checkpoint -> Megatron torch_dist checkpoint, HF checkpoint ->
block-FP8 HF checkpoint for the engines (`write_fp8_checkpoint`), and a verified, resumable copy of
a checkpoint onto node-local disk.

torch_dist on disk is a PyTorch DCP checkpoint (`.metadata` + `__<rank>_<n>.distcp`) plus Megatron's
`metadata.json` ({"sharded_backend": "torch_dist", ...}) and, in the legacy layout Megatron still
loads, a `common.pt` of non-tensor state. megatron.core.dist_checkpointing.save cannot run on a CPU
machine (its writer calls torch.cuda.synchronize in FileSystemWriterAsync.preload_tensors), so this
module writes the same format with torch.distributed.checkpoint directly. Keys and global shapes
are the ones GPTModel.sharded_state_dict() produces for a TP1/EP1/PP1 model, which are independent of
the parallel layout (Megatron reshards at load):
- non-homogeneous layers (first-k-dense) -> per-layer keys `decoder.layers.{global}.…`;
- routed experts -> one tensor per layer and linear, `…mlp.experts.experts.linear_fc1.weight` of
  shape [E, 2I, H] (SequentialMLP and TEGroupedMLP share these keys); GLU fc1 rows [gate; up];
- MTP -> `mtp.layers.{k}.transformer_layer.…` (MultiTokenPredictionLayer remaps mtp_model_layer).
Loading into a real GPTModel via dist_checkpointing.load is checked by bench/gpu/model_parity.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentrl.config.layout import Layout
from agentrl.models.mapping import (
    MegatronNaming,
    detect_hf_expert_format,
    mapping_rules,
    rule_to_megatron,
)
from agentrl.models.sharding import check_layout

MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
_EXPERT = re.compile(r"^(.*mlp\.experts\.)(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")
_MTP_INNER = re.compile(r"^(mtp\.layers\.\d+\.)mtp_model_layer\.")


def dist_checkpoint_key(megatron_name: str) -> tuple[str, int | None]:
    """(torch_dist key, expert index or None) of a full-model Megatron parameter name."""
    name = _MTP_INNER.sub(r"\1transformer_layer.", megatron_name)
    if m := _EXPERT.match(name):
        expert = m.group(2) if m.group(2) is not None else m.group(5)
        linear = m.group(3) or m.group(4)
        return f"{m.group(1)}experts.{linear}.weight", int(expert)
    return name, None


def read_hf_index(hf_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of an HF checkpoint folder (sharded or single file)."""
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: hf_dir / fname for name, fname in weight_map.items()}
    single = hf_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{hf_dir} has neither model.safetensors.index.json nor model.safetensors")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is no mapping)


def load_hf_config(hf_dir: Path) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(hf_dir))
    if config.model_type != "glm_moe_dsa":
        raise ValueError(f"{hf_dir}/config.json has model_type {config.model_type!r}; convert_hf_to_megatron "
                         "handles GLM-MoE-DSA (glm_moe_dsa) checkpoints only")
    return config


def convert_hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, layout: Layout | None = None, *,
                           use_te: bool = False, dtype: torch.dtype | None = None,
                           rank: int = 0, world_size: int = 1) -> Path:
    """Write a Megatron torch_dist checkpoint of the HF checkpoint in `hf_dir` to `out_dir`.

    layout: the plan's trainer layout, checked here (DSA stage starts, expert / head
    divisibility) so a bad layout fails before hours of conversion; the files do not depend on it.
    use_te: name the dense pre-MLP norm as the TE spec does (fused into linear_fc1).
    dtype: cast floating tensors (router.expert_bias stays fp32, as Megatron keeps it).
    rank / world_size: with torch.distributed initialised (gloo), each rank converts every
    world_size-th tensor group, so host memory per rank is ~1/world_size of the model.
    The result appears atomically: it is written to `<out_dir>.partial` and renamed when complete."""
    import torch.distributed.checkpoint as dcp

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    config = load_hf_config(hf_dir)
    if layout is not None:
        check_layout(config, layout)
        if config.num_attention_heads % layout.tp or config.vocab_size % layout.tp:
            raise ValueError(f"tp={layout.tp} must divide {config.num_attention_heads} heads and vocab {config.vocab_size}")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; remove it or pick another train megatron_dir")
    index = read_hf_index(hf_dir)
    rules = mapping_rules(config, MegatronNaming.for_backend(use_te), detect_hf_expert_format(index))
    needed = {k for r in rules if r.kind != "alias" for k in r.hf}
    if missing := sorted(needed - set(index)):
        raise ValueError(f"{hf_dir} lacks {len(missing)} tensors the config needs, e.g. {missing[:5]}")
    mine = [r for i, r in enumerate(r for r in rules if r.kind != "alias") if i % world_size == rank]
    state = _convert_rules(mine, index, dtype)
    partial = out_dir.with_name(out_dir.name + ".partial")
    if rank == 0 and partial.exists():
        shutil.rmtree(partial)
    if world_size > 1:
        torch.distributed.barrier()  # rank 0 has cleared a stale partial folder
    partial.mkdir(parents=True, exist_ok=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial)), no_dist=world_size == 1)
    if rank == 0:
        torch.save({"agentrl_source": str(hf_dir), "agentrl_use_te_names": use_te}, partial / "common.pt")
        (partial / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
        partial.rename(out_dir)
    return out_dir


def _convert_rules(rules: list, index: dict[str, Path], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    handles: dict[Path, Any] = {}
    try:
        for rule in rules:
            tensors = []
            for name in rule.hf:
                path = index[name]
                if path not in handles:
                    handles[path] = safe_open(str(path), framework="pt").__enter__()
                tensors.append(handles[path].get_tensor(name))
            for mg_name, t in zip(rule.mg, rule_to_megatron(rule, tensors), strict=True):
                if dtype is not None and t.is_floating_point() and not mg_name.endswith("router.expert_bias"):
                    t = t.to(dtype)
                key, expert = dist_checkpoint_key(mg_name)
                if expert is None:
                    state[key] = t
                else:
                    experts.setdefault(key, {})[expert] = t
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    for key, by_index in experts.items():
        state[key] = torch.stack([by_index[e] for e in range(len(by_index))])
    return state


def load_megatron_checkpoint(model: torch.nn.Module, ckpt_dir: str | Path) -> None:
    """Load a checkpoint written by convert_hf_to_megatron into a built GPTModel (any stage/layout).

    The conversion stores weights only: module `_extra_state` (None for megatron's own linears,
    FP8 metadata for TE ones) is left out of the request, as it is not in the files."""
    from megatron.core import dist_checkpointing

    sharded = {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}
    loaded = dist_checkpointing.load(sharded, str(ckpt_dir))
    # load() also returns the checkpoint's common (non-tensor) entries, e.g. our provenance record
    result = model.load_state_dict({k: v for k, v in loaded.items() if k in sharded}, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"{ckpt_dir} does not fit the model: missing {missing[:8]}, "
                         f"unexpected {result.unexpected_keys[:8]}")


def read_dist_checkpoint(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, whole, on CPU (inspection and tests)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(ckpt_dir))
    meta = reader.read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


# ---------------------------------------------------------------- prepare --fp8: the engines' checkpoint

# How DeepSeek-V3 / GLM-5 FP8 releases describe themselves in config.json; SGLang then serves the
# checkpoint as FP8 (no online quantisation), and weight updates send exactly its FP8 tensors.
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}


def write_fp8_checkpoint(hf_dir: str | Path, out_dir: str | Path, *, device: str | None = None) -> dict[str, int]:
    """Write `hf_dir` as a block-FP8 HF checkpoint in `out_dir`: every tensor agentrl.sync.fp8.fp8_rule
    names becomes float8_e4m3fn `<name>` + float32 `<name>_scale_inv` (128x128 blocks, kernels/
    fp8_quant), everything else is copied as it is; shard names, the index, the tokenizer and other
    files are kept; config.json gains `quantization_config`. Shard by shard (one shard in memory),
    quantised on `device` (default: CUDA when there is one; CPU gives the same bits). Written to
    `<out_dir>.partial` and renamed when complete. Returns counts of tensors converted and kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from agentrl.sync.buckets import SCALE_SUFFIX, TensorSpec
    from agentrl.sync.fp8 import fp8_rule, quantize

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    load_hf_config(hf_dir)  # a GLM-MoE-DSA checkpoint, or a clear error
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; remove it or pick another model.rollout_path")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    index = read_hf_index(hf_dir)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    counts = {"fp8": 0, "kept": 0}
    for shard in sorted(set(index.values())):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                t = f.get_tensor(name)
                if fp8_rule(TensorSpec.of(name, t)):
                    q, scale = quantize(t.to(device))
                    out[name], out[name + SCALE_SUFFIX] = q.cpu(), scale.cpu()
                    counts["fp8"] += 1
                else:
                    out[name] = t
                    counts["kept"] += 1
        save_file(out, str(partial / shard.name), metadata={"format": "pt"})
        weight_map.update({k: shard.name for k in out})
    (partial / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                     indent=1, sort_keys=True))
    for other in hf_dir.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name != "model.safetensors.index.json":
            shutil.copy2(other, partial / other.name)
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    partial.rename(out_dir)
    return counts


# ---------------------------------------------------------------- prepare-cp: verified local copy

MANIFEST = ".agentrl_copy_manifest.json"
_LOCK = ".agentrl_copy.lock"
_PARTIAL_SUFFIX = ".agentrl_partial"
_CHUNK = 16 << 20


@dataclass
class CopyReport:
    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already copied and verified
    recopied: list[str] = field(default_factory=list)  # destination was corrupt or stale
    bytes_copied: int = 0


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def copy_complete(dst: str | Path) -> bool:
    """True only when a copy finished and recorded every file (a partial copy never is)."""
    manifest = Path(dst) / MANIFEST
    return manifest.exists() and json.loads(manifest.read_text()).get("complete") is True


@contextmanager
def _exclusive(dst: Path) -> Iterator[None]:
    with open(dst / _LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another process is copying into {dst}; wait for it or remove it") from None
        yield


def _write_manifest(dst: Path, manifest: dict) -> None:
    tmp = dst / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, dst / MANIFEST)


def copy_checkpoint_to_local(src: str | Path, dst: str | Path, *, verify_existing: bool = True) -> CopyReport:
    """Copy the folder `src` to `dst` file by file, each checked by sha256 and renamed into place.

    Resumable: files recorded in dst's manifest (with the source's size and mtime) are skipped, after
    re-hashing the destination when `verify_existing` (so a corrupted local file is copied again).
    The manifest is marked complete only after the last file; `copy_complete(dst)` tells users."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"checkpoint source {src} is not a directory")
    dst.mkdir(parents=True, exist_ok=True)
    report = CopyReport()
    with _exclusive(dst):
        old = json.loads((dst / MANIFEST).read_text()) if (dst / MANIFEST).exists() else {}
        files = dict(old.get("files", {}))
        manifest = {"source": str(src), "complete": False, "files": files}
        _write_manifest(dst, manifest)  # incomplete from here until every file is verified
        for stale in dst.rglob(f"*{_PARTIAL_SUFFIX}"):
            stale.unlink()
        sources = sorted(p for p in src.rglob("*") if p.is_file())
        for path in sources:
            rel = path.relative_to(src).as_posix()
            st = path.stat()
            entry, target = files.get(rel), dst / rel
            if entry and _still_valid(entry, st, target, verify_existing):
                report.skipped.append(rel)
                continue
            files.pop(rel, None)  # not verified any more until the new copy lands
            digest = _copy_one(path, target)
            files[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
            _write_manifest(dst, manifest)
            report.bytes_copied += st.st_size
            (report.recopied if entry else report.copied).append(rel)
        for gone in set(files) - {p.relative_to(src).as_posix() for p in sources}:
            del files[gone]
        manifest["complete"] = True
        _write_manifest(dst, manifest)
    return report


def _still_valid(entry: dict, st: os.stat_result, target: Path, verify: bool) -> bool:
    """The recorded copy is of this very source file and the local file still holds it."""
    if entry["size"] != st.st_size or entry["mtime_ns"] != st.st_mtime_ns or not target.exists():
        return False
    return target.stat().st_size == st.st_size and (not verify or sha256_file(target) == entry["sha256"])


def _copy_one(src: Path, target: Path) -> str:
    """Copy to a temp name while hashing, fsync, re-hash what landed on disk, then rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + _PARTIAL_SUFFIX)
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    digest = h.hexdigest()
    if sha256_file(tmp) != digest:
        tmp.unlink()
        raise OSError(f"copy of {src} to {target} does not match the source (sha256); check the local disk")
    os.replace(tmp, target)
    return digest
