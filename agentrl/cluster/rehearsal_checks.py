"""Checks of a rehearsal: the plan before anything starts, then what the actors reported.

Every failure is a RehearsalError whose message names the actor, node or group and what to change.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from agentrl.cluster.rehearsal_ranks import RankLayoutError, check_groups, check_groups_in_node
from agentrl.config.layout import Layout, RankCoords


class RehearsalError(RuntimeError):
    """The plan cannot be placed as written, or the placement is wrong; the message says which and why."""


def precheck_plan(plan) -> Layout:
    """Capacity and shape problems found from the plan alone (fast, before Ray starts)."""
    problems: list[str] = []
    gpn = plan.gpus_per_node
    if gpn < 1:
        raise RehearsalError("the rehearsal places GPU actors; this plan has cluster.gpus_per_node=0 (a CPU run). "
                             "Use --dry-run for CPU plans")
    roles = {nr.node: nr.role for nr in plan.node_roles}
    if len(roles) != plan.num_nodes:
        problems.append(f"the plan names {len(roles)} nodes but cluster.num_nodes={plan.num_nodes}")
    train_nodes = [n for n, r in roles.items() if "train" in r]
    offered = sum(nr.gpus for nr in plan.node_roles if "train" in nr.role)
    if plan.train_gpus > offered:
        problems.append(f"the trainer needs {plan.train_gpus} GPUs but its {len(train_nodes)} training node(s) "
                        f"offer {offered}; add training nodes (cluster.train_nodes)")
    demand: dict[int, int] = defaultdict(int)
    for e in plan.engines:
        if not e.nodes:
            problems.append(f"engine {e.index} has no node")
            continue
        bad = [n for n in e.nodes if "inference" not in roles.get(n, "")]
        if bad:
            problems.append(f"engine {e.index} is placed on node(s) {bad}, which are not inference nodes "
                            f"(inference nodes: {[n for n, r in roles.items() if 'inference' in r]}); "
                            f"too few inference nodes for {len(plan.engines)} engines")
        per_node = e.gpus_per_node
        if per_node > gpn:
            problems.append(f"engine {e.index} needs {per_node:g} GPUs on node {e.nodes[0]}, wider than a node of "
                            f"{gpn} GPUs; set rollout.sglang.gpus_per_engine to a divisor or multiple of {gpn}")
        for n in e.nodes:
            demand[n] += per_node
    for n, need in sorted(demand.items()):
        if need > gpn and len([e for e in plan.engines if n in e.nodes]) > 1:
            problems.append(f"inference node {n} would host engines needing {need} GPUs; it has {gpn} "
                            f"(too few inference nodes for the engines)")
    layout = plan.layout
    if layout.world * plan.gpus_per_rank != plan.train_gpus:
        problems.append(f"the plan's layout has {layout.world} ranks but the trainer holds {plan.train_gpus} GPUs")
    if (layout.tp > gpn or gpn % layout.tp):
        problems.append(f"TP={layout.tp} cannot stay inside a node of {gpn} GPUs; pick a TP that divides {gpn}")
    if problems:
        raise RehearsalError("the plan cannot be placed:\n  - " + "\n  - ".join(problems))
    return layout


def check_gpu_exclusive(holders: list[dict[str, Any]]) -> None:
    """No GPU of a raylet is held by two actors; each holder has the GPU count it needs."""
    owner: dict[tuple[str, int], str] = {}
    for h in holders:
        if len(h["gpu_ids"]) != h["gpus"]:
            raise RehearsalError(f"{h['name']} was given GPUs {h['gpu_ids']} but needs {h['gpus']}; its bundle "
                                 f"and its actor options disagree")
        for g in h["gpu_ids"]:
            key = (h["node_id"], g)
            if key in owner:
                raise RehearsalError(f"{owner[key]} and {h['name']} share GPU {g} of node {h['node']}; "
                                     f"every GPU must belong to one actor")
            owner[key] = h["name"]


def check_node_capacity(holders: list[dict[str, Any]], gpus_per_node: int) -> None:
    used: dict[int, int] = defaultdict(int)
    for h in holders:
        used[h["node"]] += h["gpus"]
    over = {n: u for n, u in used.items() if u > gpus_per_node}
    if over:
        n, u = next(iter(over.items()))
        raise RehearsalError(f"node {n} was given actors holding {u} GPUs; it has {gpus_per_node}")


def check_trainer_reports(reports: list[dict[str, Any]], coords: list[RankCoords], layout: Layout,
                          groups: dict[str, list[list[int]]], node_of_rank: dict[int, int]) -> None:
    """Each rank's own view (coordinates, group members) must match the driver's and its peers'."""
    if sorted(r["rank"] for r in reports) != list(range(layout.world)):
        raise RehearsalError(f"trainer ranks reported {len(reports)} of {layout.world} ranks")
    try:
        check_groups(groups, layout)
        check_groups_in_node(groups["tp"], node_of_rank, "tensor-parallel")
        if layout.etp > 1:
            check_groups_in_node(groups["etp"], node_of_rank, "expert-tensor-parallel")
    except RankLayoutError as e:
        raise RehearsalError(str(e)) from None
    for rep in reports:
        r = rep["rank"]
        if rep["coords"] != coords[r].to_json():
            raise RehearsalError(f"trainer rank {r} computed coordinates {rep['coords']}, the driver "
                                 f"{coords[r].to_json()}; the ranks disagree on the layout")
        for kind, members in rep["groups"].items():
            want = next(g for g in groups[kind] if r in g)
            if list(members) != list(want):
                raise RehearsalError(f"trainer rank {r} would join {kind} group {members}, its peers form {want}; "
                                     f"process groups would be inconsistent")


def check_ordering(timeline: dict[str, list[float]], order: list[tuple[str, str]], what: str) -> None:
    """For each (before, after): every `before` timestamp precedes every `after` one."""
    for a, b in order:
        if timeline.get(a) and timeline.get(b) and max(timeline[a]) > min(timeline[b]):
            raise RehearsalError(f"{what}: some {b} happened before all {a} were done")
