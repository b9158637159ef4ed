"""Rehearsal-mode stand-ins for the run's actors: they are placed exactly like the real ones but
only do control-plane work (rank bookkeeping, update-group membership, start-up and shutdown),
never load a model. Plain classes; the rehearsal makes them Ray actors (importing starts nothing).

Each one records where Ray put it: node id, the GPU ids Ray assigned (what CUDA_VISIBLE_DEVICES
would be) and its assigned resources.
"""

from __future__ import annotations

import os
import time
from typing import Any


def where() -> dict[str, Any]:
    import ray

    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "gpu_ids": sorted(int(g) for g in ray.get_gpu_ids()),
            "resources": {k: v for k, v in ctx.get_assigned_resources().items() if v}, "pid": os.getpid()}


def rank_view(rank: int, layout: dict[str, int]) -> dict[str, Any]:
    """What a TrainerWorker works out for itself at start-up: its coordinates and group members,
    computed on its own from its rank and the layout (so a rank given a different layout shows up
    as an inconsistent group)."""
    from agentrl.config.layout import Layout

    lay = Layout.from_json(layout)
    coords = lay.coords(rank)
    groups = {kind: next(g for g in gs if rank in g) for kind, gs in lay.groups().items()}
    return {"rank": rank, "coords": coords.to_json(), "groups": groups}


def trainer_rank_info(rank: int, layout: dict[str, int]) -> dict[str, Any]:
    return {**rank_view(rank, layout), **where()}


def probe_trainer_rank(rank: int, layout: dict[str, int]) -> dict[str, Any]:
    """Task form of a trainer rank, for plans with more ranks than the rehearsal starts actors for:
    runs in the rank's own bundle with the rank's resources and reports the same facts."""
    return {**trainer_rank_info(rank, layout), "started_at": time.time(), "kind": "task"}


class RehearsalTrainer:
    """One per training GPU: stands for TrainerWorker (one Megatron rank)."""

    def __init__(self, rank: int, layout: dict[str, int]):
        self.started_at = time.time()
        self.info = trainer_rank_info(rank, layout)
        self.joined: list[dict[str, Any]] = []

    def report(self) -> dict[str, Any]:
        return {**self.info, "started_at": self.started_at, "kind": "actor"}

    def join_update_group(self, name: str, group_rank: int, world_size: int) -> dict[str, Any]:
        if not 0 <= group_rank < world_size:
            raise ValueError(f"group rank {group_rank} outside a group of {world_size}")
        rec = {"group": name, "group_rank": group_rank, "world_size": world_size, "at": time.time()}
        self.joined.append(rec)
        return rec

    def shutdown(self) -> float:
        return time.time()


class RehearsalEngine:
    """One per engine (on its first node): stands for EngineActor; never starts SGLang."""

    def __init__(self, index: int, gpus: int, nodes: list[int], url: str):
        self.started_at = time.time()
        self.index, self.gpus, self.nodes, self.url = index, gpus, list(nodes), url
        self.joined: list[dict[str, Any]] = []

    def report(self) -> dict[str, Any]:
        return {"index": self.index, "gpus": self.gpus, "nodes": self.nodes, "url": self.url,
                "started_at": self.started_at, **where()}

    def join_update_group(self, name: str, group_ranks: list[int], world_size: int) -> dict[str, Any]:
        """Every GPU of the engine joins the group (SGLang's init_weights_update_group takes a rank
        offset per engine); returns the ranks taken."""
        if len(group_ranks) != max(self.gpus, 1) or any(not 0 < r < world_size for r in group_ranks):
            raise ValueError(f"engine {self.index}: group {name} gave ranks {group_ranks} for {self.gpus} GPUs "
                             f"in a group of {world_size} (rank 0 is the sender)")
        rec = {"group": name, "group_ranks": list(group_ranks), "world_size": world_size, "at": time.time()}
        self.joined.append(rec)
        return rec

    def shutdown(self) -> float:
        return time.time()


class RehearsalEngineNode:
    """The process an engine that spans nodes needs on each further node (SGLang node_rank >= 1)."""

    def __init__(self, index: int, node_rank: int):
        self.started_at = time.time()
        self.index, self.node_rank = index, node_rank

    def report(self) -> dict[str, Any]:
        return {"index": self.index, "node_rank": self.node_rank, "started_at": self.started_at, **where()}

    def shutdown(self) -> float:
        return time.time()


class RehearsalBuffer:
    """Stands for ReplayBuffer: accepts a probe trajectory id from each worker."""

    def __init__(self):
        self.started_at = time.time()
        self.seen: list[str] = []

    def add(self, item: str) -> int:
        self.seen.append(item)
        return len(self.seen)

    def report(self) -> dict[str, Any]:
        return {"started_at": self.started_at, "seen": list(self.seen), **where()}

    def shutdown(self) -> float:
        return time.time()


class RehearsalEpisodeWorker:
    """Stands for EpisodeWorker with its in-process session-affine router: builds the real hash
    ring over the engine URLs and checks the buffer answers."""

    def __init__(self, index: int, engine_urls: list[str], buffer: Any):
        from agentrl.rollout.router import HashRing

        self.started_at = time.time()
        self.index, self.buffer = index, buffer
        self.ring = HashRing(list(engine_urls))
        self.urls = list(engine_urls)

    async def report(self, sessions: int = 4096) -> dict[str, Any]:
        hits: dict[str, int] = {u: 0 for u in self.urls}
        for s in range(sessions):
            hits[self.ring.lookup(f"probe-{self.index}-{s}")] += 1
        await self.buffer.add.remote(f"worker-{self.index}")
        return {"index": self.index, "started_at": self.started_at, "router_engines": len(self.ring.nodes),
                "sessions_per_engine": hits, **where()}

    def shutdown(self) -> float:
        return time.time()
