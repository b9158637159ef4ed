"""Weight updates for the embedded engine: tensor payloads, the broadcast group, the checks.

`/update_weights_from_tensor` takes `serialized_named_tensors`, a list with one item per TP rank
(the embedded engine has one rank), in one of these formats:
- load_format None, "direct" or "flattened_bucket": SGLang 0.5.23's own payload, decoded as SGLang
  decodes it (agentrl.sync.tensor_ipc): base64 of a pickled [(name, tensor)] list (or a flattened
  bucket), through an allowlist of tensor rebuilds; CUDA tensors arrive as IPC handles of a
  trainer on the same GPU (named by uuid), CPU tensors as bytes;
- load_format "safetensors_b64": the item is base64 of safetensors bytes of {hf_name: tensor};
- load_format "safetensors_path": the item is the path of a .safetensors file on this host
  (e.g. under /dev/shm), read and left in place; the caller owns and removes the file.

Names are checkpoint (HF) names, as SGLang loads them: routed experts per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`) land in transformers' fused `gate_up_proj` /
`down_proj` (gate rows first); tensors of layers the model does not build (the MTP layers
`model.layers.{N+k}`, which transformers leaves out, as it does when loading a checkpoint) are
received and counted but not served.

`/init_weights_update_group` joins a group the trainer hosts exactly as SGLang 0.5.23 builds
its own (utils/common.py init_custom_process_group): a tcp:// store at master_address:master_port
(the trainer, rank 0, serves it), wrapped in PrefixStore(group_name), then torch's process-group
helper (which prefixes again with "group_name/"), so the trainer's side
(agentrl.sync.nccl_export.init_weights_update_group) meets SGLang and this engine alike. Every
rendezvous and broadcast has a timeout (`timeout_s`), so a dead trainer is an error, not a hang.

`/update_weights_from_distributed` with load_format "flattened_bucket" receives ONE uint8 buffer:
the tensors' bytes back to back in `names` order, several dtypes, no padding; a tensor whose byte
offset is not a multiple of its dtype's itemsize is refused before anything is received, as
SGLang's FlattenedTensorBucket.empty refuses it (the sender orders tensors so offsets align).

Every load is checked before any weight changes: known names, equal shapes, finite values
(NaN or Inf weights are refused whole).
"""

from __future__ import annotations

import base64
import datetime
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

LOCAL_FORMATS = ("safetensors_b64", "safetensors_path")
SGLANG_FORMATS = (None, "direct", "flattened_bucket")
LOAD_FORMATS = (*LOCAL_FORMATS, *SGLANG_FORMATS)
_PER_EXPERT = re.compile(r"^(?P<base>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<kind>gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class WeightUpdateError(ValueError):
    """A weight update request that cannot be applied; nothing was changed."""


def encode_safetensors_b64(tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save

    return base64.b64encode(save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})).decode()


def decode_named_tensors(serialized: list[str], load_format: str | None) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load, load_file

    from agentrl.sync import tensor_ipc

    if load_format not in LOAD_FORMATS:
        raise WeightUpdateError(
            f"load_format {load_format!r} is not supported by the embedded engine; use one of {LOAD_FORMATS}"
        )
    if not isinstance(serialized, list) or len(serialized) != 1 or not isinstance(serialized[0], str):
        raise WeightUpdateError("serialized_named_tensors must be a list of one string (one TP rank)")
    if load_format in SGLANG_FORMATS:
        try:
            pairs = tensor_ipc.named_tensors(tensor_ipc.decode(serialized[0]), load_format)
        except tensor_ipc.PayloadError as exc:
            raise WeightUpdateError(f"serialized_named_tensors[0]: {exc}") from None
        out = dict(pairs)
        if len(out) != len(pairs):
            raise WeightUpdateError("serialized_named_tensors[0] names a tensor twice")
        return out
    if load_format == "safetensors_b64":
        try:
            return load(base64.b64decode(serialized[0], validate=True))
        except (ValueError, SafetensorError) as exc:  # bad base64 or bad safetensors header
            raise WeightUpdateError(f"serialized_named_tensors[0] is not base64 safetensors: {exc}") from None
    path = Path(serialized[0])
    if not path.is_file():
        raise WeightUpdateError(f"serialized_named_tensors[0]: no such file {path}")
    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise WeightUpdateError(f"serialized_named_tensors[0]: {path} is not a safetensors file: {exc}") from None


