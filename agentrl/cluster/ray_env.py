"""Starting or attaching Ray, and placing actors by node role.

Node roles are Ray custom resources: a node that trains advertises `agentrl_train`, one that
serves advertises `agentrl_inference` (`ray start --resources '{"agentrl_train": 1000}'` on a
real cluster). A local run gives its one node both, so the same placement code runs for real.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from agentrl.config.plan import RunPlan
from agentrl.config.schema import RunConfig

TRAIN_RESOURCE = "agentrl_train"
INFER_RESOURCE = "agentrl_inference"
ROLE_UNITS = 1000  # units a node advertises per role; one actor takes one


@dataclass
class RayHandle:
    started_here: bool
    dashboard_url: str | None


def init_ray(cfg: RunConfig) -> RayHandle:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if cfg.cluster.ray_address:
        ray.init(address=cfg.cluster.ray_address, log_to_driver=False)
        return RayHandle(False, None)
    # A local Ray bound to 127.0.0.1 only: its dashboard needs no token on this machine.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ctx = ray.init(
        address="local",  # a new cluster, never another `ray start` cluster on this machine
        num_cpus=cfg.cluster.num_cpus or max(4, os.cpu_count() or 1),
        num_gpus=cfg.cluster.gpus_per_node,
        resources={TRAIN_RESOURCE: ROLE_UNITS, INFER_RESOURCE: ROLE_UNITS},
        include_dashboard=cfg.cluster.dashboard,
        dashboard_host=cfg.cluster.host,
        dashboard_port=cfg.cluster.dashboard_port,
        _node_ip_address=cfg.cluster.host,
        log_to_driver=False,
        configure_logging=False,
        **({"_metrics_export_port": cfg.cluster.metrics_export_port,
            "_system_config": {"metrics_report_interval_ms": 1000}} if cfg.cluster.metrics_export_port else {}),
    )
    url = getattr(ctx, "dashboard_url", None) if cfg.cluster.dashboard else None
    return RayHandle(True, f"http://{url}" if url and not url.startswith("http") else url)


def role_placement_group(role: str, bundles: list[dict[str, float]], name: str) -> Any:
    """A placement group whose bundles all sit on nodes of `role`; waits until it is placed."""
    import ray
    from ray.util.placement_group import placement_group

    res = TRAIN_RESOURCE if role == "train" else INFER_RESOURCE
    pg = placement_group([{**b, res: 1} for b in bundles], strategy="PACK", name=name)
    ray.get(pg.ready(), timeout=120)
    return pg


def trainer_bundles(plan: RunPlan) -> list[dict[str, float]]:
    if plan.train_gpus:
        return [{"CPU": 1, "GPU": 1} for _ in range(plan.train_gpus)]
    return [{"CPU": 1}]


def engine_bundles(plan: RunPlan) -> list[dict[str, float]]:
    out = []
    for e in plan.engines:
        per_node = e.gpus // len(e.nodes) if e.gpus else 0
        out.extend({"CPU": 1, **({"GPU": per_node} if per_node else {})} for _ in e.nodes)
    return out


def in_bundle(pg: Any, index: int) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)}
