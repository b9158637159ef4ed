"""The http_tensors transport: buckets as safetensors files on the engines' host.

Each planned bucket (agentrl.sync.buckets) is written once as a .safetensors file whose data
section is the bucket's flat buffer as planned (the header names each wire entry's byte range; no
copy beyond the fill), under /dev/shm, and every engine loads it with `/update_weights_from_tensor`
{serialized_named_tensors: [path], load_format: "safetensors_path"}. An engine that fails a call
is dropped from the rest of the update (a dead engine must not stall the others); files are
removed once every engine has answered.

`push_weights` is the same path for tensors at hand (one process: an evaluation engine, a
benchmark): session, one stage, session closed (agentrl.sync.session, agentrl.sync.update).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from agentrl.sync.buckets import PlannedBucket
from agentrl.sync.session import EngineLinks
from agentrl.sync.stage import StageSender
from agentrl.sync.transport import StageRequest

SAFETENSORS_DTYPES = {"float32": "F32", "float64": "F64", "bfloat16": "BF16", "float16": "F16",
                      "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int64": "I64", "int32": "I32",
                      "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write_safetensors(path: Path, bucket: PlannedBucket, flat: torch.Tensor) -> None:
    """A .safetensors file of the bucket: header from the plan, data = the flat buffer."""
    header = {e.name: {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [o, o + e.nbytes]}
              for e, o in zip(bucket.entries, bucket.offsets, strict=True)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.write(memoryview(flat.cpu().numpy()))


class _FilePending:
    def __init__(self, links: EngineLinks, futures: dict, path: Path):
        self.links, self.futures, self.path = links, futures, path

    def wait(self) -> None:
        try:
            self.links.collect(self.futures)
        finally:
            self.path.unlink(missing_ok=True)


class HttpTensorsTransport(StageSender):
    kind = "http_tensors"

    def __init__(self, *, rank: int = 0, device="cpu", scratch_dir: str | None = None):
        super().__init__(rank=rank, device=device)
        self.scratch_dir = scratch_dir
        self._tmp: Path | None = None

    def bucket_device(self) -> torch.device:
        return torch.device("cpu")  # the file is written from host memory

    async def prepare(self, links: EngineLinks, request: StageRequest) -> None:
        base = self.scratch_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self._tmp = Path(tempfile.mkdtemp(prefix="agentrl-weights-", dir=base))

    def send_bucket(self, links, request, bucket, flat, last):
        path = self._tmp / f"stage{request.stage}_bucket_{bucket.index:04d}.safetensors"
        write_safetensors(path, bucket, flat)
        version = request.version if last else None
        futures = links.post(links.live, lambda c: c.update_weights_from_tensor(
            [str(path)], load_format="safetensors_path", flush_cache=last and request.flush, weight_version=version))
        return _FilePending(links, futures, path)

    async def finish(self, links, request) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


async def push_weights(urls: list[str], named: Iterable[tuple[str, torch.Tensor]], version: int, *,
                       pause_mode: str = "retract", bucket_bytes: int = 256 << 20, scratch_dir: str | None = None,
                       timeout_s: float = 600.0, fp8: bool = False) -> dict:
    """Send `named` to every engine at `urls` as weight version `version` over http_tensors.
    fp8: projection weights go FP8 block-quantised (agentrl.sync.fp8.fp8_rule). Returns the run
    loop's keys: sync_s, sync_paused_s, sync_bytes, sync_buckets, sync_gbps, failed_engines."""
    from agentrl.sync.fp8 import fp8_rule
    from agentrl.sync.session import EngineSession, run_update
    from agentrl.sync.source import LocalSource

    source = LocalSource(named)
    names = frozenset(s.name for s in source.specs() if fp8_rule(s)) if fp8 else frozenset()
    transport = HttpTensorsTransport(scratch_dir=scratch_dir)

    def request(stage: int, live: list[str]) -> StageRequest:
        return StageRequest(stage, tuple(live), version, True, pause_mode != "in_place", names, bucket_bytes, timeout_s)

    session = EngineSession(list(urls), pause_mode=pause_mode, timeout_s=timeout_s)
    return await run_update(session, 1, request, lambda req: transport.send_stage(source, req))
