"""The one bucket planner of a weight update: which HF tensors go together, in which byte layout.

Every transport (http_tensors, nccl, cuda_ipc) and the rehearsal's schedule plan their buckets
here, from tensor specs alone (name, dtype, shape: no data), so what is announced to an engine,
what the sender fills and what the rehearsal checks are the same thing.

- A tensor goes to the wire as itself, or, when it is in the update's FP8 set, as two entries:
  `<name>` in float8_e4m3fn and `<name>_scale_inv` in float32, one scale per 128x128 block
  (partial edge blocks included): the naming and layout of block-FP8 HF checkpoints.
- Tensors are taken in order; a bucket closes when the next tensor would overflow
  `bucket_bytes` (a tensor larger than that gets a bucket of its own; an FP8 pair never splits).
- Inside a bucket the wire entries are ordered by itemsize, largest first (stable otherwise), and
  laid back to back: every byte offset is then a multiple of its entry's itemsize (itemsizes are
  powers of two and every entry's size is a multiple of its own), which is what SGLang 0.5.23's
  FlattenedTensorBucket.empty demands of a flattened bucket, with no padding bytes.

Pure arithmetic and byte copies; no process groups, no HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import torch

FP8_BLOCK = 128  # the 128x128 scale blocks of DeepSeek / GLM FP8 checkpoints
FP8_DTYPE = "float8_e4m3fn"
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BUCKET_BYTES = 256 << 20  # 256 MiB: ~360 GB/s raw broadcast between two H200s at this size


def itemsize(dtype: str) -> int:
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use a torch dtype name such as bfloat16")  # noqa: TRY004
    return dt.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class TensorSpec:
    """One HF tensor of the model as the trainer holds it (before any FP8 conversion)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * itemsize(self.dtype)

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorSpec:
        return cls(name, dtype_name(t.dtype), tuple(t.shape))


@dataclass(frozen=True)
class WireEntry:
    """One tensor as it travels: an HF tensor itself, an FP8 weight, or an FP8 weight's scales."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * itemsize(self.dtype)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) != 2:
        raise ValueError(f"FP8 block quantisation is for 2-D weights, got shape {shape}")
    return (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))


def wire_entries(spec: TensorSpec, fp8: bool) -> list[WireEntry]:
    """What goes on the wire for `spec`: itself, or (e4m3 weight, fp32 block scales)."""
    if not fp8:
        return [WireEntry(spec.name, spec.dtype, spec.shape)]
    return [WireEntry(spec.name, FP8_DTYPE, spec.shape),
            WireEntry(spec.name + SCALE_SUFFIX, "float32", scale_shape(spec.shape))]


def aligned(entries: list[WireEntry]) -> tuple[list[WireEntry], list[int], int]:
    """(entries by itemsize, largest first; their byte offsets; total bytes): every offset is a
    multiple of its entry's itemsize."""
    ordered = sorted(entries, key=lambda e: -itemsize(e.dtype))  # sorted() is stable
    offsets, at = [], 0
    for e in ordered:
        offsets.append(at)
        at += e.nbytes
    return ordered, offsets, at


@dataclass
class PlannedBucket:
    """One bucket: its HF tensors in source order and its wire layout (entries, offsets)."""

    index: int
    tensors: list[str] = field(default_factory=list)
    entries: list[WireEntry] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0

    def payload(self) -> dict:
        """names / dtypes / shapes in wire order (SGLang's update_weights_from_distributed fields)."""
        return {"names": [e.name for e in self.entries], "dtypes": [e.dtype for e in self.entries],
                "shapes": [list(e.shape) for e in self.entries]}

    def offset_of(self) -> dict[str, tuple[int, WireEntry]]:
        return {e.name: (o, e) for e, o in zip(self.entries, self.offsets, strict=True)}


FP8Choice = Callable[[TensorSpec], bool] | Collection[str]


def _chooser(fp8: FP8Choice | None) -> Callable[[TensorSpec], bool]:
    if fp8 is None:
        return lambda s: False
    if callable(fp8):
        return fp8
    names = frozenset(fp8)
    return lambda s: s.name in names


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 fp8: FP8Choice | None = None) -> list[PlannedBucket]:
    """Buckets of `specs` in order (module docstring). `fp8`: names (or a predicate) of the tensors
    sent FP8 block-quantised."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes}")
    choose = _chooser(fp8)
    buckets: list[PlannedBucket] = []
    cur: PlannedBucket | None = None
    pending: list[WireEntry] = []

    def close() -> None:
        if cur is not None and cur.tensors:
            cur.entries, cur.offsets, cur.nbytes = aligned(pending)
            buckets.append(cur)

    size = 0
    for spec in specs:
        wire = wire_entries(spec, choose(spec))
        n = sum(e.nbytes for e in wire)
        if cur is None or (cur.tensors and size + n > bucket_bytes):
            close()
            cur, pending, size = PlannedBucket(len(buckets)), [], 0
        cur.tensors.append(spec.name)
        pending.extend(wire)
        size += n
    close()
    return buckets


def fill(flat: torch.Tensor, offset: int, t: torch.Tensor) -> None:
    """Copy `t`'s bytes into the uint8 buffer `flat` at `offset`."""
    n = t.numel() * t.element_size()
    flat[offset:offset + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))


def views(flat: torch.Tensor, bucket: PlannedBucket) -> list[tuple[str, torch.Tensor]]:
    """The bucket's wire tensors as views of its flat uint8 buffer (the receiver's reconstruction)."""
    if flat.dtype != torch.uint8 or flat.numel() != bucket.nbytes:
        raise ValueError(f"bucket {bucket.index} holds {bucket.nbytes} bytes; got {flat.numel()} of {flat.dtype}")
    return [(e.name, flat[o:o + e.nbytes].view(getattr(torch, e.dtype)).reshape(e.shape))
            for e, o in zip(bucket.entries, bucket.offsets, strict=True)]


def names_digest(names: Iterable[str]) -> str:
    """An order-free digest of a set of tensor names (XOR of their sha256 prefixes): the sender
    combines its stages' digests, the engine reports the one of what it received."""
    import hashlib

    acc = 0
    for n in set(names):
        acc ^= int.from_bytes(hashlib.sha256(n.encode()).digest()[:16], "big")
    return f"{acc:032x}"
