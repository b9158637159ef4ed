"""The trainer: one TrainerWorker actor per trainer rank, driven together by a TrainerGroup.

- Placement: rank r takes slot r of agentrl.cluster.placement.trainer_slots (ordered by node,
  then GPU; num_gpus=gpus_per_rank, so Ray sets CUDA_VISIBLE_DEVICES and the rank's device is 0).
- Rendezvous: rank 0 reports its node IP and a port free there; every rank gets them as
  arguments (agentrl.train.megatron_parallel.DistInit) with its RANK / WORLD_SIZE / LOCAL_RANK.
  Nothing is derived from the environment or a pid.
- Every call (train_step, named weights for a push, save, resume) goes to all ranks at once, since
  the backend's collectives need every rank; the metrics, versions and checkpoint extras are the
  same on every rank (the backend reduces them), and rank 0's are returned.
- Data: train_step receives the batch as the replay buffer's ObjectRef: each rank's node pulls it
  from the object store; the driver never holds the tokens.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

from agentrl.config.plan import RunPlan
from agentrl.config.schema import RunConfig


class TrainerWorker:
    """One trainer rank (plain class; TrainerGroup makes it a Ray actor)."""

    def __init__(self, cfg: dict, plan: dict, rank: int, run_id: str, run_dir: str):
        self.cfg = RunConfig.model_validate(cfg)
        self.plan = RunPlan.from_json(plan)
        self.rank, self.run_id, self.run_dir = rank, run_id, Path(run_dir)
        self.coords = self.plan.layout.coords(rank)
        self.backend = None
        self.updater = None  # weight-update transport and source, built at the first update
        self.node_ip = _node_ip()

    def __repr__(self) -> str:
        if not hasattr(self, "coords"):  # a constructor that failed
            return f"TrainerWorker(rank {getattr(self, 'rank', '?')})"
        return f"TrainerWorker(rank {self.rank}/{self.plan.layout.world}: {self.coords.label()} on {self.node_ip})"

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: this node's IP and a TCP port free on it, for torch.distributed's rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            return self.node_ip, s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> dict:
        """Join the trainer's world and build this rank's backend from the plan."""
        from agentrl.train.dist_init import DistInit
        from agentrl.train.factory import make_backend

        world = self.plan.layout.world
        local = self.rank % self.plan.ranks_per_train_node
        # For libraries that look (Megatron's logging, NCCL's debug output); agentrl passes them explicitly.
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(world), LOCAL_RANK="0" if self.plan.gpus_per_rank else str(local))
        dist_init = DistInit(self.rank, world, master_addr, master_port, local_rank=0)
        self.backend = make_backend(self.cfg, self.plan, dist_init, self.run_dir)
        groups = {kind: next(g for g in gs if self.rank in g) for kind, gs in self.plan.layout.groups().items()}
        return {"rank": self.rank, "coords": self.coords.to_json(), "groups": groups, "node_ip": self.node_ip,
                "pid": os.getpid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def version(self) -> int:
        return self.backend.version

    def resume(self) -> dict | None:
        """Load the latest checkpoint if there is one; returns its extra state (step, counters)."""
        latest = self.run_dir / "checkpoints" / "latest"
        if not latest.exists():
            return None
        return self.backend.load_checkpoint(latest)

    def train_step(self, trajectories: list) -> dict[str, float]:
        metrics = self.backend.train_step(trajectories, [t.group_id for t in trajectories])
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # This rank's high-water mark since it started (weights, grads, optimizer, activations).
            metrics["trainer_peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
        return metrics

    def placement(self) -> dict:
        """Where Ray put this rank: node id, the GPU ids it was given (CUDA_VISIBLE_DEVICES), pid."""
        import ray

        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "node_ip": self.node_ip,
                "gpu_ids": sorted(int(g) for g in ray.get_gpu_ids()), "pid": os.getpid()}

    async def send_stage(self, request: Any) -> dict[str, Any]:
        """This rank's part of one pipeline stage of a weight update (agentrl.sync.update): the
        stage's sender sends over the plan's transport, its TP / EP peers join the export."""
        if self.updater is None:
            from agentrl.sync.update import RankUpdater

            self.updater = RankUpdater(self.cfg, self.plan, self.rank, self.node_ip, self.backend)
        return await self.updater.send_stage(request)

    def save_checkpoint(self, extra: dict) -> None:
        self.backend.save_checkpoint(self.run_dir / "checkpoints" / "latest", extra)


# After one rank's call fails, how long the others get to report before the group raises. When a
# rank dies, its peers' collectives fail at once (gloo: "Connection reset by peer"), often before
# Ray has noticed the death (seen under load in the local_cluster test); the death is the cause
# worth naming. Seconds, not minutes: a peer stuck in an NCCL collective would never answer.
RANK_DEATH_GRACE_S = 10.0


async def gather_ranks(calls: list[Any]) -> list[Any]:
    """Every rank's answer, in rank order. If any fails, raise the root cause: a rank that died
    (RayActorError) rather than a survivor's collective error, waiting up to RANK_DEATH_GRACE_S
    for the others to report."""
    from ray.exceptions import RayActorError

    async def answer(call: Any) -> Any:
        return await call

    futures = [asyncio.ensure_future(answer(c)) for c in calls]
    _, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
    if pending:
        await asyncio.wait(pending, timeout=RANK_DEATH_GRACE_S)
    for f in futures:
        if not f.done():
            f.cancel()  # the wrapper only: the rank's task runs on
    errors = [f.exception() for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
    if not errors:
        return [f.result() for f in futures]
    raise next((e for e in errors if isinstance(e, RayActorError)), errors[0])


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside a Ray worker: the loopback is this process's node
        pass
    return "127.0.0.1"


class TrainerGroup:
    """All trainer ranks of a plan, as one object the orchestrator awaits."""

    def __init__(self, cfg: RunConfig, plan: RunPlan, run_id: str, run_dir: Path, slots: list | None = None):
        """`slots`: one placement slot per rank (agentrl.cluster.placement.trainer_slots; made at start
        when not given)."""
        self.cfg, self.plan, self.run_id, self.run_dir = cfg, plan, run_id, Path(run_dir)
        self.slots = slots
        self.actors: list[Any] = []
        self.info: list[dict] = []
        self.updater = None  # the weight-update driver, made at the first push

    async def start(self) -> None:
        """Place one actor per rank, rendezvous at rank 0's node, build every rank's backend."""
        import ray

        from agentrl.cluster.placement import trainer_slots

        slots = self.slots or await asyncio.to_thread(trainer_slots, self.plan, self.run_id)
        cfg, plan = self.cfg.model_dump(mode="json"), self.plan.to_json()
        cls = ray.remote(TrainerWorker)
        self.actors = [cls.options(name=f"{self.run_id}-trainer-{r}", **slots[r].options()).remote(
            cfg, plan, r, self.run_id, str(self.run_dir)) for r in range(self.plan.layout.world)]
        addr, port = await self.actors[0].rendezvous_address.remote()
        self.info = list(await asyncio.gather(*(a.setup.remote(addr, port) for a in self.actors)))

    async def _all(self, method: str, *args: Any) -> list[Any]:
        return await gather_ranks([getattr(a, method).remote(*args) for a in self.actors])

    async def version(self) -> int:
        return await self.actors[0].version.remote()

    async def resume(self) -> dict | None:
        extras = await self._all("resume")
        if any((e is None) != (extras[0] is None) for e in extras):
            raise RuntimeError("trainer ranks disagree on whether a checkpoint exists in "
                               f"{self.run_dir}/checkpoints/latest; is the run dir shared by every training node?")
        return extras[0]

    async def train_step(self, batch_ref: Any) -> dict[str, float]:
        """One optimizer step on the batch behind `batch_ref` (an ObjectRef of its trajectories)."""
        return (await self._all("train_step", batch_ref))[0]

    async def push_weights(self, urls: list[str]) -> dict[str, Any]:
        """The current weights to the engines at `urls`, stage by stage over the plan's transport
        (agentrl.sync.update.UpdateDriver); returns sync_s, sync_bytes, sync_gbps, sync_paused_s,
        failed_engines (and sync_buckets, sync_tensors, sync_retries)."""
        if self.updater is None:
            from agentrl.sync.update import UpdateDriver

            self.updater = UpdateDriver(self.cfg, self.plan, self.actors)
        return await self.updater.push(urls)

    async def save_checkpoint(self, extra: dict) -> None:
        await self._all("save_checkpoint", extra)

    def kill(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