def parse_dtype(name: object) -> torch.dtype:
    """A dtype named as SGLang reads it (getattr(torch, name)): "bfloat16", "float8_e4m3fn", ..."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and not name.startswith("_") else None
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}; use a torch dtype name such as float32, bfloat16, "
                                "float8_e4m3fn")
    return dtype


@dataclass(frozen=True)
class BucketEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the flat buffer
    end: int


def check_shape(name: str, shape: object) -> None:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise WeightUpdateError(f"shape of {name!r} must be a list of ints, got {shape!r}")
    if any(d < 0 for d in shape):
        raise WeightUpdateError(f"Negative dimension in received tensor {name}: {shape}")


def bucket_layout(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[BucketEntry]:
    """Byte ranges of a flattened bucket, checked as SGLang 0.5.23 checks them before receiving."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise WeightUpdateError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
                                f"{len(shapes)})")
    if not names:
        raise WeightUpdateError("cannot receive an empty tensor bucket")
    out, offset = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        dtype = parse_dtype(dt)
        check_shape(name, shape)
        if offset % dtype.itemsize:
            raise WeightUpdateError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype} "
                                    f"(itemsize {dtype.itemsize}); order the bucket so every offset is a multiple "
                                    "of its dtype's size")
        size = torch.Size(shape).numel() * dtype.itemsize
        out.append(BucketEntry(name, dtype, tuple(shape), offset, offset + size))
        offset += size
    return out


def check_receive(names: list[str], dtypes: list[str], shapes: list[list[int]], load_format: str | None) -> None:
    """Everything about an /update_weights_from_distributed body that can be refused before the
    engine joins the broadcast."""
    if load_format == "flattened_bucket":
        bucket_layout(names, dtypes, shapes)
        return
    if load_format not in (None, "direct"):
        raise WeightUpdateError(f"load_format {load_format!r}: use null or 'flattened_bucket'")
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise WeightUpdateError("names, dtypes and shapes must be non-empty and of the same length")
    for name, dt, shape in zip(names, dtypes, shapes):
        parse_dtype(dt)
        check_shape(name, shape)


def unpack_bucket(flat: torch.Tensor, layout: list[BucketEntry]) -> dict[str, torch.Tensor]:
    """Views of the flat uint8 buffer as the named tensors."""
    if flat.dtype != torch.uint8 or flat.numel() != layout[-1].end:
        raise WeightUpdateError(f"bucket holds {flat.numel()} bytes of {flat.dtype}, the layout {layout[-1].end} uint8")
    return {e.name: flat[e.start:e.end].view(e.dtype).reshape(e.shape) for e in layout}


@dataclass(frozen=True)
class Target:
    """Where one received HF tensor goes: a model tensor, or a slice of a fused one."""

    param: str
    index: tuple = ()


def target_of(name: str, state: dict[str, torch.Tensor], num_layers: int | None) -> Target | None:
    """The model tensor `name` loads into; None for a layer the model does not build (MTP)."""
    if name in state:
        return Target(name)
    if m := _PER_EXPERT.match(name):
        base, e, kind = m.group("base"), int(m.group("e")), m.group("kind")
        fused = state.get(f"{base}.gate_up_proj" if kind != "down" else f"{base}.down_proj")
        if fused is not None and e < fused.shape[0]:
            if kind == "down":
                return Target(f"{base}.down_proj", (e,))
            half = fused.shape[1] // 2
            rows = slice(0, half) if kind == "gate" else slice(half, 2 * half)
            return Target(f"{base}.gate_up_proj", (e, rows))
    m = _LAYER.match(name)
    if m and num_layers is not None and int(m.group(1)) >= num_layers:
        return None
    raise WeightUpdateError(f"unknown parameter name {name!r}; expected HF checkpoint names")


@dataclass
class PreparedLoad:
    """A checked update: (target, tensor) pairs to copy, and the HF names that arrived."""

    loads: list[tuple[Target, torch.Tensor]] = field(default_factory=list)
    received: list[str] = field(default_factory=list)
    not_served: list[str] = field(default_factory=list)  # layers the model does not build (MTP)


def resolve_named_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> PreparedLoad:
    """Fail before touching any weight if a name is unknown or a shape differs."""
    state = model.state_dict(keep_vars=True)
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    out = PreparedLoad(received=list(tensors))
    bad = []
    for name, t in tensors.items():
        target = target_of(name, state, num_layers)
        if target is None:
            out.not_served.append(name)
            continue
        have = tuple(state[target.param][target.index].shape)
        if have != tuple(t.shape):
            bad.append(f"{name}: got {tuple(t.shape)}, model has {have}")
        out.loads.append((target, t))
    if bad:
        raise WeightUpdateError("shape mismatch: " + "; ".join(bad[:5]))
    return out


