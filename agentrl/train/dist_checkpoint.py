"""Sharded checkpoints of the Megatron backend: Megatron dist_checkpointing (torch_dist) of the model,
the fp32 masters and the Adam moments, across TP / PP / EP / CP, loadable at another layout.

Each trainable param's optimizer tensors are saved under the param's own sharding (its
ShardedTensor from GPTModel.sharded_state_dict, re-keyed `optimizer.<kind>.<key>`), so Megatron
reshards them at load exactly as it reshards the weights: a checkpoint written at EP2 loads at
TP2 x PP2. Replicated copies (TP-duplicated norms, DP and CP replicas) are written once (replica
ids). `common`: the version, the Adam step, the caller's `extra`, the writing layout (information
only), checked equal on every rank by dist_checkpointing.

Crash safety: every rank writes into `<dir>.tmp`; once all have finished, rank 0 moves an older
`<dir>` to `<dir>.old`, renames the new one to `<dir>` and removes `<dir>.old`. A kill at any
point leaves a whole checkpoint (`<dir>`, or `<dir>.old` between the two renames); a leftover
`.tmp` is discarded by the next save. Nothing is unpickled beyond tensors and plain containers: megatron
reads the common state with torch.load(weights_only=True) (serialization.load_common_state_dict),
so `extra` must be plain data (numbers, strings, lists, dicts).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from agentrl.train.cpu_shims import cpu_megatron

if TYPE_CHECKING:
    from agentrl.train.megatron_backend import MegatronBackend

OPTIMIZER_KINDS = ("master", "exp_avg", "exp_avg_sq")
FORMAT = "agentrl-megatron-1"


def _model_sharded(backend: MegatronBackend) -> dict:
    """GPTModel.sharded_state_dict without `_extra_state`, with the DSA indexer's replica ids fixed:
    megatron-core 0.19.2's modelopt Linear ("duplicated" over TP) passes tp_group=None with a DP
    group, so make_sharded_tensors_for_checkpoint gives every TP rank TP replica 0 and a TP > 1
    load fails its access-pattern check; the TP rank is the right replica index."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    out = {}
    for k, v in backend.model.sharded_state_dict().items():
        if k.endswith("_extra_state"):
            continue
        if ".indexer." in k and isinstance(getattr(v, "replica_id", None), tuple) and len(v.replica_id) == 3:
            v.replica_id = (v.replica_id[0], tp_rank, v.replica_id[2])
        out[k] = v
    return out


def _by_data(sharded: dict) -> dict[int, Any]:
    """id(param tensor) -> its ShardedTensor (or factory)."""
    return {id(v.data): v for v in sharded.values() if hasattr(v, "data") and isinstance(v.data, torch.Tensor)}


