"""The sender side of SGLang's update_weights_from_distributed protocol (REFERENCE.md section 3):
the weight-update process group, and the stream that turns wire tensors into flattened buckets.

1. Every engine joins a weight-update group: POST /init_weights_update_group {master_address,
   master_port, rank_offset, world_size, group_name, backend}. The trainer's sender is rank 0 (it
   serves the tcp:// store); engine ranks follow at their rank_offset. `init_weights_update_group`
   is the trainer side of that rendezvous, built as SGLang 0.5.23 builds its own
   (utils/common.py init_custom_process_group: tcp store, PrefixStore(group_name)).
2. Per bucket (agentrl.sync.buckets plans them): POST {names, dtypes, shapes, group_name,
   load_format: "flattened_bucket", flush_cache, weight_version on the last} to every engine, then
   broadcast ONE flat uint8 tensor from rank 0 laid out as the plan says (itemsize-aligned offsets).

`BucketStream` fills planned buckets from wire tensors (FP8 pairs already made) at their planned
offsets and hands each full bucket to a send callback. On CUDA two buffers alternate, so bucket
i+1 is filled while bucket i's broadcast runs on NCCL's stream (flattening 256 MiB takes ~0.13 ms
of HBM time, its broadcast ~0.7 ms at 370 GB/s: serially the copy alone would cost ~15% of the
link; measured with this overlap: 93.5% of a raw broadcast, bench/results/megatron.json).
`NcclWeightExporter` is that stream over a broadcast group, for benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from agentrl.sync.buckets import PlannedBucket, TensorSpec, dtype_name, fill
from agentrl.sync.buckets import plan_buckets as plan_wire_buckets
from agentrl.sync.fp8 import fp8_rule, to_wire


def fp8_eligible(name: str, t: torch.Tensor) -> bool:
    """agentrl.sync.fp8.fp8_rule for a tensor at hand."""
    return fp8_rule(TensorSpec.of(name, t))


def quantize_named(named: Iterable[tuple[str, torch.Tensor]], fp8: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, or replace each fp8_rule weight by (name: e4m3, name_scale_inv: fp32)."""
    for name, t in named:
        yield from to_wire(name, t, fp8 and fp8_eligible(name, t))


@dataclass(frozen=True)
class ExportItem:
    """One source tensor and whether it goes FP8 (benchmarks look into planned buckets with it)."""

    name: str
    tensor: torch.Tensor
    fp8: bool

    def materialise(self) -> list[tuple[str, torch.Tensor]]:
        return to_wire(self.name, self.tensor, self.fp8)


class ExportBucket(list):
    """A planned bucket's ExportItems (a list) with its wire layout (`planned`)."""

    planned: PlannedBucket


def plan_buckets(named: Iterable[tuple[str, torch.Tensor]], fp8: bool, bucket_bytes: int) -> list[ExportBucket]:
    """agentrl.sync.buckets.plan_buckets over tensors at hand, FP8 by fp8_rule when `fp8`."""
    named = list(named)
    planned = plan_wire_buckets((TensorSpec.of(n, t) for n, t in named), bucket_bytes, fp8_rule if fp8 else None)
    by_name = dict(named)
    out = []
    for p in planned:
        b = ExportBucket(ExportItem(n, by_name[n], fp8 and fp8_eligible(n, by_name[n])) for n in p.tensors)
        b.planned = p
        out.append(b)
    return out



