"""The part every transport shares: one stage's sender loop.

On the stage's sender: plan the buckets (agentrl.sync.buckets, from the source's specs and the
update's FP8 names), walk the source on a worker thread filling them (nccl_export.BucketStream),
hand each full bucket to the transport's `send_bucket`, and account for it (bytes, HF tensors and
their names digest, the engines that failed). On the stage's other participants: walk the source
with nothing to emit, so the trainer's gathers and expert sends meet the sender's.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from agentrl.sync.buckets import PlannedBucket, names_digest, plan_buckets
from agentrl.sync.nccl_export import BucketStream, Pending
from agentrl.sync.session import EngineLinks
from agentrl.sync.transport import StageRequest, StageResult


class StageSender:
    """Base of the three transports; subclasses implement `send_bucket` (and may `prepare`)."""

    kind = "base"

    def __init__(self, *, rank: int = 0, device: Any = "cpu"):
        self.rank, self.device = rank, torch.device(device)
        self.broken = False  # set by send_bucket when the transfer breaks off (the rest is not sent)

    def bucket_device(self) -> torch.device:
        return self.device

    async def prepare(self, links: EngineLinks, request: StageRequest) -> None:
        """Before the first bucket (group set-up); engines that fail go to links.failed."""

    def send_bucket(self, links: EngineLinks, request: StageRequest, bucket: PlannedBucket, flat: torch.Tensor,
                    last: bool) -> Pending:
        raise NotImplementedError

    async def finish(self, links: EngineLinks, request: StageRequest) -> None:
        """After the last bucket (e.g. tear a broken group down)."""

    async def send_stage(self, source: Any, request: StageRequest) -> StageResult:
        if not source.participates:
            return StageResult()
        if self.rank != source.sender:
            await asyncio.to_thread(source.run, lambda name, t: None, request.fp8)
            return StageResult()
        t0 = time.perf_counter()
        specs = source.specs()
        buckets = plan_buckets(specs, request.bucket_bytes, request.fp8)
        links = EngineLinks(request.urls, request.timeout_s, asyncio.get_running_loop())
        self.broken = False
        stream = BucketStream(buckets, self.bucket_device(),
                              lambda b, flat, last: self.send_bucket(links, request, b, flat, last and request.last_stage))
        try:
            await self.prepare(links, request)
            await asyncio.to_thread(self._export, source, stream, request.fp8)
            await self.finish(links, request)
        finally:
            await links.aclose()
        stats = stream.stats
        return StageResult(sender=True, bytes=stats.bytes, buckets=stats.buckets, tensors=len(specs),
                           names_digest=names_digest(s.name for s in specs), seconds=time.perf_counter() - t0,
                           failed=dict(links.failed), broken=self.broken)

    @staticmethod
    def _export(source: Any, stream: BucketStream, fp8: frozenset[str]) -> None:
        source.run(stream.put, fp8)
        stream.close()

    def close(self) -> None:
        return None
