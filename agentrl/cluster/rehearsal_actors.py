"""What the rehearsal still stands in for: the replay buffer and the episode workers (the trainer
ranks and engines it places are the run's own TrainerWorker and EngineActor). The worker builds the
real hash ring over the engines' URLs; the buffer counts who reached it. Plain classes; the rehearsal
makes them Ray actors (importing starts nothing). `where()` is what Ray says about the calling
actor or task: node id, assigned GPU ids (its CUDA_VISIBLE_DEVICES), resources, pid.
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
