"""Where the plan's actors go: placement groups per training node and per engine, and what a
cluster must offer before any is created.

Node roles are Ray custom resources (`agentrl_train`, `agentrl_inference`; agentrl.cluster.ray_env).
- Trainer: one STRICT_PACK placement group per plan training node, one bundle per rank on it
  ({"CPU": 1, "GPU": gpus_per_rank, agentrl_train: 1}). Rank r is bundle r % ranks_per_node of
  node group r // ranks_per_node, so ranks are ordered by node, then GPU, and a TP group (ranks
  0..tp-1 of a node) never spans nodes.
- Engine: one placement group per engine, one bundle per node it spans ({"GPU": gpus_per_node,
  agentrl_inference: 1}), STRICT_SPREAD when it spans several nodes (each node_rank on its own
  machine), STRICT_PACK otherwise.
Every group must be placed within `timeout_s`; one that is not becomes a ClusterError saying what
it asked for and what the cluster has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentrl.cluster.roles import INFER_RESOURCE, TRAIN_RESOURCE, ClusterError
from agentrl.config.plan import RunPlan

PLACEMENT_TIMEOUT_S = 120.0  # a placeable group is ready in ~1 s; past this the cluster lacks something


@dataclass(frozen=True)
class Slot:
    """One bundle of a placement group: pass `options()` to `.options(...)` of the actor that takes it."""

    pg: Any
    bundle: int
    num_gpus: float
    num_cpus: float = 1.0

    def options(self) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=self.bundle,
                    placement_group_capture_child_tasks=False)}


def _bundle(cpus: float, gpus: float, role_resource: str) -> dict[str, float]:
    b = {"CPU": cpus, role_resource: 1.0}
    if gpus:
        b["GPU"] = gpus
    return b


# (plan node, the bundle's GPUs) -> extra resources that pin a bundle to that node
Pin = Callable[[int, float], dict[str, float]]


def trainer_slots(plan: RunPlan, run_id: str, timeout_s: float = PLACEMENT_TIMEOUT_S,
                  pin: Pin | None = None) -> list[Slot]:
    """One slot per trainer rank, in rank order. `pin` (the rehearsal's simulated nodes) adds
    resources that tie each bundle to its plan node."""
    from ray.util.placement_group import placement_group

    per = plan.ranks_per_train_node
    pgs = []
    train_nodes = [r.node for r in plan.node_roles if "train" in r.role]
    for i in range(plan.layout.world // per):
        extra = pin(train_nodes[i], plan.gpus_per_rank) if pin else {}
        pgs.append(placement_group([{**_bundle(1, plan.gpus_per_rank, TRAIN_RESOURCE), **extra}] * per,
                                   strategy="STRICT_PACK", name=f"{run_id}-train-node{i}"))
    _wait([(pg, f"training node {i}: {per} rank(s) x ({per and plan.gpus_per_rank:g} GPU, 1 CPU, {TRAIN_RESOURCE})")
           for i, pg in enumerate(pgs)], timeout_s)
    return [Slot(pgs[r // per], r % per, plan.gpus_per_rank) for r in range(plan.layout.world)]


def engine_slots(plan: RunPlan, run_id: str, timeout_s: float = PLACEMENT_TIMEOUT_S,
                 pin: Pin | None = None) -> list[list[Slot]]:
    """Per engine, one slot per node it spans (index = node_rank). Engine processes take no
    logical CPU: on a CPU machine they would otherwise starve the episode workers' share. With `pin`,
    each bundle is tied to its plan node by resources instead of spread by the strategy."""
    from ray.util.placement_group import placement_group

    pgs, out = [], []
    for e in plan.engines:
        n = len(e.nodes)
        bundles = [{**_bundle(0.001, e.gpus_per_node, INFER_RESOURCE), **(pin(node, e.gpus_per_node) if pin else {})}
                   for node in e.nodes]
        strategy = "PACK" if pin else "STRICT_SPREAD" if n > 1 else "STRICT_PACK"
        pg = placement_group(bundles, strategy=strategy, name=f"{run_id}-engine{e.index}")
        pgs.append((pg, f"engine {e.index}: {n} node(s) x ({e.gpus_per_node:g} GPU, {INFER_RESOURCE})"))
        out.append([Slot(pg, k, e.gpus_per_node, num_cpus=0.001) for k in range(n)])
    _wait(pgs, timeout_s)
    return out


def _wait(groups: list[tuple[Any, str]], timeout_s: float) -> None:
    import ray

    refs = [pg.ready() for pg, _ in groups]
    _, unready = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if unready:
        what = groups[refs.index(unready[0])][1]
        raise ClusterError(f"Ray could not place {what} within {timeout_s:.0f} s ({len(unready)} group(s) "
                           f"unplaced). The cluster has: {describe_cluster()}. Add the nodes or resources the "
                           "plan needs (`train --dry-run` lists them).")


def describe_cluster() -> str:
    """Alive nodes with their GPUs and role resources, in one line."""
    import ray

    parts = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        r = n.get("Resources", {})
        roles = [k.removeprefix("agentrl_") for k in (TRAIN_RESOURCE, INFER_RESOURCE) if r.get(k)]
        parts.append(f"{n.get('NodeManagerAddress')}: {r.get('GPU', 0):g} GPU, {r.get('CPU', 0):g} CPU, "
                     f"roles {'+'.join(roles) or 'none'}")
    return "; ".join(parts) or "no alive node"


def missing_capacity(plan: RunPlan, nodes: list[dict]) -> list[str]:
    """What the cluster (Ray's `ray.nodes()` rows) lacks for `plan`, one line each; [] if enough.
    Counts whole nodes per role: a training node must offer ranks_per_train_node x gpus_per_rank
    GPUs, an inference node the GPUs of the engines the plan puts on it."""
    alive = [n for n in nodes if n.get("Alive")]

    def offering(resource: str, gpus: float) -> int:
        return sum(1 for n in alive if n.get("Resources", {}).get(resource, 0) >= 1
                   and n.get("Resources", {}).get("GPU", 0) + 1e-9 >= gpus)

    problems = []
    per_train = plan.ranks_per_train_node * plan.gpus_per_rank
    train_nodes = plan.layout.world // plan.ranks_per_train_node
    have = offering(TRAIN_RESOURCE, per_train)
    if have < train_nodes:
        problems.append(f"{train_nodes} training node(s) with {per_train:g} GPU(s) and the {TRAIN_RESOURCE} resource; "
                        f"the cluster has {have}")
    per_node: dict[int, float] = {}
    for e in plan.engines:
        for node in e.nodes:
            per_node[node] = per_node.get(node, 0.0) + e.gpus_per_node
    need = max(per_node.values(), default=0.0)
    if plan.colocated:
        return problems  # one machine with both roles: the training check covers it
    have = offering(INFER_RESOURCE, need)
    if have < len(per_node):
        problems.append(f"{len(per_node)} inference node(s) with {need:g} GPU(s) and the {INFER_RESOURCE} resource; "
                        f"the cluster has {have}")
    return problems


def ray_start_lines(plan: RunPlan, head: str = "HEAD_IP:6379") -> list[str]:
    """The `ray start` commands that give a cluster what `plan` needs (token auth on)."""
    train_gpus = int(plan.ranks_per_train_node * plan.gpus_per_rank)
    infer_gpus = plan.gpus_per_node
    units = '{"%s": 1000}'
    return [
        "# every node, before `ray start`: export RAY_AUTH_MODE=token and the cluster's token "
        "(RAY_AUTH_TOKEN_PATH=/shared/ray_token, written once by `ray get-auth-token --generate`)",
        f"ray start --head --port {head.rsplit(':', 1)[-1]} --num-gpus {train_gpus} "
        f"--resources '{units % TRAIN_RESOURCE}'   # the head: one training node",
        f"ray start --address {head} --num-gpus {train_gpus} --resources '{units % TRAIN_RESOURCE}'"
        f"   # each of the other {max(plan.train_nodes - 1, 0)} training node(s)",
        f"ray start --address {head} --num-gpus {infer_gpus} --resources '{units % INFER_RESOURCE}'"
        f"   # each of the {plan.inference_nodes} inference node(s)",
    ]
