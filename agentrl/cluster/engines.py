"""The run's inference engines as Ray actors: one EngineActor per (engine, node), driven by one
EngineGroup on the driver.

An EngineActor starts its node's engine process (engine_argv, built on that node: only it knows
its IP and free ports) where Ray placed it: Ray set CUDA_VISIBLE_DEVICES from the actor's GPU
share, and the process inherits it. Node 0 of an engine serves HTTP; its URL advertises the node's
IP unless the engine is bound to one specific address (cluster.host: "127.0.0.1" locally,
"0.0.0.0" or "node_ip" across nodes). The HTTP port is chosen once and kept across restarts, so an
engine's URL, its identity on the router's ring, never changes.

A multi-node engine starts as SGLang's do: node 0 reserves a dist-init address (a free block of
ports on its node), then every node starts with it at once (node 0 only reports healthy when all
have joined). `EngineGroup.check()` finds engines with any dead node and restarts each whole, all
its nodes, with backoff; the orchestrator then sends it the current weights again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from agentrl.config.schema import RunConfig

# SGLang binds its dist-init port and, with attention DP, the 6 ports after it on node 0
# (server_args.PortArgs: port_base = dist_init_port + 1, then 6 derived ports from there).
DIST_INIT_PORT_SPAN = 7
RESTART_BACKOFF_MAX_S = 30.0
RESTART_RESET_AFTER_S = 600.0  # an engine up this long starts its restart count from zero again
ANY_ADDRESS = ("0.0.0.0", "::", "")


class EngineGroupError(RuntimeError):
    """An engine could not be started or kept alive; the message names it and its logs."""


def bind_and_advertise(host: str, node_ip: str) -> tuple[str, str]:
    """(address the engine binds, address its URL advertises) for cluster.host on a node."""
    if host == "node_ip":
        return node_ip, node_ip
    if host in ANY_ADDRESS:
        return host or "0.0.0.0", node_ip
    return host, host


def actor_name(run_id: str, index: int, node_rank: int) -> str:
    return f"{run_id}-engine-{index}-node{node_rank}"


def log_name(index: int, node_rank: int) -> str:
    return f"engine_{index}_node{node_rank}.log"


class EngineActor:
    """One node's process of one engine. A plain class: EngineGroup makes it a Ray actor."""

    def __init__(self, cfg: dict, spec, node_rank: int, run_id: str, run_dir: str) -> None:
        from agentrl.config.plan import EngineSpec

        self.cfg = RunConfig.model_validate(cfg)
        self.spec = EngineSpec(**spec) if isinstance(spec, dict) else spec
        self.node_rank, self.run_id = node_rank, run_id
        self.ip = _ray_node_ip()
        self.bind, self.advertise = bind_and_advertise(self.cfg.cluster.host, self.ip)
        self.log_path = Path(run_dir) / "logs" / log_name(self.spec.index, node_rank)
        self.port: int | None = None  # chosen at the first start, kept across restarts
        self.argv: list[str] | None = None
        self.proc = None

    def __repr__(self) -> str:
        return f"engine {self.spec.index} node_rank {self.node_rank} on {self.ip}"

    def node_ip(self) -> str:
        return self.ip

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def placement(self) -> dict:
        """Where Ray put this actor: node id, the GPU ids it was given (its process's
        CUDA_VISIBLE_DEVICES), the actor's pid and its engine process's pid."""
        import os

        import ray

        return {"engine": self.spec.index, "node_rank": self.node_rank, "node_id": self.node_id(),
                "node_ip": self.ip, "gpu_ids": sorted(int(g) for g in ray.get_gpu_ids()), "pid": os.getpid(),
                "process_pid": self.pid()}

    def reserve_dist_init(self) -> str:
        """"ip:port" of this engine's rendezvous: a block of DIST_INIT_PORT_SPAN ports free on this node."""
        from agentrl.cluster.engine_process import free_port_block

        if self.node_rank != 0:
            raise EngineGroupError(f"{self!r}: only node_rank 0 hosts the dist-init address")
        return f"{self.ip}:{free_port_block('0.0.0.0', DIST_INIT_PORT_SPAN)}"

    async def start(self, dist_init_addr: str | None, port: int | None = None) -> str | None:
        """Start the process and wait for health (node_rank 0); returns the URL on node_rank 0.
        `port`: the HTTP port to keep (a replacement actor restarting an engine that had one)."""
        from agentrl.cluster.engine_process import EngineProcess, free_port
        from agentrl.rollout.engine_cmd import engine_argv

        if self.proc is not None and self.proc.alive():
            await self.stop()
        probe = "0.0.0.0" if self.bind in ANY_ADDRESS else self.bind
        if port:
            self.port = port
        if self.port is None:
            self.port = self.spec.port or free_port(probe)
        nccl_port = free_port(probe) if self.spec.kind == "sglang" else None
        self.argv = engine_argv(self.cfg, self.spec, node_rank=self.node_rank, host=self.bind, port=self.port,
                                dist_init_addr=dist_init_addr, nccl_port=nccl_port)
        url = f"http://{self.advertise}:{self.port}" if self.node_rank == 0 else None
        self.proc = EngineProcess(self.argv, url, self.log_path, env=dict(self.spec.env),
                                  ready_timeout_s=self.cfg.rollout.engine_start_timeout_s)
        await self.proc.start()
        return url

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str] | None:
        """The argv of the current (or last) process."""
        return self.argv

    async def server_info(self) -> dict:
        from agentrl.rollout.client import EngineClient

        if self.node_rank != 0 or self.proc is None:
            raise EngineGroupError(f"{self!r} serves no HTTP; ask node_rank 0")
        async with EngineClient(self.proc.url, timeout_s=10.0) as c:
            return await c.server_info()

    async def stop(self) -> None:
        if self.proc is not None:
            await asyncio.to_thread(self.proc.stop)


