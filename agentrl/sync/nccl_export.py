"""Weight export to inference engines by NCCL broadcast, following SGLang's
update_weights_from_distributed protocol (REFERENCE.md section 3):

1. Every engine joins a weight-update group: POST /init_weights_update_group {master_address,
   master_port, rank_offset, world_size, group_name, backend}. The trainer's export rank is rank 0
   of that group; engine ranks follow at their rank_offset. `init_weights_update_group` below is the
   trainer side of the same rendezvous (tcp:// store, prefixed with the group name).
2. Per bucket: the trainer POSTs /update_weights_from_distributed {names, dtypes, shapes,
   group_name, load_format: "flattened_bucket", weight_version on the last bucket} to every engine,
   then broadcasts ONE flat uint8 tensor from rank 0: the tensors' bytes back to back, in `names`
   order, no alignment padding. Each engine allocates empty tensors of those dtypes/shapes, views
   their bytes as one buffer, receives the broadcast into it and loads the tensors
   (`receive_bucket` is that engine side, used by tests and by an embedded receiver).
3. Optional FP8: 2-D projection weights go as float8_e4m3fn plus a `<name>_scale_inv` fp32 tensor of
   128x128 block scales (kernels/fp8_quant.py on GPU, its torch reference on CPU), the layout of
   block-FP8 checkpoints that SGLang loads. Bucket contents are planned from shapes (ExportItem), so
   quantisation runs inside the copy stream, overlapped with the previous bucket's broadcast.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Kept in the checkpoint dtype: embeddings, the LM head, norms, the router, and the DSA indexer's
# small head-weight projection (quantising it would perturb which keys the indexer selects).
_FP8_SKIP = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "indexer.weights_proj", "eh_proj")


def fp8_eligible(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("_proj.weight") and not any(s in name for s in _FP8_SKIP)


def quantize_named(named: Iterable[tuple[str, torch.Tensor]], fp8: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, or replace each FP8-eligible weight by (name: e4m3 weight,
    name_scale_inv: fp32 128x128 block scales)."""
    for name, t in named:
        if not (fp8 and fp8_eligible(name, t)):
            yield name, t
            continue
        if t.is_cuda:
            from kernels.fp8_quant import fp8_block_quant

            q, scales = fp8_block_quant(t)
        else:
            from kernels.fp8_quant import reference_fp8_block_quant

            q, scales = reference_fp8_block_quant(t)
        yield name, q
        yield name + "_scale_inv", scales