def flatten_bucket(bucket: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' bytes back to back in the given order, as one uint8 tensor (test senders)."""
    total = sum(t.numel() * t.element_size() for _, t in bucket)
    flat = out[:total] if out is not None and out.numel() >= total else torch.empty(
        total, dtype=torch.uint8, device=bucket[0][1].device)
    at = 0
    for _, t in bucket:
        fill(flat, at, t)
        at += t.numel() * t.element_size()
    return flat


def unflatten_bucket(flat: torch.Tensor, names: list[str], dtypes: list[str], shapes: list[list[int]]
                     ) -> list[tuple[str, torch.Tensor]]:
    """Views of `flat` as the named tensors, back to back in `names` order (the receiver's side)."""
    sizes = [TensorSpec(n, d, tuple(s)).nbytes for n, d, s in zip(names, dtypes, shapes, strict=True)]
    if sum(sizes) != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes, the names/dtypes/shapes describe {sum(sizes)}")
    out, at = [], 0
    for name, dt, shape, n in zip(names, dtypes, shapes, sizes, strict=True):
        out.append((name, flat[at:at + n].view(getattr(torch, dt)).view(shape)))
        at += n
    return out


def init_weights_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                              group_name: str, backend: str = "nccl", timeout_s: float = 600.0) -> Any:
    """A process group outside the default world (trainer rank 0 + engine ranks), built from a tcp://
    store with the group name as store prefix, as SGLang's engines build theirs. Every collective on
    it is bounded by `timeout_s`."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    # The store a tcp:// rendezvous makes, built directly: under torchrun, rendezvous() would join the
    # launcher's agent store instead and nobody would serve master_port.
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg: Any) -> None:
    """Tear a weight-update group down, aborting NCCL first (a communicator with a dead peer would
    otherwise block the destroy)."""
    if pg is None:
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None and dist.get_backend(pg) == "nccl":
            abort(pg)
        else:
            dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001, S110 - a group whose peer died may refuse a clean teardown; dropped
        pass


def receive_bucket(group: Any, names: list[str], dtypes: list[str], shapes: list[list[int]],
                   device: torch.device | str, src: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Engine side of one flattened bucket: allocate, receive the broadcast, reconstruct."""
    total = sum(TensorSpec(n, d, tuple(s)).nbytes for n, d, s in zip(names, dtypes, shapes, strict=True))
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    dist.broadcast(flat, src=src, group=group)
    return unflatten_bucket(flat, names, dtypes, shapes)


class Pending(Protocol):
    def wait(self) -> None:
        """Block until the bucket's buffer may be reused (its transfer and the engines' answers)."""


class Done:
    def wait(self) -> None:
        return None


@dataclass
class StreamStats:
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    fill_s: float = 0.0  # host time spent copying (launching copies, on CUDA) into bucket buffers
    send_s: float = 0.0  # host time inside send callbacks and waits
    per_bucket_bytes: list[int] = field(default_factory=list)

    @property
    def flatten_s(self) -> float:  # the benchmark's name for fill_s
        return self.fill_s


SendFn = Callable[[PlannedBucket, torch.Tensor, bool], Pending]


class BucketStream:
    """Fill `buckets` (in order) from wire tensors; `send(bucket, flat, last)` each one when full.

    `put` must see every wire entry of bucket i before any of bucket i+1 (the plan follows the
    source order, so a source walked in order does); entries of one bucket may come in any order."""

    def __init__(self, buckets: list[PlannedBucket], device: torch.device, send: SendFn):
        self.buckets, self.device, self.send = buckets, torch.device(device), send
        self.stats = StreamStats()
        self._slots = 2 if self.device.type == "cuda" else 1
        self._buffers: list[torch.Tensor | None] = [None] * self._slots
        self._inflight: list[Pending | None] = [None] * self._slots
        self._i = 0  # bucket being filled
        self._layout: dict[str, tuple[int, Any]] = {}
        self._missing = 0
        self._flat: torch.Tensor | None = None
        if buckets:
            self._open(0)

    def _open(self, i: int) -> None:
        k = i % self._slots
        if self._inflight[k] is not None:  # this buffer's previous transfer must be done first
            t0 = time.perf_counter()
            self._inflight[k].wait()
            self.stats.send_s += time.perf_counter() - t0
            self._inflight[k] = None
        b = self.buckets[i]
        buf = self._buffers[k]
        if buf is None or buf.numel() < b.nbytes:
            buf = torch.empty(max(b.nbytes for b in self.buckets), dtype=torch.uint8, device=self.device)
            self._buffers[k] = buf
        self._flat = buf[:b.nbytes]
        self._layout = b.offset_of()
        self._missing = len(b.entries)

    def put(self, name: str, t: torch.Tensor) -> None:
        if self._i >= len(self.buckets):
            raise ValueError(f"{name}: every planned bucket is already full")
        b = self.buckets[self._i]
        if name not in self._layout:
            raise ValueError(f"{name} is not planned in bucket {b.index} (holds {b.tensors[:3]}...)")
        offset, entry = self._layout.pop(name)
        if dtype_name(t.dtype) != entry.dtype or tuple(t.shape) != tuple(entry.shape):
            raise ValueError(f"{name}: got {dtype_name(t.dtype)} {tuple(t.shape)}, the plan says "
                             f"{entry.dtype} {tuple(entry.shape)}")
        t0 = time.perf_counter()
        if t.device != self.device:  # async only towards the GPU: a host copy must be complete when read
            t = t.to(self.device, non_blocking=self.device.type == "cuda")
        fill(self._flat, offset, t)
        self.stats.fill_s += time.perf_counter() - t0
        self._missing -= 1
        if self._missing == 0:
            self._ship()

    def _ship(self) -> None:
        b = self.buckets[self._i]
        last = self._i == len(self.buckets) - 1
        t0 = time.perf_counter()
        self._inflight[self._i % self._slots] = self.send(b, self._flat, last)
        self.stats.send_s += time.perf_counter() - t0
        self.stats.buckets += 1
        self.stats.tensors += len(b.entries)
        self.stats.bytes += b.nbytes
        self.stats.per_bucket_bytes.append(b.nbytes)
        self._i += 1
        if not last:
            self._open(self._i)

    def close(self) -> StreamStats:
        """Wait for every transfer; raises if a planned entry never came."""
        t0 = time.perf_counter()
        for k, p in enumerate(self._inflight):
            if p is not None:
                p.wait()
                self._inflight[k] = None
        self.stats.send_s += time.perf_counter() - t0
        if self._i < len(self.buckets):
            missing = sorted(self._layout)[:3]
            raise ValueError(f"bucket {self._i} of {len(self.buckets)} never filled (missing e.g. {missing})")
        return self.stats