def _optimizer_tensors(backend: MegatronBackend) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Per trainable param: fp32 master (bf16 models only), exp_avg, exp_avg_sq; and the Adam step."""
    state = backend.optimizer.state_dict()["state"]
    out, step = [], 0
    for i, (_, p) in enumerate(backend.named_params):
        entry = state.get(i, {})
        step = max(step, int(entry.get("step", 0)))
        tensors = {k: (entry[k].float() if k in entry else torch.zeros(p.shape, dtype=torch.float32))
                   for k in ("exp_avg", "exp_avg_sq")}
        if p.dtype != torch.float32:
            master = backend.masters[i][1] if backend.masters else entry.get("master", p)
            tensors["master"] = master.detach().float()
        # On the host: a rank's optimizer state passes through host RAM, never through the GPU.
        out.append({k: t.reshape(p.shape).cpu() for k, t in tensors.items()})
    return out, step


def _full_state(backend: MegatronBackend, optimizer: list[dict[str, torch.Tensor]], common: dict) -> dict:
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    sharded = _model_sharded(backend)
    by_data = _by_data(sharded)
    for (name, p), tensors in zip(backend.named_params, optimizer, strict=True):
        model_sh = by_data.get(id(p))
        if model_sh is None:
            raise RuntimeError(f"{name}: no sharded-state entry for this trainable param")
        for kind, t in tensors.items():
            sharded[f"optimizer.{kind}.{name}"] = make_sharded_optimizer_tensor(model_sh, t, f"optimizer.{kind}")
    sharded["agentrl"] = common
    return sharded


def save_backend_checkpoint(backend: MegatronBackend, directory: Path, extra: dict) -> None:
    from megatron.core import dist_checkpointing

    tmp = directory.with_name(directory.name + ".tmp")
    if backend.coords.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    optimizer, step = _optimizer_tensors(backend)
    common = {"format": FORMAT, "version": backend.version, "adam_step": step, "extra": extra,
              "layout": backend.layout.to_json()}
    with cpu_megatron():
        dist_checkpointing.save(_full_state(backend, optimizer, common), str(tmp))
    dist.barrier()
    if backend.coords.rank == 0:
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if directory.exists():
            directory.rename(old)  # a kill from here on leaves <dir>.old or the new <dir>, both whole
        tmp.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_backend_checkpoint(backend: MegatronBackend, directory: Path) -> dict:
    from megatron.core import dist_checkpointing

    if not (directory / "metadata.json").exists():
        raise ValueError(f"{directory} is not a complete checkpoint (no metadata.json); a save that was killed "
                         f"leaves {directory.name}.tmp (incomplete) or {directory.name}.old (whole): resume from the "
                         "previous checkpoint")
    with cpu_megatron():
        common = dist_checkpointing.load_common_state_dict(str(directory)).get("agentrl", {})
    if common.get("format") != FORMAT:
        raise ValueError(f"{directory} was not written by the Megatron backend's save_checkpoint "
                         f"(format {common.get('format')!r}, expected {FORMAT!r})")
    optimizer, _ = _optimizer_tensors(backend)  # buffers of the right shapes for the load to fill
    request = _full_state(backend, optimizer, common={})
    request.pop("agentrl")
    if not _has_masters(directory):
        for key in [k for k in request if k.startswith("optimizer.master.")]:
            request.pop(key)
    with cpu_megatron():
        loaded = dist_checkpointing.load(request, str(directory))
    model_part = {k: v for k, v in loaded.items() if not k.startswith("optimizer.") and k != "agentrl"}
    result = backend.model.load_state_dict(model_part, strict=False)
    if missing := [k for k in result.missing_keys if not k.endswith("_extra_state")]:
        raise ValueError(f"{directory} lacks model tensors {missing[:6]}")
    _set_optimizer(backend, loaded, int(common["adam_step"]))
    backend._version = int(common["version"])
    return common["extra"]


def _has_masters(directory: Path) -> bool:
    from megatron.core import dist_checkpointing

    with cpu_megatron():
        keys = dist_checkpointing.load_tensors_metadata(str(directory)).keys()
    return any(k.startswith("optimizer.master.") for k in keys)


def _set_optimizer(backend: MegatronBackend, loaded: dict, step: int) -> None:
    """Masters and moments into the optimizer (torch AdamW or the disk Adam, same state format)."""
    state = {}
    for i, (name, p) in enumerate(backend.named_params):
        master = loaded.get(f"optimizer.master.{name}")
        entry = {"step": torch.tensor(float(step)), "exp_avg": loaded[f"optimizer.exp_avg.{name}"],
                 "exp_avg_sq": loaded[f"optimizer.exp_avg_sq.{name}"]}
        if backend.masters:
            with torch.no_grad():
                backend.masters[i][1].copy_(master if master is not None else p.detach().float())
        elif master is not None and p.dtype != torch.float32:
            entry["master"] = master
        state[i] = entry
    if step == 0:
        state = {}
    groups = backend.optimizer.state_dict()["param_groups"]
    backend.optimizer.load_state_dict({"state": state, "param_groups": groups})
