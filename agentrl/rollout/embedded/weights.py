"""Weight updates for the embedded engine: local tensor serialization and the broadcast group.

`/update_weights_from_tensor` takes `serialized_named_tensors`, a list with one item per TP rank
(the embedded engine has one rank), in one of two local formats:
- load_format "safetensors_b64": the item is base64 of safetensors bytes of {hf_name: tensor};
- load_format "safetensors_path": the item is the path of a .safetensors file on this host
  (e.g. under /dev/shm), read and left in place; the caller owns and removes the file.
SGLang's own format (pickled CUDA IPC handles) cannot exist on a CPU engine.

`/init_weights_update_group` joins a gloo group the trainer hosts: a TCPStore at
master_address:master_port (the trainer, rank 0, is the store's server), keys prefixed with
group_name; this engine is rank `rank_offset`. `/update_weights_from_distributed` then receives
each tensor (or one flat bucket) by broadcast from rank 0.
"""

from __future__ import annotations

import base64
import datetime
from pathlib import Path

import torch

LOAD_FORMATS = ("safetensors_b64", "safetensors_path")

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "int8": torch.int8,
}


class WeightUpdateError(ValueError):
    """A weight update request that cannot be applied; nothing was changed."""


def encode_safetensors_b64(tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save

    return base64.b64encode(save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})).decode()


def decode_named_tensors(serialized: list[str], load_format: str | None) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load, load_file

    if load_format not in LOAD_FORMATS:
        raise WeightUpdateError(
            f"load_format {load_format!r} is not supported by the embedded engine; use one of {LOAD_FORMATS}"
        )
    if not isinstance(serialized, list) or len(serialized) != 1 or not isinstance(serialized[0], str):
        raise WeightUpdateError("serialized_named_tensors must be a list of one string (one TP rank)")
    if load_format == "safetensors_b64":
        try:
            return load(base64.b64decode(serialized[0], validate=True))
        except (ValueError, SafetensorError) as exc:  # bad base64 or bad safetensors header
            raise WeightUpdateError(f"serialized_named_tensors[0] is not base64 safetensors: {exc}") from None
    path = Path(serialized[0])
    if not path.is_file():
        raise WeightUpdateError(f"serialized_named_tensors[0]: no such file {path}")
    return load_file(str(path))


def parse_dtype(name: str) -> torch.dtype:
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise WeightUpdateError(f"unknown dtype {name!r}; known: {', '.join(_DTYPES)}")
    return _DTYPES[key]


def check_named_tensors(model: torch.nn.Module, names_shapes: dict[str, tuple[int, ...]]) -> None:
    """Fail before touching any weight if a name is unknown or a shape differs."""
    state = model.state_dict(keep_vars=True)
    unknown = [n for n in names_shapes if n not in state]
    if unknown:
        raise WeightUpdateError(f"unknown parameter names {unknown[:5]} (of {len(unknown)}); expected HF names")
    bad = [f"{n}: got {tuple(s)}, model has {tuple(state[n].shape)}"
           for n, s in names_shapes.items() if tuple(state[n].shape) != tuple(s)]
    if bad:
        raise WeightUpdateError("shape mismatch: " + "; ".join(bad[:5]))


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
def load_named_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Copy tensors into the model's parameters/buffers by HF name; returns how many were loaded.
    FP8 block-quantised weights (with `_scale_inv`) are dequantised on receipt."""
    tensors = dequantize_fp8_weights(tensors)
    check_named_tensors(model, {n: tuple(t.shape) for n, t in tensors.items()})
    state = model.state_dict(keep_vars=True)
    for name, t in tensors.items():
        state[name].data.copy_(t.to(dtype=state[name].dtype))
    return len(tensors)


class WeightUpdateGroup:
    """This engine's membership in a trainer-hosted gloo broadcast group."""

    def __init__(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                 group_name: str, backend: str = "gloo", timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        if backend != "gloo":
            raise WeightUpdateError(f"backend {backend!r}: the CPU engine supports only 'gloo'")
        if not 0 < rank_offset < world_size:
            raise WeightUpdateError(f"rank_offset {rank_offset} must be in 1..world_size-1 ({world_size})")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, int(master_port), world_size, is_master=False, timeout=timeout)
        self.group_name = group_name
        self.rank, self.world_size = rank_offset, world_size
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore(group_name, store), rank_offset, world_size, timeout)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                load_format: str | None) -> dict[str, torch.Tensor]:
        if not (len(names) == len(dtypes) == len(shapes)):
            raise WeightUpdateError("names, dtypes and shapes must have the same length")
        if load_format == "flattened_bucket":
            if len(set(dtypes)) != 1:
                raise WeightUpdateError("flattened_bucket needs one dtype for all tensors")
            numels = [int(torch.Size(s).numel()) for s in shapes]
            flat = torch.empty(sum(numels), dtype=parse_dtype(dtypes[0]))
            self._pg.broadcast(flat, 0).wait()
            parts = flat.split(numels)
            return {n: p.view(*s) for n, p, s in zip(names, parts, shapes)}
        if load_format not in (None, "direct"):
            raise WeightUpdateError(f"load_format {load_format!r}: use null/'direct' or 'flattened_bucket'")
        out = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            t = torch.empty(*shape, dtype=parse_dtype(dtype))
            self._pg.broadcast(t, 0).wait()
            out[name] = t
        return out

    def close(self) -> None:
        self._pg = None
