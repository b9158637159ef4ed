"""Starting or attaching Ray for a plan.

Node roles are Ray custom resources: a node that trains advertises `agentrl_train`, one that
serves advertises `agentrl_inference` (`ray start --resources '{"agentrl_train": 1000}'`; see
scripts/start_cluster.sh). Three ways to get a cluster, checked in this order:
- attach: `cluster.ray_address` (or RAY_ADDRESS) names a running cluster. Multi-node clusters use
  Ray's token authentication (`cluster.ray_auth`, default "token"): the token comes from
  RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH or Ray's own file (~/.ray/auth_token), never from a config.
  The cluster must offer the plan's roles and GPUs; if not, the error lists what is missing and the
  `ray start` lines that fix it.
- simulate: `cluster.simulate_nodes` starts one local raylet per plan node on 127.0.0.1, each with
  its role resource (CPU runs: the same code placing the same actors, on one machine).
- local: a one-node Ray on `cluster.host` (127.0.0.1 by default) with both roles.
A plan of several nodes with no cluster to attach to is refused with the same instructions.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.cluster.roles import INFER_RESOURCE, ROLE_UNITS, TRAIN_RESOURCE, ClusterError
from agentrl.config.plan import RunPlan
from agentrl.config.schema import RunConfig

TOKEN_FILE = Path.home() / ".ray" / "auth_token"


@dataclass
class RayHandle:
    started_here: bool
    dashboard_url: str | None
    simulated: Any = None  # the SimCluster of a simulated start (stopped by shutdown)

    def shutdown(self) -> None:
        import ray

        if self.simulated is not None:
            from agentrl.cluster.simulated import stop_cluster

            stop_cluster(self.simulated)
        elif self.started_here and ray.is_initialized():
            ray.shutdown()


def ray_address(cfg: RunConfig) -> str | None:
    return cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS") or None


def init_ray(cfg: RunConfig, plan: RunPlan) -> RayHandle:
    """Start or attach Ray for `plan`. The caller's SIGTERM handler survives: Ray's driver installs
    its own (it prints a stack and aborts), which would skip the run's orderly shutdown."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        return _init_ray(cfg, plan)
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _init_ray(cfg: RunConfig, plan: RunPlan) -> RayHandle:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = ray_address(cfg)
    if address:
        return _attach(cfg, plan, address)
    if cfg.cluster.simulate_nodes:
        return _simulate(cfg, plan)
    if plan.num_nodes > 1:
        raise ClusterError(no_cluster_message(plan))
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
    return RayHandle(True, _url(getattr(ctx, "dashboard_url", None)) if cfg.cluster.dashboard else None)


def _url(u: str | None) -> str | None:
    return f"http://{u}" if u and not u.startswith("http") else u


def _attach(cfg: RunConfig, plan: RunPlan, address: str) -> RayHandle:
    import ray

    if cfg.cluster.ray_auth == "token":
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or TOKEN_FILE.exists()):
            raise ClusterError(
                f"attaching to {address} with token authentication (cluster.ray_auth=token) but no token is "
                f"available: set RAY_AUTH_TOKEN_PATH to the cluster's token file, or copy it to {TOKEN_FILE} "
                "(`ray get-auth-token` on the head prints it); cluster.ray_auth=disabled only on a trusted network")
    try:
        ctx = ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(f"cannot attach to the Ray cluster at {address} (cluster.ray_address): "
                           f"{str(e).splitlines()[0]}. Is it running? {_start_hint(plan)}") from None
    from agentrl.cluster.placement import missing_capacity, ray_start_lines

    missing = missing_capacity(plan, ray.nodes())
    if missing:
        ray.shutdown()
        raise ClusterError(f"the Ray cluster at {address} cannot run this plan; it lacks: " + "; ".join(missing)
                           + ". Start the missing nodes with:\n  " + "\n  ".join(ray_start_lines(plan, address)))
    return RayHandle(False, _url(getattr(ctx, "dashboard_url", None)))


def _simulate(cfg: RunConfig, plan: RunPlan) -> RayHandle:
    if plan.gpus_per_node:
        raise ClusterError("cluster.simulate_nodes simulates CPU nodes on this machine; a GPU plan needs a real "
                           "cluster (cluster.ray_address)")
    from agentrl.cluster.simulated import start_cluster

    temp = tempfile.mkdtemp(prefix="agentrl-ray-")
    sim = start_cluster(plan, nodes_per_raylet=1, temp_dir=temp, cpus_per_node=cfg.cluster.num_cpus or 4)
    return RayHandle(True, None, simulated=sim)


def no_cluster_message(plan: RunPlan) -> str:
    from agentrl.cluster.placement import ray_start_lines

    roles = f"{plan.train_nodes} training node(s) and {plan.inference_nodes} inference node(s)"
    return (f"this plan runs on a Ray cluster of {plan.num_nodes} nodes ({roles}, {plan.gpus_per_node} GPU(s) each) "
            "and no cluster was given: set cluster.ray_address (or RAY_ADDRESS) to the head node's address. Start "
            "the cluster with scripts/start_cluster.sh (or scripts/slurm_example.sbatch), i.e.:\n  "
            + "\n  ".join(ray_start_lines(plan)))


def _start_hint(plan: RunPlan) -> str:
    return "Start it with scripts/start_cluster.sh (`train --dry-run` shows the plan's nodes)." if plan else ""
