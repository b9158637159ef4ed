"""The tensor payload of SGLang 0.5.23's `/update_weights_from_tensor`, both halves.

What SGLang does with it (read from the 0.5.23 wheel):
- `serialized_named_tensors` is a list with one item per engine TP rank; over HTTP each item is
  base64 (utils/common.py normalize_serialized_named_tensor_payload); TP rank r decodes item r only
  (managers/tp_worker.py deserialize_own_rank) with `SafeUnpickler`, an allowlist of globals.
- load_format None or "direct": the item is a MultiprocessingSerializer (ForkingPickler) dump of a
  list of (name, tensor). A CUDA tensor pickles as
  `torch.multiprocessing.reductions.rebuild_cuda_tensor(..., device, ipc_handle, ...)`; SGLang
  patches that rebuild (utils/patch_torch.py) so argument 6, the device, may be the GPU's UUID
  string instead of the sender's CUDA ordinal: the two processes see the GPU under different
  CUDA_VISIBLE_DEVICES, so only the UUID names it for both.
- load_format "flattened_bucket": the item is {"flattened_tensor": uint8 tensor, "metadata":
  [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]}.

`encode` is the sender: views of one CUDA bucket buffer share one storage, so the engine opens one
IPC handle per bucket; devices go as UUIDs. On CPU it pickles byte copies instead (torch's own
`_rebuild_tensor_v2` + `torch.storage._load_from_bytes`, both on SGLang's allowlist): for tests
and CPU engines, never a shared-memory path. float8 tensors cannot go that way: torch pickles
them as untyped storages, which torch 2.11's weights_only loader refuses (`UntypedStorage has no
attribute dtype`), so a safe decoder cannot read them; FP8 goes over CUDA IPC or safetensors. `decode` is the embedded engine's SafeUnpickler:
the subset of SGLang's allowlist these payloads need, UUIDs mapped to this process's ordinals
(SGLang's `_device_from_maybe_uuid`), anything else refused before it runs.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

REBUILD_DEVICE_ARG = 6  # position of the device in rebuild_cuda_tensor's arguments (SGLang's constant)


class PayloadError(ValueError):
    """A serialized tensor payload that cannot be decoded safely; nothing was run."""


@dataclass
class FlattenedTensorMetadata:
    """SGLang's weight_sync.tensor_bucket.FlattenedTensorMetadata, field for field."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _uuid_of(device: int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _device_from_maybe_uuid(device: int | str) -> int:
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        for i in range(torch.cuda.device_count()):
            if _uuid_of(i) == device:
                return i
        raise PayloadError(f"no visible CUDA device has uuid {device}; the sender's GPU is not this engine's")
    raise PayloadError(f"device {device!r} is neither an ordinal nor a uuid")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    from torch.multiprocessing import reductions

    args = (*args[:REBUILD_DEVICE_ARG], _device_from_maybe_uuid(args[REBUILD_DEVICE_ARG]),
            *args[REBUILD_DEVICE_ARG + 1:])
    return reductions.rebuild_cuda_tensor(*args)


def _reduce_with_uuid(t: torch.Tensor):
    from torch.multiprocessing import reductions

    fn, args = reductions.reduce_tensor(t)
    if fn is reductions.rebuild_cuda_tensor:
        args = (*args[:REBUILD_DEVICE_ARG], _uuid_of(args[REBUILD_DEVICE_ARG]), *args[REBUILD_DEVICE_ARG + 1:])
    return fn, args


def encode(named: list[tuple[str, torch.Tensor]]) -> str:
    """One TP rank's item: base64 of [(name, tensor)] as SGLang decodes it. CUDA tensors go as IPC
    handles (keep them alive and unchanged until the engine has answered); CPU tensors as bytes."""
    buf = io.BytesIO()
    if any(t.is_cuda for _, t in named):
        if not all(t.is_cuda for _, t in named):
            raise ValueError("a CUDA IPC payload cannot mix CPU and CUDA tensors")
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # registers torch's reductions with ForkingPickler

        pickler = ForkingPickler(buf)
        # this pickler only: send the GPU's uuid, as SGLang's patched reductions do (no global patch)
        pickler.dispatch_table[torch.Tensor] = _reduce_with_uuid
        pickler.dispatch_table[torch.nn.Parameter] = _reduce_with_uuid
        pickler.dump([(n, t.detach()) for n, t in named])
    else:
        fp8 = [n for n, t in named if t.dtype in _NO_LEGACY_STORAGE]
        if fp8:
            raise ValueError(f"{fp8[0]}: a CPU tensor payload cannot carry {dict(named)[fp8[0]].dtype} (module "
                             "docstring); send FP8 over CUDA IPC or as safetensors")
        pickle.Pickler(buf).dump([(n, t.detach().contiguous().clone()) for n, t in named])
    return base64.b64encode(buf.getvalue()).decode()


_NO_LEGACY_STORAGE = (torch.float8_e4m3fn, torch.float8_e5m2)


def _load_storage(data: bytes):
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, torch.storage.TypedStorage | torch.UntypedStorage):
        raise PayloadError(f"expected a torch storage in the payload, got {type(storage).__name__}")
    return storage


_DTYPES = {(("torch", str(d).removeprefix("torch."))) for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)}
_ALLOWED = {
    ("builtins", "list"), ("builtins", "tuple"), ("builtins", "dict"), ("builtins", "int"), ("builtins", "str"),
    ("builtins", "bytes"), ("builtins", "bytearray"), ("builtins", "float"), ("builtins", "bool"),
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("_codecs", "encode"),
    ("torch", "Size"), ("torch", "device"), ("torch", "dtype"), ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"), ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    *_DTYPES,
}
_MAPPED = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("torch.storage", "_load_from_bytes"): _load_storage,
    # megatron.core replaces torch.storage._load_from_bytes with this (the same weights_only load) when
    # it is imported, so a trainer's CPU payloads name it; SGLang never gets CPU payloads
    ("megatron.core.safe_globals", "safe_load_from_bytes"): _load_storage,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _MAPPED:
            return _MAPPED[(module, name)]
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise PayloadError(f"blocked global {module}.{name} in the tensor payload (not a tensor rebuild)")

    def persistent_load(self, pid: Any) -> Any:
        raise PayloadError("persistent ids are not allowed in a tensor payload")


def decode(item: str | bytes) -> Any:
    """One TP rank's item back to Python objects, through the allowlist."""
    try:
        raw = base64.b64decode(item, validate=True) if isinstance(item, str) else bytes(item)
    except (binascii.Error, ValueError) as exc:
        raise PayloadError(f"serialized tensors are not base64: {exc}") from None
    try:
        return _SafeUnpickler(io.BytesIO(raw)).load()
    except PayloadError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is the caller's bad input
        raise PayloadError(f"serialized tensors do not decode: {type(exc).__name__}: {exc}") from None


def named_tensors(obj: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) list a decoded item carries, for SGLang's load formats."""
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= set(obj):
            raise PayloadError("a flattened_bucket payload is {flattened_tensor, metadata}")
        flat = obj["flattened_tensor"]
        out = []
        for m in obj["metadata"]:
            if not isinstance(m, FlattenedTensorMetadata):
                raise PayloadError("flattened_bucket metadata must be FlattenedTensorMetadata entries")
            out.append((m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)))
        return out
    if not isinstance(obj, list) or not all(
            isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)
            for x in obj):
        raise PayloadError("the payload must be a list of (name, tensor) pairs")
    return list(obj)