class EngineGroup:
    """Driver side: one EngineActor per (engine, node) of the plan, each in its slot
    (agentrl.cluster.placement.engine_slots: per engine, one bundle per node, index = node_rank;
    made at start() unless given)."""

    def __init__(self, cfg: RunConfig, plan, run_dir: str | Path, run_id: str, slots: list[list] | None = None) -> None:
        self.cfg, self.plan = cfg, plan
        self.run_dir, self.run_id, self.slots = Path(run_dir), run_id, slots
        self._cfg = cfg.model_dump(mode="json")
        n = len(plan.engines)
        self.actors: list[list] = []  # per engine, per node_rank
        self._urls: list[str | None] = [None] * n
        self.restarts = [0] * n  # in the current count (reset after RESTART_RESET_AFTER_S up)
        self.total_restarts = 0
        self._up_since = [0.0] * n

    def _make_actor(self, i: int, node_rank: int):
        import ray

        spec = self.plan.engines[i]
        # The slot's num_gpus makes Ray set CUDA_VISIBLE_DEVICES for the actor (0.5: a GPU shared with
        # a trainer rank); the engine process inherits it.
        return ray.remote(EngineActor).options(
            name=actor_name(self.run_id, spec.index, node_rank), **self.slots[i][node_rank].options(),
        ).remote(self._cfg, spec, node_rank, self.run_id, str(self.run_dir))

    def _logs(self, i: int) -> str:
        return ", ".join(str(self.run_dir / "logs" / log_name(i, r)) for r in range(len(self.actors[i])))

    # ---- start / check / stop ------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Create the actors and start every engine; their URLs by engine index."""
        if self.slots is None:
            from agentrl.cluster.placement import engine_slots

            self.slots = await asyncio.to_thread(engine_slots, self.plan, self.run_id)
        self.actors = [[self._make_actor(i, r) for r in range(len(spec.nodes))]
                       for i, spec in enumerate(self.plan.engines)]
        return list(await asyncio.gather(*(self._start_engine(i) for i in range(len(self.actors)))))

    async def _start_engine(self, i: int) -> str:
        from ray.exceptions import RayError

        actors = self.actors[i]
        try:
            addr = await actors[0].reserve_dist_init.remote() if len(actors) > 1 else None
            port = int(self._urls[i].rsplit(":", 1)[1]) if self._urls[i] else None  # kept across restarts
            results = await asyncio.gather(*(a.start.remote(addr, port) for a in actors))
        except (RayError, RuntimeError) as exc:
            await self._stop_engine(i)
            raise EngineGroupError(f"engine {i} did not start: {_cause(exc)}; see {self._logs(i)}") from None
        url = results[0]
        if self._urls[i] is not None and url != self._urls[i]:
            raise EngineGroupError(f"engine {i} came back at {url}, not {self._urls[i]}; its actor was replaced "
                                   "on another node")
        self._urls[i], self._up_since[i] = url, time.monotonic()
        return url

    async def _alive(self, i: int) -> bool:
        answers = await asyncio.gather(*(a.alive.remote() for a in self.actors[i]), return_exceptions=True)
        return all(a is True for a in answers)

    async def check(self, on_down: Callable[[int], Awaitable[None]] | None = None) -> list[int]:
        """Restart every engine with a dead node (all its nodes); returns their indices. `on_down(i)`
        is awaited first for each (routers stop sending to it). Raises EngineGroupError once an
        engine has died more than rollout.engine_max_restarts times in a row."""
        alive = await asyncio.gather(*(self._alive(i) for i in range(len(self.actors))))
        dead = [i for i, ok in enumerate(alive) if not ok]
        if on_down is not None:
            for i in dead:
                await on_down(i)
        await asyncio.gather(*(self._restart(i) for i in dead))
        return dead

    async def _restart(self, i: int) -> None:
        limit = self.cfg.rollout.engine_max_restarts
        if time.monotonic() - self._up_since[i] > RESTART_RESET_AFTER_S:
            self.restarts[i] = 0
        while True:
            if self.restarts[i] >= limit:
                raise EngineGroupError(f"engine {i} died {self.restarts[i] + 1} times (rollout.engine_max_restarts="
                                       f"{limit}); see {self._logs(i)}")
            delay = min(2.0 ** self.restarts[i], RESTART_BACKOFF_MAX_S)
            self.restarts[i] += 1
            self.total_restarts += 1
            await self._stop_engine(i)
            await asyncio.sleep(delay)
            try:
                await self._start_engine(i)
                return
            except EngineGroupError:
                continue

    async def _stop_engine(self, i: int) -> None:
        """Stop every node's process; an actor that died is replaced (in its own bundle)."""
        from ray.exceptions import RayError

        answers = await asyncio.gather(*(a.stop.remote() for a in self.actors[i]), return_exceptions=True)
        for r, answer in enumerate(answers):
            if isinstance(answer, RayError):
                self.actors[i][r] = self._make_actor(i, r)

    async def stop(self) -> None:
        import ray

        await asyncio.gather(*(self._stop_engine(i) for i in range(len(self.actors))), return_exceptions=True)
        for actors in self.actors:
            for a in actors:
                ray.kill(a)

    # ---- per engine ----------------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return [self.url(i) for i in range(len(self.actors))]

    def url(self, i: int) -> str:
        if self._urls[i] is None:
            raise EngineGroupError(f"engine {i} has not started; await EngineGroup.start() first")
        return self._urls[i]

    async def pid(self, i: int) -> int | None:
        """The pid of engine i's node-0 process (on its node)."""
        return await self.actors[i][0].pid.remote()

    async def server_info(self, i: int) -> dict:
        return await self.actors[i][0].server_info.remote()

    async def commands(self, i: int) -> list[list[str] | None]:
        """The argv each node of engine i runs."""
        return list(await asyncio.gather(*(a.command.remote() for a in self.actors[i])))


def _ray_node_ip() -> str:
    """The IP Ray knows this actor's node by (ray.util.get_node_ip_address() routes to find the
    host's address, which differs from a node started with _node_ip_address=127.0.0.1)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


def _cause(exc: BaseException) -> str:
    """The innermost message of a Ray task error, one line."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return text[-1] if text else type(cause).__name__
