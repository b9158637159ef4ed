"""Weight sync from a trainer to engines over the engines' HTTP API (the local tensor path).

The order SGLang 0.5.23 requires: pause (in the configured mode: `retract` by default, so no
request continues on KV computed with the old weights) -> /begin_weight_update -> every bucket to
every engine, the last one carrying the new weight_version and flushing the cache (not with
in_place: requests then keep their KV and SGLang refuses the flush) -> /end_weight_update ->
continue. At scale the same sequence runs with NCCL broadcast buckets
(update_weights_from_distributed) instead of files.

With `fp8=True` (rollout.weight_sync_fp8) the projection weights are sent as DeepSeek/SGLang block-FP8
checkpoints store them: `<name>` in float8_e4m3fn plus `<name>_scale_inv` (fp32, one per 128x128
block, partial edge blocks included; weight = fp8 value x scale_inv), about half the bytes of bf16.
Which tensors, and the quantisation, are the NCCL exporter's (agentrl/sync/nccl_export.py:
`fp8_eligible`, `quantize_named`), so both paths send the same thing.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from agentrl.rollout.client import EngineClient


def bucket_named_tensors(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Group tensors in order into buckets of about `bucket_bytes` (a tensor larger than that
    gets a bucket of its own). Tensors are copied to contiguous CPU memory: tied weights share
    storage, which safetensors refuses."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t.detach().to("cpu", copy=True).contiguous()
        size += nbytes
    if bucket:
        yield bucket


async def push_weights(
    urls: list[str],
    named: Iterable[tuple[str, torch.Tensor]],
    version: int,
    *,
    pause_mode: str = "retract",
    bucket_bytes: int = 256 << 20,
    scratch_dir: str | None = None,
    timeout_s: float = 600.0,
    fp8: bool = False,
) -> dict:
    """Send `named` to every engine at `urls` as weight version `version`. Returns timings and
    `failed_engines`: engines that errored are dropped from the rest of the update (a dead engine
    must not stall the others); the caller restarts them and sends them the weights again.
    fp8: send projection weights FP8 block-quantised with their `_scale_inv` (module docstring)."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    base = scratch_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    tmp = Path(tempfile.mkdtemp(prefix="agentrl-weights-", dir=base))
    live = {u: EngineClient(u, timeout_s=timeout_s) for u in urls}
    clients = dict(live)
    failed: dict[str, str] = {}

    async def on_all(call) -> None:
        names = list(live)
        results = await asyncio.gather(*(call(live[u]) for u in names), return_exceptions=True)
        for u, r in zip(names, results):
            if isinstance(r, BaseException):
                failed[u] = f"{type(r).__name__}: {r}"[:300]
                live.pop(u)

    total_bytes = 0
    buckets = 0
    t_paused = t0
    begun: set[str] = set()
    try:
        await on_all(lambda c: c.pause_generation(pause_mode))
        t_paused = time.perf_counter()
        await on_all(lambda c: c.begin_weight_update())
        begun = set(live)
        paths = []
        if fp8:
            from agentrl.sync.nccl_export import quantize_named
            named = quantize_named(named, fp8=True)
        for i, bucket in enumerate(bucket_named_tensors(named, bucket_bytes)):
            p = tmp / f"bucket_{i:04d}.safetensors"
            save_file(bucket, str(p))
            total_bytes += sum(t.numel() * t.element_size() for t in bucket.values())
            paths.append(p)
        buckets = len(paths)
        for i, p in enumerate(paths):
            last = i == len(paths) - 1
            await on_all(lambda c, p=p, last=last: c.update_weights_from_tensor(
                [str(p)], load_format="safetensors_path", flush_cache=last and pause_mode != "in_place",
                weight_version=version if last else None))
        await on_all(lambda c: c.end_weight_update())
    finally:
        try:
            # An engine dropped mid-update stays paused (the caller restarts it) but its session is
            # closed, so that sending it the weights again can begin a new one.
            await asyncio.gather(*(clients[u].end_weight_update() for u in begun if u in failed),
                                 return_exceptions=True)
            await asyncio.gather(*(c.continue_generation() for c in live.values()), return_exceptions=True)
        finally:
            await asyncio.gather(*(c.aclose() for c in clients.values()), return_exceptions=True)
            shutil.rmtree(tmp, ignore_errors=True)
    t1 = time.perf_counter()
    return {"sync_s": t1 - t0, "sync_paused_s": t1 - t_paused, "sync_bytes": total_bytes, "sync_buckets": buckets,
            "sync_gbps": total_bytes / max(t1 - t0, 1e-9) / 1e9, "failed_engines": failed}