@dataclass(frozen=True)
class ExportItem:
    """One source weight and what goes on the wire for it: itself, or (e4m3 weight, fp32 scales).
    Sizes and names are known before any quantisation runs, so buckets can be planned (and
    announced) first and quantised inside the copy stream."""

    name: str
    tensor: torch.Tensor
    fp8: bool

    def entries(self) -> list[tuple[str, str, list[int]]]:
        shape = list(self.tensor.shape)
        if not self.fp8:
            return [(self.name, dtype_name(self.tensor.dtype), shape)]
        blocks = [-(-shape[0] // 128), -(-shape[1] // 128)]
        return [(self.name, "float8_e4m3fn", shape), (self.name + "_scale_inv", "float32", blocks)]

    def nbytes(self) -> int:
        return sum(_nbytes(d, s) for _, d, s in self.entries())

    def materialise(self) -> list[tuple[str, torch.Tensor]]:
        return list(quantize_named([(self.name, self.tensor)], self.fp8))


def plan_buckets(named: Iterable[tuple[str, torch.Tensor]], fp8: bool, bucket_bytes: int) -> Iterator[list[ExportItem]]:
    """Consecutive items in buckets of about `bucket_bytes` on the wire; a weight's FP8 pair never
    straddles two buckets."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[ExportItem] = []
    size = 0
    for name, t in named:
        item = ExportItem(name, t, fp8 and fp8_eligible(name, t))
        n = item.nbytes()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += n
    if bucket:
        yield bucket


def items_payload(items: list[ExportItem], group_name: str) -> dict[str, Any]:
    entries = [e for it in items for e in it.entries()]
    return {"names": [n for n, _, _ in entries], "dtypes": [d for _, d, _ in entries],
            "shapes": [s for _, _, s in entries], "group_name": group_name,
            "load_format": "flattened_bucket", "flush_cache": False}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' bytes back to back as one uint8 tensor (into `out` when given and large enough)."""
    total = sum(t.numel() * t.element_size() for _, t in bucket)
    device = bucket[0][1].device
    flat = out[:total] if out is not None and out.numel() >= total else torch.empty(total, dtype=torch.uint8, device=device)
    at = 0
    for _, t in bucket:
        n = t.numel() * t.element_size()
        flat[at:at + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
        at += n
    return flat


def _nbytes(dtype: str, shape: list[int]) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def unflatten_bucket(flat: torch.Tensor, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
    """Views of `flat` as the named tensors (the receiver's reconstruction)."""
    sizes = [_nbytes(d, s) for d, s in zip(dtypes, shapes, strict=True)]
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
    rendezvous with the group name as store prefix, as SGLang's engines build theirs."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    # The store a tcp:// rendezvous makes, built directly: under torchrun, rendezvous() would join the
    # launcher's agent store instead and nobody would serve master_port.
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def receive_bucket(group: Any, names: list[str], dtypes: list[str], shapes: list[list[int]],
                   device: torch.device | str, src: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Engine side of one flattened bucket: allocate, receive the broadcast, reconstruct."""
    total = sum(_nbytes(d, s) for d, s in zip(dtypes, shapes, strict=True))
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    dist.broadcast(flat, src=src, group=group)
    return unflatten_bucket(flat, names, dtypes, shapes)


@dataclass
class ExportStats:
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    flatten_s: float = 0.0
    broadcast_s: float = 0.0
    total_s: float = 0.0
    per_bucket_bytes: list[int] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.total_s / 1e9 if self.total_s else 0.0


class NcclWeightExporter:
    """Trainer side: HF-named tensors -> (FP8) -> flattened buckets -> broadcast from rank 0.

    `announce(payload)` is called before each bucket's broadcast with the request body for the
    engines (for SGLang: POST it to every engine without waiting; the engines then join the
    broadcast); it returns a callable that waits for the engines' answers, called once that bucket's
    broadcast is known to be done.

    On CUDA two flat buffers alternate: bucket i+1 is flattened on a side stream while bucket i is
    broadcast, so the copy hides behind NCCL (flattening 256 MiB takes ~0.13 ms of HBM time, its
    broadcast ~0.7 ms at 370 GB/s: serial, the copy alone would cost ~15% of the link). On CPU (gloo)
    buckets go one after the other through one buffer."""

    def __init__(self, group: Any, *, group_name: str = "agentrl_weights", bucket_bytes: int = 256 << 20,
                 fp8: bool = False, src: int = 0):
        self.group, self.group_name, self.bucket_bytes, self.fp8, self.src = group, group_name, bucket_bytes, fp8, src
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._side: Any = None  # the copy stream, made on first CUDA export

    def payloads(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
        """The request bodies `export` will announce, from shapes alone (no data is touched)."""
        return [items_payload(b, self.group_name) for b in plan_buckets(named, self.fp8, self.bucket_bytes)]

    def export(self, named: Iterable[tuple[str, torch.Tensor]], version: int,
               announce: Callable[[dict[str, Any]], Callable[[], None]] | None = None) -> ExportStats:
        stats = ExportStats()
        t_start = time.perf_counter()
        pending: list[ExportItem] | None = None
        inflight: list[tuple[Any, Callable[[], None] | None] | None] = [None, None]
        index = 0
        for bucket in plan_buckets(named, self.fp8, self.bucket_bytes):
            if pending is not None:
                self._send(pending, None, announce, stats, index, inflight)
                index += 1
            pending = bucket
        if pending is not None:
            self._send(pending, version, announce, stats, index, inflight)
        for slot in inflight:
            _finish(slot)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        stats.total_s = time.perf_counter() - t_start
        return stats

    def _buffer(self, k: int, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers[k]
        if buf is None or buf.device != device or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, self.bucket_bytes), dtype=torch.uint8, device=device)
            self._buffers[k] = buf
        return buf

    def _send(self, items: list[ExportItem], version: int | None,
              announce: Callable[[dict[str, Any]], Callable[[], None]] | None, stats: ExportStats,
              index: int, inflight: list) -> None:
        t0 = time.perf_counter()
        device = items[0].tensor.device
        cuda = device.type == "cuda"
        k = index % 2 if cuda else 0
        _finish(inflight[k])  # the buffer's previous broadcast is done before it is overwritten
        inflight[k] = None
        nbytes = sum(it.nbytes() for it in items)
        buf = self._buffer(k, nbytes, device)
        if cuda:  # quantise + flatten on the copy stream, beside the previous bucket's broadcast
            if self._side is None or self._side.device != device:
                self._side = torch.cuda.Stream(device=device)
            side = self._side
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                flat = flatten_bucket([e for it in items for e in it.materialise()], buf)
            for it in items:
                it.tensor.record_stream(side)
            torch.cuda.current_stream(device).wait_stream(side)
        else:
            flat = flatten_bucket([e for it in items for e in it.materialise()], buf)
        t1 = time.perf_counter()
        payload = items_payload(items, self.group_name)
        if version is not None:
            payload["weight_version"] = str(version)
        wait = announce(payload) if announce is not None else None
        work = dist.broadcast(flat, src=self.src, group=self.group, async_op=cuda)
        inflight[k] = (work, wait)
        if not cuda:
            _finish(inflight[k])
            inflight[k] = None
        stats.flatten_s += t1 - t0  # host time to quantise (launch, on CUDA) and flatten
        stats.broadcast_s += time.perf_counter() - t1
        stats.buckets += 1
        stats.tensors += len(payload["names"])
        stats.bytes += nbytes
        stats.per_bucket_bytes.append(nbytes)


def _finish(slot: tuple[Any, Callable[[], None] | None] | None) -> None:
    if slot is None:
        return
    work, wait = slot
    if work is not None:
        work.wait()
    if wait is not None:
        wait()


def sglang_announcer(clients: list[Any], loop: asyncio.AbstractEventLoop) -> Callable[[dict[str, Any]], Callable[[], None]]:
    """`announce` for NcclWeightExporter that POSTs each bucket to SGLang engines (EngineClient) on
    `loop` (running in another thread) and, after the broadcast, waits for every engine's answer;
    an engine that reports failure raises, naming it."""

    def announce(payload: dict[str, Any]) -> Callable[[], None]:
        body = {k: v for k, v in payload.items() if k not in ("names", "dtypes", "shapes")}
        futures = [asyncio.run_coroutine_threadsafe(
            c.update_weights_from_distributed(payload["names"], payload["dtypes"], payload["shapes"], **body), loop)
            for c in clients]

        def wait() -> None:
            for c, f in zip(clients, futures, strict=True):
                answer = f.result()
                if isinstance(answer, dict) and answer.get("success") is False:
                    raise RuntimeError(f"engine {c.base_url} refused the weight bucket: {answer.get('message')}")
        return wait

    return announce