def check_named_tensors(model: torch.nn.Module, names_shapes: dict[str, tuple[int, ...]]) -> None:
    """Fail before touching any weight if a name is unknown or a shape differs."""
    resolve_named_tensors(model, {n: torch.empty(s, device="meta") for n, s in names_shapes.items()})


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """NaN or Inf in any floating tensor refuses the whole update (a diverged trainer must not
    silently poison every rollout)."""
    bad = [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise WeightUpdateError(f"non-finite values (NaN or Inf) in {bad[:5]} (of {len(bad)} tensors); "
                                "nothing was loaded")


def dequantize_fp8_weights(tensors: dict[str, torch.Tensor], block: int = 128) -> dict[str, torch.Tensor]:
    """Replace each FP8 `<name>` + `<name>_scale_inv` pair (DeepSeek/SGLang FP8 checkpoint naming,
    128x128 blocks) by its fp32 value; other tensors pass through. Unpaired halves are errors."""
    scales = {n.removesuffix("_scale_inv"): t for n, t in tensors.items() if n.endswith("_scale_inv")}
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            if name.removesuffix("_scale_inv") not in tensors:
                raise WeightUpdateError(f"{name} has no matching FP8 tensor {name.removesuffix('_scale_inv')}")
            continue
        if t.dtype != torch.float8_e4m3fn:
            out[name] = t
            continue
        s = scales.get(name)
        want = (-(-t.shape[0] // block), -(-t.shape[1] // block)) if t.dim() == 2 else None
        if s is None or want is None or tuple(s.shape) != want:
            raise WeightUpdateError(f"{name} is float8_e4m3fn but {name}_scale_inv is missing or not of shape "
                                    f"{want} (one fp32 scale per {block}x{block} block)")
        full = s.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:t.shape[0], :t.shape[1]]
        out[name] = t.float() * full
    return out


@torch.no_grad()
def prepare_named_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> PreparedLoad:
    """Dequantise FP8 pairs and run every check; raises WeightUpdateError before anything changes."""
    tensors = dequantize_fp8_weights(tensors)
    prepared = resolve_named_tensors(model, tensors)
    check_finite(tensors)
    return prepared


@torch.no_grad()
def load_named_tensors(model: torch.nn.Module, prepared: PreparedLoad) -> int:
    """Copy a checked update (prepare_named_tensors) into the model; returns how many tensors."""
    state = model.state_dict(keep_vars=True)
    for target, t in prepared.loads:
        dst = state[target.param].data
        dst = dst[target.index] if target.index else dst
        dst.copy_(t.to(device=dst.device, dtype=dst.dtype))
    return len(prepared.loads)


class WeightUpdateGroup:
    """This engine's membership in a trainer-hosted broadcast group (module docstring)."""

    def __init__(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                 group_name: str, backend: str, timeout_s: float, device: torch.device) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _new_process_group_helper, _world

        if backend not in ("gloo", "nccl"):
            raise WeightUpdateError(f"backend {backend!r}: use gloo or nccl")
        if backend == "nccl" and device.type != "cuda":
            raise WeightUpdateError("backend 'nccl' needs an engine on CUDA; this one runs on the CPU: use 'gloo'")
        if not 0 < rank_offset < world_size:
            raise WeightUpdateError(f"rank_offset {rank_offset} must be in 1..world_size-1 ({world_size})")
        if group_name in _world.pg_names.values():
            raise WeightUpdateError(f"a process group named {group_name!r} exists in this engine; destroy it first")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
            store = dist.PrefixStore(group_name, store)
            self._pg, _ = _new_process_group_helper(world_size, rank_offset, [], backend, store,
                                                    group_name=group_name, timeout=timeout)
        except (RuntimeError, ValueError, dist.DistError) as exc:
            raise WeightUpdateError(f"could not join group {group_name!r} at {master_address}:{master_port} within "
                                    f"{timeout_s:g} s: {exc}".splitlines()[0]) from None
        _world.pg_group_ranks[self._pg] = {i: i for i in range(world_size)}
        self.group_name, self.rank, self.world_size = group_name, rank_offset, world_size
        # gloo receives into host memory, nccl into the engine's device.
        self.device = device if backend == "nccl" else torch.device("cpu")

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                load_format: str | None) -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        check_receive(names, dtypes, shapes, load_format)
        if load_format == "flattened_bucket":
            layout = bucket_layout(names, dtypes, shapes)
            flat = torch.empty(layout[-1].end, dtype=torch.uint8, device=self.device)
            dist.broadcast(flat, src=0, group=self._pg)
            return unpack_bucket(flat, layout)
        out = {name: torch.empty(*shape, dtype=parse_dtype(dt), device=self.device)
               for name, dt, shape in zip(names, dtypes, shapes)}
        works = [dist.broadcast(t, src=0, group=self._pg, async_op=True) for t in out.values()]
        for w in works:
            w.wait()
        return out

    def close(self) -> None:
        import torch.distributed as dist

        if self._pg is not None:
            try:
                dist.destroy_process_group(self._pg)
            finally:
                self._pg = None