class _Broadcast:
    def __init__(self, work: Any, after: Callable[[], None] | None):
        self.work, self.after = work, after

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.after is not None:
            self.after()


@dataclass
class ExportStats(StreamStats):
    total_s: float = 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.total_s / 1e9 if self.total_s else 0.0


class NcclWeightExporter:
    """HF-named tensors -> (FP8 by fp8_rule) -> planned buckets -> broadcast from rank 0 of `group`.

    `announce(payload)` is called before each bucket's broadcast with the request body for the
    engines and returns a callable that waits for their answers (None: nothing to wait for)."""

    def __init__(self, group: Any, *, group_name: str = "agentrl_weights", bucket_bytes: int = 256 << 20,
                 fp8: bool = False, src: int = 0):
        self.group, self.group_name, self.bucket_bytes, self.fp8, self.src = group, group_name, bucket_bytes, fp8, src

    def payloads(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
        """The request bodies `export` will announce, from shapes alone."""
        return [{**b.planned.payload(), "group_name": self.group_name, "load_format": "flattened_bucket",
                 "flush_cache": False} for b in plan_buckets(named, self.fp8, self.bucket_bytes)]

    def export(self, named: Iterable[tuple[str, torch.Tensor]], version: int,
               announce: Callable[[dict[str, Any]], Callable[[], None] | None] | None = None) -> ExportStats:
        t_start = time.perf_counter()
        buckets = plan_buckets(named, self.fp8, self.bucket_bytes)
        device = buckets[0][0].tensor.device if buckets else torch.device("cpu")
        cuda = device.type == "cuda"

        def send(b: PlannedBucket, flat: torch.Tensor, last: bool) -> Pending:
            payload = {**b.payload(), "group_name": self.group_name, "load_format": "flattened_bucket",
                       "flush_cache": last}
            if last:
                payload["weight_version"] = str(version)
            after = announce(payload) if announce is not None else None
            work = dist.broadcast(flat, src=self.src, group=self.group, async_op=cuda)
            return _Broadcast(work if cuda else None, after)

        stream = BucketStream([b.planned for b in buckets], device, send)
        for b in buckets:
            for it in b:
                for name, t in it.materialise():
                    stream.put(name, t)
        s = stream.close()
        if cuda:
            torch.cuda.synchronize(device)
        return ExportStats(**{k: getattr(s, k) for k in StreamStats.__dataclass_fields__},
                           total_s=time.perf_counter() - t_start)

