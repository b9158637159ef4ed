"""Placement rehearsal: the plan placed for real on a simulated local Ray cluster.

`run_glm5_2_daytona.py train --num-nodes 16 --rehearse` starts a 127.0.0.1-only Ray cluster that
stands for the plan's nodes (simulated.py), then places the run's own actors with the run's own
placement code (agentrl.cluster.placement): one TrainerWorker per trainer rank through TrainerGroup
(with the DryBackend: no model), and the engines through EngineGroup / EngineActor, each running a
dry engine process (agentrl.cluster.dry_engine: no model; the same ports and multi-node rendezvous
as a run), then the replay buffer and the episode workers (with their session-affine router). It
works out the weight-update groups and the bucket schedule and shuts everything down in the run's
order. It fails loudly (RehearsalError) when an actor would share a GPU, a role lacks capacity, a TP
group leaves its node, or the ranks' own views of their process groups disagree.

Plans with more GPU participants than `max_actors` probe each trainer rank and engine with a Ray
task in its own slot (the same TrainerWorker class builds the rank's report; workers are reused),
since one actor is one process (~1 s, ~50 MB here): 322 of them for the 64-node variant would not
fit this machine.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from agentrl.cluster.rehearsal_checks import (
    RehearsalError,
    check_gpu_exclusive,
    check_node_capacity,
    check_ordering,
    check_trainer_reports,
    precheck_plan,
)
from agentrl.cluster.simulated import NODE_RESOURCE, SimCluster, start_cluster, stop_cluster
from agentrl.cluster.rehearsal_weights import (
    DEFAULT_BUCKET_BYTES,
    build_schedule,
    check_schedule,
    model_tensors,
)
from agentrl.config.layout import MEGATRON_ORDER

__all__ = ["RehearsalError", "rehearse"]

# Probe tasks in flight at once. Each task in flight needs its own worker process (~3-5 s to start
# on this loaded 2-core machine, ~90 MB); 16 at once started 16 workers per raylet (64 in all).
TASK_WAVE = 4


def _default_nodes_per_raylet(num_nodes: int) -> int:
    # 16 nodes -> 8 per raylet (2 raylets); 32 -> 8 (4); 64 -> 16 (4): a few raylets, each ~4 s.
    return max(1, min(16, -(-num_nodes // 4) if num_nodes > 16 else 8))


def _slots(plan, k: int, timeout_s: float):
    """The run's placement code, with pins when several simulated nodes share a raylet."""
    from agentrl.cluster.placement import engine_slots, trainer_slots
    from agentrl.cluster.roles import ClusterError

    # A simulated node advertises its GPU count of its own resource; each bundle takes its share.
    pin = (lambda node, gpus: {NODE_RESOURCE.format(node): float(gpus or 0.001)}) if k > 1 else None
    try:
        return (trainer_slots(plan, "rh", timeout_s=timeout_s, pin=pin),
                engine_slots(plan, "rh", timeout_s=timeout_s, pin=pin))
    except ClusterError as err:
        raise RehearsalError(f"{err} (the nodes lack the capacity)") from None


def _slot_node(slot, cluster: SimCluster, pinned: int | None) -> int:
    """Simulated node of a slot, from where Ray put its bundle."""
    from ray.util.placement_group import placement_group_table

    raylet = cluster.raylet_of_node_id(placement_group_table(slot.pg)["bundles_to_node_id"][slot.bundle])
    node = pinned if pinned is not None else raylet.nodes[0]
    if node not in raylet.nodes:
        raise RehearsalError(f"a bundle asked for node {node} but Ray put it on a raylet hosting {raylet.nodes}")
    return node


def _holder(name: str, kind: str, rep: dict, node: int, gpus: int, cluster: SimCluster, **extra) -> dict:
    raylet = cluster.raylet_of_node_id(rep["node_id"])
    if node not in raylet.nodes:
        raise RehearsalError(f"{name} should be on node {node} but runs on a raylet hosting nodes {raylet.nodes}")
    return {"name": name, "kind": kind, "node": node, "raylet": raylet.index, "role": raylet.role,
            "node_id": rep["node_id"], "gpu_ids": rep["gpu_ids"], "gpus": gpus, "pid": rep["pid"], **extra}


