"""Engines of a run: one EngineActor per (engine, node) running the engine's server process where
Ray placed it, and the driver-side EngineGroup that starts, watches and stops them.

(Interim version written by the integrator so the run loop can be exercised; the engine helper's
full version - multi-node rendezvous, restart backoff per engine, ports per node - replaces it.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from agentrl.config.plan import EngineSpec, RunPlan
from agentrl.config.schema import RunConfig


class EngineActor:
    """One node's process of one engine (plain class; EngineGroup makes it a Ray actor)."""

    def __init__(self, cfg: dict, spec: dict, node_rank: int, run_id: str, run_dir: str):
        self.cfg = RunConfig.model_validate(cfg)
        self.spec = EngineSpec(**spec)
        self.node_rank, self.run_id, self.run_dir = node_rank, run_id, Path(run_dir)
        self.proc = None
        self.url: str | None = None
        self.node_ip = _node_ip()

    def __repr__(self) -> str:
        spec = getattr(self, "spec", None)  # a constructor that failed leaves no spec
        return (f"EngineActor(engine {spec.index if spec else '?'} node_rank {getattr(self, 'node_rank', '?')} "
                f"on {getattr(self, 'node_ip', '?')})")

    async def start(self, dist_init_addr: str | None = None) -> str | None:
        from agentrl.cluster.engine_process import EngineProcess, free_port
        from agentrl.rollout.engine_cmd import engine_argv

        host = self.cfg.cluster.host
        bind = self.node_ip if host == "node_ip" else host
        port = self.spec.port or free_port(bind)
        advertised = self.node_ip if bind in ("0.0.0.0", "node_ip") else bind
        argv = engine_argv(self.cfg, self.spec, node_rank=self.node_rank, host=bind, port=port,
                           dist_init_addr=dist_init_addr)
        self.url = f"http://{advertised}:{port}"
        log = self.run_dir / "logs" / f"engine_{self.spec.index}_node{self.node_rank}.log"
        self.proc = EngineProcess(argv, self.url, log, env=self.spec.env)
        await self.proc.start()
        return self.url if self.node_rank == 0 else None

    async def ensure_alive(self) -> bool:
        return await self.proc.ensure_alive()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def server_info(self) -> dict:
        from agentrl.rollout.client import EngineClient

        async with EngineClient(self.url, timeout_s=5.0) as c:
            return await c.server_info()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


class EngineGroup:
    """Every engine of a plan, as one object the orchestrator awaits."""

    def __init__(self, cfg: RunConfig, plan: RunPlan, run_dir: Path, run_id: str):
        self.cfg, self.plan, self.run_dir, self.run_id = cfg, plan, Path(run_dir), run_id
        self.actors: list[list] = []  # per engine, per node_rank
        self.urls: list[str] = []

    async def start(self) -> list[str]:
        import ray
        from dataclasses import asdict

        from agentrl.cluster.placement import engine_slots

        slots = await asyncio.to_thread(engine_slots, self.plan, self.run_id)
        cls = ray.remote(EngineActor)
        cfg = self.cfg.model_dump(mode="json")
        for e, per_node in zip(self.plan.engines, slots, strict=True):
            self.actors.append([cls.options(name=f"{self.run_id}-engine-{e.index}-node{k}", max_concurrency=4,
                                            **slot.options()).remote(cfg, asdict(e), k, self.run_id, str(self.run_dir))
                                for k, slot in enumerate(per_node)])
        self.urls = list(await asyncio.gather(*(nodes[0].start.remote(None) for nodes in self.actors)))
        return self.urls

    async def check(self, on_down: Callable[[int], Awaitable[None]] | None = None) -> list[int]:
        """Engines found dead since the last check, restarted (their routers told first)."""
        restarted = []
        for i, nodes in enumerate(self.actors):
            if not await nodes[0].alive.remote():
                if on_down is not None:
                    await on_down(i)
                await nodes[0].ensure_alive.remote()
                restarted.append(i)
        return restarted

    async def server_info(self, i: int) -> dict:
        return await self.actors[i][0].server_info.remote()

    async def pid(self, i: int) -> int | None:
        return await self.actors[i][0].pid.remote()

    async def stop(self) -> None:
        await asyncio.gather(*(a.stop.remote() for nodes in self.actors for a in nodes), return_exceptions=True)
