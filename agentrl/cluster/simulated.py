"""A local Ray cluster that stands for the plan's nodes, on 127.0.0.1 only (the rehearsal, and
`cluster.simulate_nodes` runs).

Cost measured on the 2-core development machine (under load from other work): the head takes
~9 s, each further raylet ~4 s and ~180 MB (a raylet brings a dashboard agent and a runtime-env
agent, ~240 MB RSS together), each actor ~1 s and ~50 MB. One raylet per node would cost 64 x 4 s
and ~12 GB for the 64-node variant, so a raylet hosts up to `nodes_per_raylet` nodes of one role:
- it advertises the sum of their GPUs and CPUs (logical: nothing is reserved on this machine), the
  role resource (agentrl_train / agentrl_inference, as on a real cluster) and one resource per
  simulated node, `agentrl_node_<i>`, holding that node's GPU count;
- every bundle then also asks `agentrl_node_<i>: <its GPUs>` of the node the plan gives it, so Ray
  must find that node's capacity, and GPU ids stay Ray's own (unique per raylet).
With nodes_per_raylet=1 no bundle is pinned: Ray's PACK decides the nodes, as on a real cluster.
Python workers are not prestarted (a raylet would start one per logical CPU).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from agentrl.cluster.roles import INFER_RESOURCE, ROLE_UNITS, TRAIN_RESOURCE

NODE_RESOURCE = "agentrl_node_{}"
_NO_PRESTART = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


@dataclass
class Raylet:
    index: int
    role: str
    nodes: list[int]  # simulated node indices it hosts
    gpus: int
    node_id: str = ""  # Ray's node id once up
    handle: Any = None  # ray._private.node.Node (None for the head)


@dataclass
class SimCluster:
    raylets: list[Raylet]
    head_node_id: str
    started_s: float
    temp_dir: str
    node_of: dict[int, int] = field(default_factory=dict)  # simulated node -> raylet index

    def raylet_of_node_id(self, node_id: str) -> Raylet:
        for r in self.raylets:
            if r.node_id == node_id:
                return r
        raise KeyError(node_id)


def group_nodes(plan, nodes_per_raylet: int) -> list[Raylet]:
    """Consecutive nodes of one role, at most `nodes_per_raylet` per raylet."""
    if nodes_per_raylet < 1:
        raise ValueError(f"nodes_per_raylet must be >= 1, got {nodes_per_raylet}")
    out: list[Raylet] = []
    for nr in plan.node_roles:
        last = out[-1] if out else None
        if last and last.role == nr.role and len(last.nodes) < nodes_per_raylet:
            last.nodes.append(nr.node)
            last.gpus += nr.gpus
        else:
            out.append(Raylet(len(out), nr.role, [nr.node], nr.gpus))
    return out


def role_resources(role: str) -> list[str]:
    return {"train": [TRAIN_RESOURCE], "inference": [INFER_RESOURCE],
            "train+inference": [TRAIN_RESOURCE, INFER_RESOURCE]}[role]


def start_cluster(plan, nodes_per_raylet: int, temp_dir: str, cpus_per_gpu: int = 2,
                  cpus_per_node: int | None = None) -> SimCluster:
    """Head (CPU actors only) plus the raylets; returns once every raylet is alive. Logical CPUs of a
    raylet: `cpus_per_node` per node it hosts when given (CPU plans), else `cpus_per_gpu` per GPU."""
    import ray
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    t0 = time.perf_counter()
    raylets = group_nodes(plan, nodes_per_raylet)
    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=80 << 20, _temp_dir=temp_dir, _system_config=_NO_PRESTART,
             log_to_driver=False, configure_logging=False)
    head = ray._private.worker._global_node
    cluster = SimCluster(raylets, ray.get_runtime_context().get_node_id(), 0.0, temp_dir)
    gpn = plan.gpus_per_node
    try:
        for r in raylets:
            resources = {res: float(ROLE_UNITS * len(r.nodes)) for res in role_resources(r.role)}
            resources.update({NODE_RESOURCE.format(n): float(max(gpn, 1)) for n in r.nodes})
            cpus = cpus_per_node * len(r.nodes) if cpus_per_node else max(r.gpus, len(r.nodes)) * cpus_per_gpu
            params = RayParams(num_cpus=cpus, num_gpus=r.gpus,
                               resources=resources, node_ip_address="127.0.0.1", object_store_memory=80 << 20,
                               gcs_address=head.gcs_address, include_log_monitor=False, node_manager_port=0,
                               min_worker_port=0, max_worker_port=0, dashboard_agent_listen_port=None)
            # No atexit/SIGTERM hooks in the caller's process: stop_cluster stops what it started.
            r.handle = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
            r.node_id = r.handle.node_id
            for n in r.nodes:
                cluster.node_of[n] = r.index
        _wait_alive({r.node_id for r in raylets}, timeout_s=120)
    except BaseException:
        stop_cluster(cluster)
        raise
    cluster.started_s = time.perf_counter() - t0
    return cluster


def _wait_alive(node_ids: set[str], timeout_s: float) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        if node_ids <= alive:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{len(node_ids - alive)} simulated raylet(s) did not come up within {timeout_s:.0f} s")


def stop_cluster(cluster: SimCluster) -> float:
    """Stop exactly the processes this cluster started (its raylets and their agents, then the
    head via ray.shutdown); returns the seconds it took."""
    import psutil
    import ray

    t0 = time.perf_counter()
    # The raylets' agents and workers are their children, not tracked by Ray's Node handles; left
    # alone they exit seconds later and write into the removed session folder. Wait for them.
    handles = [r.handle for r in cluster.raylets if r.handle is not None]
    if ray.is_initialized():
        handles.append(ray._private.worker._global_node)  # the head this rehearsal started
    spawned = _descendants(handles)
    for r in cluster.raylets:
        if r.handle is not None:
            r.handle.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
            r.handle = None
    if ray.is_initialized():
        ray.shutdown()
    _, alive = psutil.wait_procs(spawned, timeout=5)
    for p in alive:
        p.terminate()
    _, alive = psutil.wait_procs(alive, timeout=3)
    for p in alive:
        p.kill()
    for _ in range(5):  # a process exiting late may still recreate the empty session folder
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
        time.sleep(0.5)
        if not os.path.exists(cluster.temp_dir):
            break
    return time.perf_counter() - t0


def _descendants(nodes: list[Any]) -> list[Any]:
    """The processes these Ray Node handles started, and every live descendant of them."""
    import psutil

    out = []
    for node in nodes:
        if node is None:
            continue
        for infos in node.all_processes.values():
            for info in infos:
                try:
                    proc = psutil.Process(info.process.pid)
                    out += [proc, *proc.children(recursive=True)]
                except psutil.NoSuchProcess:
                    continue
    return out
