"""Placement rehearsal: the plan placed for real on a simulated local Ray cluster.

`run_glm5_2_daytona.py train --num-nodes 16 --rehearse` starts a 127.0.0.1-only Ray cluster that
stands for the plan's nodes (simulated.py), asks Ray for the run's placement groups per
role (agentrl.cluster.ray_env's bundles and role_placement_group), places one stand-in actor per
training GPU and per engine in those bundles, the replay buffer and the episode workers (with their
session-affine router), forms the weight-update groups and works out the bucket schedule, then shuts
everything down in the run's order. No model weights are loaded. It fails loudly (RehearsalError)
when an actor would share a GPU, a role lacks capacity, a TP group leaves its node, or the ranks'
own views of their process groups disagree.

Plans with more GPU participants than `max_actors` probe each trainer rank and engine with a Ray
task in its own bundle (same resources, same report; workers are reused), since one actor is one
process (~1 s, ~50 MB here): 322 of them for the 64-node variant would not fit this machine.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
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


def _place_group(role: str, bundles: list[dict[str, float]], name: str, timeout_s: float):
    """ray_env.role_placement_group, bounded: an infeasible group becomes a clear error, not a hang."""
    import ray

    from agentrl.cluster.ray_env import role_placement_group

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["pg"] = role_placement_group(role, bundles, name)
        except BaseException as e:  # noqa: BLE001 - reported below with the plan's numbers
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name=f"pg-{role}")
    t.start()
    t.join(timeout_s)
    if "pg" in box:
        return box["pg"]
    gpus = sum(b.get("GPU", 0) for b in bundles)
    try:
        ray.util.remove_placement_group(ray.util.get_placement_group(name))
    except ValueError:  # no group of that name was created; the error below says why
        box.setdefault("error", f"no placement group named {name} was created")
    t.join(10)  # the removed group's ready() fails at once; the thread must not outlive Ray
    raise RehearsalError(
        f"Ray could not place the {role} placement group ({len(bundles)} bundles, {gpus:g} GPUs, e.g. "
        f"{bundles[0]}) within {timeout_s:.0f} s: the {role} nodes lack the capacity"
        + (f" ({box['error']})" if "error" in box else ""))


def _bundle_nodes(pg, cluster: SimCluster, pinned: list[int] | None) -> list[int]:
    """Simulated node of every bundle, from where Ray put it."""
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)["bundles_to_node_id"]
    out = []
    for i in range(len(table)):
        raylet = cluster.raylet_of_node_id(table[i])
        node = pinned[i] if pinned else raylet.nodes[0]
        if node not in raylet.nodes:
            raise RehearsalError(f"bundle {i} asked for node {node} but Ray put it on a raylet hosting {raylet.nodes}")
        out.append(node)
    return out


def _holder(name: str, kind: str, rep: dict, node: int, gpus: int, cluster: SimCluster, **extra) -> dict:
    raylet = cluster.raylet_of_node_id(rep["node_id"])
    if node not in raylet.nodes:
        raise RehearsalError(f"{name} should be on node {node} but runs on a raylet hosting nodes {raylet.nodes}")
    return {"name": name, "kind": kind, "node": node, "raylet": raylet.index, "role": raylet.role,
            "node_id": rep["node_id"], "gpu_ids": rep["gpu_ids"], "gpus": gpus, "pid": rep["pid"], **extra}


def rehearse(plan, *, nodes_per_raylet: int | None = None, max_actors: int = 48, episode_workers: int = 1,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, placement_timeout_s: float = 60.0,
             precheck: bool = True, temp_root: str = "/tmp") -> dict[str, Any]:
    """Place `plan` on a simulated cluster; returns the report (rehearsal_report.format_report prints
    it). Raises RehearsalError. Ray's session goes to a fresh folder under `temp_root` (keep it short:
    socket paths must stay under 107 characters), removed at the end."""
    import ray

    from agentrl.cluster.rehearsal_actors import (
        RehearsalBuffer,
        RehearsalEngine,
        RehearsalEngineNode,
        RehearsalEpisodeWorker,
        RehearsalTrainer,
        probe_trainer_rank,
    )
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
        report = _place_and_probe(plan, cluster, k, layout, coords, groups, ugroups, use_actors, episode_workers,
                                  placement_timeout_s, phases, stops, timeline, actors,
                                  (RehearsalTrainer, RehearsalEngine, RehearsalEngineNode, RehearsalBuffer,
                                   RehearsalEpisodeWorker, probe_trainer_rank))
    finally:
        for a in actors:  # whatever is left after an error; the ordered shutdown kills the rest
            ray.kill(a, no_restart=True)
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


def _place_and_probe(plan, cluster, k, layout, coords, groups, ugroups, use_actors, episode_workers,
                     timeout_s, phases, stops, timeline, actors, classes) -> dict[str, Any]:
    import ray

    from agentrl.cluster.ray_env import engine_bundles, in_bundle, trainer_bundles

    Trainer, Engine, EngineNode, Buffer, Worker, probe_rank = classes
    gpn = plan.gpus_per_node
    train_nodes = [nr.node for nr in plan.node_roles if "train" in nr.role]
    t_bundles, e_bundles = trainer_bundles(plan), engine_bundles(plan)
    t_pins = [train_nodes[j // gpn] for j in range(len(t_bundles))] if k > 1 else None
    e_pins = [n for e in plan.engines for n in e.nodes] if k > 1 else None
    if t_pins:
        t_bundles = [{**b, NODE_RESOURCE.format(n): b.get("GPU", 1)} for b, n in zip(t_bundles, t_pins, strict=True)]
        e_bundles = [{**b, NODE_RESOURCE.format(n): b.get("GPU", 1)} for b, n in zip(e_bundles, e_pins, strict=True)]
    train_pg = _timed(phases, "placement_group_train_s", lambda: _place_group("train", t_bundles, "rh-train", timeout_s))
    infer_pg = _timed(phases, "placement_group_inference_s",
                      lambda: _place_group("inference", e_bundles, "rh-inference", timeout_s))
    t_nodes, e_nodes = _bundle_nodes(train_pg, cluster, t_pins), _bundle_nodes(infer_pg, cluster, e_pins)

    # Rank r takes the r-th bundle in (node, bundle) order, so consecutive ranks share a node
    # whatever order PACK filled the bundles in.
    order = sorted(range(len(t_bundles)), key=lambda b: (t_nodes[b], b))
    layout_json = layout.to_json()
    t0 = time.perf_counter()
    if use_actors:
        trainers = {r: ray.remote(Trainer).options(num_cpus=1, num_gpus=1, **in_bundle(train_pg, b)).remote(r, layout_json)
                    for r, b in enumerate(order)}
        actors.extend(trainers.values())
        t_reports = ray.get([a.report.remote() for a in trainers.values()])
    else:
        probe = ray.remote(probe_rank)
        t_reports = []
        for i in range(0, len(order), TASK_WAVE):  # waves keep the pool of worker processes small
            t_reports += ray.get([probe.options(num_cpus=1, num_gpus=1, **in_bundle(train_pg, b)).remote(r, layout_json)
                                  for r, b in list(enumerate(order))[i:i + TASK_WAVE]])
        # The senders of the weight update stay up as actors: they join the update groups below.
        senders = sorted({g.sender for g in ugroups})
        trainers = {r: ray.remote(Trainer).options(num_cpus=1, num_gpus=1, **in_bundle(train_pg, order[r]))
                    .remote(r, layout_json) for r in senders}
        actors.extend(trainers.values())
        sender_reports = {r: rep for r, rep in zip(senders, ray.get([trainers[r].report.remote() for r in senders]),
                                                   strict=True)}
        for r, rep in sender_reports.items():
            if (rep["node_id"], rep["gpu_ids"]) != (t_reports[r]["node_id"], t_reports[r]["gpu_ids"]):
                raise RehearsalError(f"trainer rank {r}: its actor and its probe got different GPUs or nodes")
    phases["trainers_s"] = time.perf_counter() - t0
    holders = [_holder(f"trainer rank {rep['rank']}", "trainer", rep, t_nodes[order[rep["rank"]]], 1, cluster,
                       rank=rep["rank"], bundle=order[rep["rank"]], coords=rep["coords"], probe=rep["kind"])
               for rep in t_reports]
    node_of_rank = {h["rank"]: h["node"] for h in holders}
    check_trainer_reports(t_reports, coords, layout, groups, node_of_rank)
    timeline["trainer_started"] = [rep["started_at"] for rep in t_reports]

    buffer = _timed(phases, "buffer_s", lambda: ray.remote(Buffer).options(num_cpus=0).remote())
    actors.append(buffer)

    t0 = time.perf_counter()
    e_reports, first_bundle, at = [], [], 0
    for e in plan.engines:
        first_bundle.append(at)
        at += len(e.nodes)
    urls = [f"http://node{e.nodes[0]}:{e.port}" for e in plan.engines]
    ranks_of, nxt = {}, 1
    for e in plan.engines:
        ranks_of[e.index] = list(range(nxt, nxt + max(int(e.gpus), 1)))
        nxt += max(int(e.gpus), 1)
    world = nxt
    engine_actors, node_actors = [], []
    for e, b0, url in zip(plan.engines, first_bundle, urls, strict=True):
        per = int(e.gpus_per_node)
        opts = {"num_cpus": 1, "num_gpus": per, **in_bundle(infer_pg, b0)}
        if use_actors:
            engine_actors.append(ray.remote(Engine).options(**opts).remote(e.index, int(e.gpus), e.nodes, url))
        for j in range(1, len(e.nodes)):
            node_actors.append(ray.remote(EngineNode).options(num_cpus=1, num_gpus=per, **in_bundle(infer_pg, b0 + j))
                               .remote(e.index, j))
    actors.extend(engine_actors + node_actors)
    if use_actors:
        e_reports = ray.get([a.report.remote() for a in engine_actors])
    else:
        probe_e = ray.remote(_probe_engine)
        calls = list(zip(plan.engines, first_bundle, urls, strict=True))
        for i in range(0, len(calls), TASK_WAVE):
            e_reports += ray.get([probe_e.options(num_cpus=1, num_gpus=int(e.gpus_per_node), **in_bundle(infer_pg, b0))
                                  .remote(e.index, int(e.gpus), e.nodes, url, _joins(ugroups, ranks_of[e.index], world))
                                  for e, b0, url in calls[i:i + TASK_WAVE]])
    n_reports = ray.get([a.report.remote() for a in node_actors])
    phases["engines_s"] = time.perf_counter() - t0
    timeline["engine_started"] = [r["started_at"] for r in e_reports + n_reports]
    for e, b0, rep in zip(plan.engines, first_bundle, e_reports, strict=True):
        holders.append(_holder(f"engine {e.index}", "engine", rep, e_nodes[b0], int(e.gpus_per_node), cluster,
                               engine=e.index, bundle=b0, url=rep["url"], update_ranks=ranks_of[e.index]))
    for rep in n_reports:
        b = first_bundle[rep["index"]] + rep["node_rank"]
        e = plan.engines[rep["index"]]
        holders.append(_holder(f"engine {e.index} node_rank {rep['node_rank']}", "engine-node", rep, e_nodes[b],
                               int(e.gpus_per_node), cluster, engine=e.index, bundle=b))
    # Unpinned, PACK may put engine i on any inference node: not an error, but the plan's node
    # numbers for engines are then nominal (addresses must come from where the actor landed).
    notes = [f"engine {h['engine']} runs on node {h['node']}; the plan lists node {plan.engines[h['engine']].nodes[0]}"
             for h in holders if h["kind"] == "engine" and h["node"] != plan.engines[h["engine"]].nodes[0]]
    check_gpu_exclusive(holders)
    check_node_capacity(holders, gpn)
    wrong_role = [h["name"] for h in holders if h["kind"] == "trainer" and "train" not in h["role"]
                  or h["kind"] != "trainer" and "inference" not in h["role"]]
    if wrong_role:
        raise RehearsalError(f"{wrong_role[:3]} landed on nodes of the wrong role")

    t0 = time.perf_counter()
    joins = []
    for g in ugroups:
        joins.append(trainers[g.sender].join_update_group.remote(g.name, 0, g.world_size))
        if use_actors:
            joins += [a.join_update_group.remote(g.name, ranks_of[e.index], g.world_size)
                      for e, a in zip(plan.engines, engine_actors, strict=True)]
    actor_joins = ray.get(joins)
    phases["update_groups_s"] = time.perf_counter() - t0
    _check_update_groups(ugroups, actor_joins + ([] if use_actors else [j for r in e_reports for j in r["joined"]]))
    # (engine probe tasks join inside their own task, so only actor joins are ordered)
    timeline["update_group_joined"] = [j["at"] for j in actor_joins]

    t0 = time.perf_counter()
    workers = [ray.remote(Worker).options(num_cpus=0, max_concurrency=16).remote(i, urls, buffer)
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
    check_ordering(timeline, [("trainer_started", "update_group_joined"), ("engine_started", "update_group_joined"),
                              ("engine_started", "worker_started")], "start-up order")

    # Shutdown in the run's order: workers (they close sandboxes), engines, trainers, buffer.
    shut: dict[str, list[float]] = {}
    for key, group in (("workers", workers), ("engines", engine_actors + node_actors),
                       ("trainers", list(trainers.values())), ("buffer", [buffer])):
        t0 = time.perf_counter()
        shut[key] = ray.get([a.shutdown.remote() for a in group]) if group else []
        for a in group:
            ray.kill(a, no_restart=True)
            actors.remove(a)
        stops[f"{key}_s"] = time.perf_counter() - t0
    check_ordering(shut, [("workers", "engines"), ("engines", "trainers"), ("trainers", "buffer")], "shutdown order")

    checks = ["role capacity: both placement groups placed", "no GPU held by two actors",
              f"trainer ranks agree on coordinates and {', '.join(groups)} groups ({MEGATRON_ORDER})",
              "every tensor-parallel group inside one node", "every router reaches every engine",
              "start-up and shutdown order"]
    return {
        "plan": {"model": plan.model, "num_nodes": plan.num_nodes, "gpus_per_node": gpn, "train_nodes": plan.train_nodes,
                 "inference_nodes": plan.inference_nodes, "train_gpus": plan.train_gpus, "engines": len(plan.engines),
                 "parallel": layout_json, "rank_order": MEGATRON_ORDER},
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


def _check_update_groups(ugroups, join_recs: list[dict[str, Any]]) -> None:
    """Every rank of every update group taken exactly once (rank 0 by the sender)."""
    taken: dict[str, list[int]] = {g.name: [] for g in ugroups}
    for j in join_recs:
        taken.setdefault(j["group"], []).extend(j.get("group_ranks", [j.get("group_rank")]))
    for g in ugroups:
        if sorted(taken[g.name]) != list(range(g.world_size)):
            raise RehearsalError(f"update group {g.name} (world {g.world_size}) has ranks {sorted(taken[g.name])[:8]}...: "
                                 f"every rank must be joined exactly once")


def _joins(ugroups, ranks: list[int], world: int) -> list[tuple[str, list[int], int]]:
    return [(g.name, ranks, world) for g in ugroups]


def _probe_engine(index: int, gpus: int, nodes: list[int], url: str, joins: list) -> dict[str, Any]:
    """Task form of an engine (large plans): report placement and join every update group."""
    from agentrl.cluster.rehearsal_actors import RehearsalEngine

    eng = RehearsalEngine(index, gpus, nodes, url)
    for name, ranks, world in joins:
        eng.join_update_group(name, ranks, world)
    return {**eng.report(), "joined": eng.joined}
