"""One weight update across the trainer's ranks: the driver's loop and each rank's part.

`UpdateDriver` (beside TrainerGroup, on the driver): open the engines' session (agentrl.sync.
session), then for every pipeline stage in turn ask that stage's ranks to `send_stage` (the
stage's sender sends, its TP / EP peers take part in the export, the other stages wait: module
docstring of agentrl.sync.transport); a stage that breaks off is sent once more to the engines
still alive (an engine that no longer answers /health is dropped, the group is rebuilt for the
others); close the session, checking every engine's receipt against what the stages sent.

`RankUpdater` (in each TrainerWorker): the plan's transport and this rank's weight source.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

from agentrl.sync.session import EngineSession, run_update
from agentrl.sync.transport import StageRequest, StageResult, WeightTransport


def make_transport(kind: str, *, rank: int, node_ip: str, device: Any) -> WeightTransport:
    """The transport of `kind` for one trainer rank (`node_ip`: where engines reach its groups)."""
    if kind == "http_tensors":
        from agentrl.sync.weights import HttpTensorsTransport

        return HttpTensorsTransport(rank=rank, device=device)
    if kind == "nccl":
        from agentrl.sync.nccl import NcclTransport

        return NcclTransport(rank=rank, device=device, node_ip=node_ip)
    if kind == "cuda_ipc":
        from agentrl.sync.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(rank=rank, device=device)
    raise ValueError(f"rollout.weight_transport={kind!r}: use http_tensors, nccl or cuda_ipc")


def engine_ranks(plan: Any) -> int:
    """TP ranks of each engine (every engine of a plan has the same width)."""
    widths = {max(int(e.gpus), 1) for e in plan.engines}
    if len(widths) != 1:
        raise ValueError(f"engines of different widths {sorted(widths)}: weight-update groups need equal engines")
    return widths.pop()


def fp8_names(cfg: Any) -> tuple[frozenset[str], bool]:
    """(names to send FP8, whether the ranks apply agentrl.sync.fp8.fp8_rule instead): exactly the
    tensors the rollout checkpoint holds in FP8 when it is readable here (none for a bf16 one),
    else the rule `prepare --fp8` converts with (a named model without a checkpoint)."""
    if not cfg.rollout.weight_sync_fp8:
        return frozenset(), False
    from agentrl.sync.fp8 import fp8_names_of_checkpoint

    for folder in (cfg.model.rollout_local_dir, cfg.model.rollout_path):
        if folder is not None and Path(folder).is_dir():
            return fp8_names_of_checkpoint(folder), False
    return frozenset(), True


class UpdateDriver:
    """The driver's side of weight updates for one TrainerGroup (module docstring)."""

    def __init__(self, cfg: Any, plan: Any, actors: list[Any]):
        self.cfg, self.plan, self.actors = cfg, plan, actors
        lay = plan.layout
        self.stage_ranks = {s: [r for r in range(lay.world) if lay.coords(r).pp == s] for s in range(lay.pp)}
        self.width = engine_ranks(plan)
        self.fp8, self.fp8_rule = fp8_names(cfg)

    async def _stage(self, request: StageRequest) -> StageResult:
        answers = await asyncio.gather(*(self.actors[r].send_stage.remote(request) for r in self.stage_ranks[request.stage]))
        results = [StageResult.from_json(a) for a in answers]
        senders = [x for x in results if x.sender]
        if len(senders) != 1:
            raise RuntimeError(f"stage {request.stage} had {len(senders)} senders; the plan's layout names one")
        return senders[0]

    async def push(self, urls: list[str]) -> dict[str, Any]:
        r = self.cfg.rollout
        session = EngineSession(list(urls), pause_mode=r.pause_mode, timeout_s=r.request_timeout_s)

        def request(stage: int, live: list[str]) -> StageRequest:
            return StageRequest(stage, tuple(live), -1, stage == self.plan.layout.pp - 1, r.pause_mode != "in_place",
                                self.fp8, r.weight_bucket_mb << 20, r.request_timeout_s,
                                (self.width,) * len(live), self.fp8_rule)

        return await run_update(session, self.plan.layout.pp, request, self._stage)


class RankUpdater:
    """One trainer rank's transport and weight source, built from the plan."""

    def __init__(self, cfg: Any, plan: Any, rank: int, node_ip: str, backend: Any):
        import torch

        from agentrl.sync.transport import transport_refusal

        why = transport_refusal(plan.weight_transport, plan.engine_kind, plan.colocated,
                                trainer_ranks=plan.layout.world)
        if why:
            raise ValueError(why)
        device = getattr(backend, "device", None) or (torch.device("cuda", torch.cuda.current_device())
                                                        if torch.cuda.is_available() and plan.gpus_per_rank else "cpu")
        self.backend, self.rank = backend, rank
        self.transport = make_transport(plan.weight_transport, rank=rank, node_ip=node_ip, device=device)
        self._source = None

    def source(self) -> Any:
        if self._source is None:
            from agentrl.sync.source import source_for

            self._source = source_for(self.backend, self.rank)
        return self._source

    async def send_stage(self, request: StageRequest) -> dict[str, Any]:
        source = self.source()
        if source.stage != request.stage:
            return StageResult().to_json()
        fp8 = request.fp8
        if request.fp8_rule:  # every rank of the stage derives the same names from the same specs
            from agentrl.sync.fp8 import fp8_rule

            fp8 = fp8 | {s.name for s in source.specs() if fp8_rule(s)}
        request = replace(request, version=self.backend.version, fp8=frozenset(fp8))
        return (await self.transport.send_stage(source, request)).to_json()

    def close(self) -> None:
        self.transport.close()