def _probe_trainer_rank(cfg: dict, plan: dict, rank: int, run_dir: str) -> dict[str, Any]:
    """Task form of a trainer rank (large plans): the real TrainerWorker builds its report in the
    rank's own slot."""
    from agentrl.cluster.trainer_group import TrainerWorker

    w = TrainerWorker(cfg, plan, rank, "rh", run_dir)
    return {**w.setup("127.0.0.1", 0), **w.placement(), "started_at": time.time(), "kind": "task"}


def _probe_engine_slot(index: int, node_rank: int) -> dict[str, Any]:
    """Task form of an engine's node (large plans): where Ray put its slot."""
    from agentrl.cluster.rehearsal_actors import where

    return {"engine": index, "node_rank": node_rank, "started_at": time.time(), **where()}


def rehearse(plan, *, cfg=None, nodes_per_raylet: int | None = None, max_actors: int = 48, episode_workers: int = 1,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, placement_timeout_s: float = 60.0,
             precheck: bool = True, temp_root: str = "/tmp") -> dict[str, Any]:
    """Place `plan` on a simulated cluster; returns the report (rehearsal_report.format_report prints
    it). Raises RehearsalError. Ray's session goes to a fresh folder under `temp_root` (keep it short:
    socket paths must stay under 107 characters), removed at the end."""
    import ray

    from agentrl.config.schema import RunConfig

    cfg = cfg or RunConfig()
    layout = precheck_plan(plan) if precheck else plan.layout
    coords, groups = layout.all_coords(), layout.groups()
    tensors = model_tensors(plan.model)
    ugroups, buckets = build_schedule(tensors, plan, coords, layout, groups, bucket_bytes)
    check_schedule(tensors, plan, ugroups, buckets, coords)

    k = nodes_per_raylet or _default_nodes_per_raylet(plan.num_nodes)
    gpu_participants = plan.train_gpus + len(plan.engines)
    use_actors = gpu_participants <= max_actors
    phases: dict[str, float] = {}
    stops: dict[str, float] = {}
    timeline: dict[str, list[float]] = {}
    actors: list[Any] = []
    # A short folder under /tmp: Ray's socket paths must stay under 107 characters.
    tmp = tempfile.mkdtemp(prefix="agentrl-rh-", dir=temp_root)
    try:
        cluster = start_cluster(plan, k, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    phases["cluster_start_s"] = cluster.started_s
    try:
        report = _place_and_probe(cfg, plan, cluster, k, layout, coords, groups, ugroups, use_actors,
                                  episode_workers, placement_timeout_s, phases, stops, timeline, actors, tmp)
    finally:
        for a in actors:  # whatever is left after an error; the ordered shutdown kills the rest
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        stops["cluster_s"] = stop_cluster(cluster)
    report["timings"] = {"startup": {k2: round(v, 2) for k2, v in phases.items()},
                         "shutdown": {k2: round(v, 2) for k2, v in stops.items()}}
    report["weights"] = {"bucket_bytes": bucket_bytes, "tensors": len(tensors),
                         "bytes": sum(t.nbytes for t in tensors),
                         "update_groups": [g.to_json() for g in ugroups],
                         "buckets": [b.to_json() for b in buckets]}
    report["checks"].append("every engine rank receives every tensor exactly once")
    return report


def _timed(phases: dict[str, float], key: str, fn):
    t0 = time.perf_counter()
    out = fn()
    phases[key] = time.perf_counter() - t0
    return out


def _place_and_probe(cfg, plan, cluster, k, layout, coords, groups, ugroups, use_actors, episode_workers,
                     timeout_s, phases, stops, timeline, actors, tmp) -> dict[str, Any]:
    import asyncio
    import dataclasses

    import ray

    from agentrl.cluster.engines import EngineGroup
    from agentrl.cluster.rehearsal_actors import RehearsalBuffer, RehearsalEpisodeWorker
    from agentrl.cluster.trainer_group import TrainerGroup

    gpn = plan.gpus_per_node
    # The run's own plan, with no model anywhere: the dry trainer backend and dry engine processes.
    # Simulated nodes share 127.0.0.1, so engines take free ports instead of the plan's fixed ones.
    dry = dataclasses.replace(plan, backend="dry",
                              engines=[dataclasses.replace(e, kind="dry", port=0) for e in plan.engines])
    t_slots, e_slots = _timed(phases, "placement_groups_s", lambda: _slots(dry, k, timeout_s))
    train_nodes = [nr.node for nr in plan.node_roles if "train" in nr.role]
    per = plan.ranks_per_train_node
    t_nodes = [_slot_node(t_slots[r], cluster, train_nodes[r // per] if k > 1 else None) for r in range(layout.world)]

    t0 = time.perf_counter()
    cfg_json, plan_json = cfg.model_dump(mode="json"), dry.to_json()
    if use_actors:
        trainers = TrainerGroup(cfg, dry, "rh", Path(tmp), slots=t_slots)
        asyncio.run(trainers.start())
        actors.extend(trainers.actors)
        t_reports = [{**info, **place, "started_at": time.time(), "kind": "actor"}
                     for info, place in zip(trainers.info, ray.get([a.placement.remote() for a in trainers.actors]),
                                            strict=True)]
    else:
        trainers = None
        probe = ray.remote(_probe_trainer_rank)
        t_reports = []
        for i in range(0, layout.world, TASK_WAVE):  # waves keep the pool of worker processes small
            t_reports += ray.get([probe.options(**t_slots[r].options()).remote(cfg_json, plan_json, r, str(tmp))
                                  for r in range(i, min(i + TASK_WAVE, layout.world))])
    phases["trainers_s"] = time.perf_counter() - t0
    holders = [_holder(f"trainer rank {rep['rank']}", "trainer", rep, t_nodes[rep["rank"]], int(plan.gpus_per_rank),
                       cluster, rank=rep["rank"], coords=rep["coords"], probe=rep["kind"]) for rep in t_reports]
    check_trainer_reports(t_reports, coords, layout, groups, {h["rank"]: h["node"] for h in holders})
    timeline["trainer_started"] = [rep["started_at"] for rep in t_reports]

    buffer = _timed(phases, "buffer_s", lambda: ray.remote(RehearsalBuffer).options(num_cpus=0).remote())
    actors.append(buffer)

    t0 = time.perf_counter()
    e_nodes = [[_slot_node(s, cluster, e.nodes[r] if k > 1 else None) for r, s in enumerate(slots)]
               for e, slots in zip(plan.engines, e_slots, strict=True)]
    if use_actors:
        engines = EngineGroup(cfg, dry, Path(tmp), "rh", slots=e_slots)
        urls = asyncio.run(engines.start())
        engine_actors = [a for nodes in engines.actors for a in nodes]
        actors.extend(engine_actors)
        e_reports = ray.get([a.placement.remote() for a in engine_actors])
    else:
        engines, engine_actors = None, []
        urls = [f"http://node{e.nodes[0]}:{e.port}" for e in plan.engines]
        probe_e = ray.remote(_probe_engine_slot)
        calls = [(e.index, r, s) for e, slots in zip(plan.engines, e_slots, strict=True) for r, s in enumerate(slots)]
        e_reports = []
        for i in range(0, len(calls), TASK_WAVE):
            e_reports += ray.get([probe_e.options(**s.options()).remote(idx, r) for idx, r, s in calls[i:i + TASK_WAVE]])
    phases["engines_s"] = time.perf_counter() - t0
    timeline["engine_started"] = [rep.get("started_at", time.time()) for rep in e_reports]
    for rep in e_reports:
        e = plan.engines[rep["engine"]]
        r = rep["node_rank"]
        name = f"engine {e.index}" if r == 0 else f"engine {e.index} node_rank {r}"
        holders.append(_holder(name, "engine" if r == 0 else "engine-node", rep, e_nodes[e.index][r],
                               int(e.gpus_per_node), cluster, engine=e.index,
                               **({"url": urls[e.index]} if r == 0 else {})))
    # Unpinned, Ray may put engine i on any inference node: not an error, but the plan's node
    # numbers for engines are then nominal (addresses come from where the actor landed).
    notes = [f"engine {h['engine']} runs on node {h['node']}; the plan lists node {plan.engines[h['engine']].nodes[0]}"
             for h in holders if h["kind"] == "engine" and h["node"] != plan.engines[h["engine"]].nodes[0]]
    check_gpu_exclusive(holders)
    check_node_capacity(holders, gpn)
    wrong_role = [h["name"] for h in holders if h["kind"] == "trainer" and "train" not in h["role"]
                  or h["kind"] != "trainer" and "inference" not in h["role"]]
    if wrong_role:
        raise RehearsalError(f"{wrong_role[:3]} landed on nodes of the wrong role")

    t0 = time.perf_counter()
    workers = [ray.remote(RehearsalEpisodeWorker).options(num_cpus=0, max_concurrency=16).remote(i, urls, buffer)
               for i in range(episode_workers)]
    actors.extend(workers)
    w_reports = ray.get([w.report.remote() for w in workers])
    phases["episode_workers_s"] = time.perf_counter() - t0
    timeline["worker_started"] = [r["started_at"] for r in w_reports]
    for r in w_reports:
        unreached = [u for u, n in r["sessions_per_engine"].items() if n == 0]
        if r["router_engines"] != len(urls) or unreached:
            raise RehearsalError(f"episode worker {r['index']}'s router reaches {r['router_engines']} of "
                                 f"{len(urls)} engines; no session maps to {unreached[:3]}")
    b_report = ray.get(buffer.report.remote())
    if sorted(b_report["seen"]) != sorted(f"worker-{i}" for i in range(episode_workers)):
        raise RehearsalError(f"the buffer heard from {b_report['seen']}, not from every episode worker")
    check_ordering(timeline, [("trainer_started", "engine_started"), ("engine_started", "worker_started")],
                   "start-up order")

    # Shutdown in the run's order: workers (they close sandboxes), engines, trainers, buffer.
    shut: dict[str, list[float]] = {}
    for key in ("workers", "engines", "trainers", "buffer"):
        t0 = time.perf_counter()
        if key == "workers":
            group = workers
            shut[key] = ray.get([a.shutdown.remote() for a in group])
        elif key == "engines":
            group = engine_actors
            if engines is not None:
                asyncio.run(engines.stop())
            shut[key] = [time.time()]
        elif key == "trainers":
            group = trainers.actors if trainers is not None else []
            shut[key] = [time.time()]
        else:
            group = [buffer]
            shut[key] = ray.get([buffer.shutdown.remote()])
        for a in group:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - stopped with its group
                pass
            if a in actors:
                actors.remove(a)
        stops[f"{key}_s"] = time.perf_counter() - t0
    check_ordering(shut, [("workers", "engines"), ("engines", "trainers"), ("trainers", "buffer")], "shutdown order")

    checks = ["role capacity: the run's placement groups placed", "no GPU held by two actors",
              f"trainer ranks (TrainerWorker) agree on coordinates and {', '.join(groups)} groups ({MEGATRON_ORDER})",
              "every tensor-parallel group inside one node", "engines (EngineActor) up with their rendezvous",
              "every router reaches every engine", "start-up and shutdown order"]
    return {
        "plan": {"model": plan.model, "num_nodes": plan.num_nodes, "gpus_per_node": gpn, "train_nodes": plan.train_nodes,
                 "inference_nodes": plan.inference_nodes, "train_gpus": plan.train_gpus, "engines": len(plan.engines),
                 "parallel": layout.to_json(), "rank_order": MEGATRON_ORDER},
        "cluster": {"nodes_per_raylet": k, "raylets": [{"index": r.index, "role": r.role, "nodes": r.nodes,
                                                        "gpus": r.gpus} for r in cluster.raylets],
                    "probe": "actors" if use_actors else "tasks",
                    "gpu_worker_processes": len({h["pid"] for h in holders})},
        "placements": [{k2: v for k2, v in h.items() if k2 not in ("node_id", "pid")} for h in holders]
        + [{"name": f"episode worker {r['index']}", "kind": "episode-worker", "raylet": "head", "gpu_ids": []}
           for r in w_reports] + [{"name": "replay buffer", "kind": "buffer", "raylet": "head", "gpu_ids": []}],
        "checks": checks,
        "notes": notes,
    }
