"""Human and JSON views of a resolved config and plan (the launcher's --dry-run)."""

from __future__ import annotations

import json
import shlex

from rich.console import Console
from rich.table import Table

from agentrl.config.plan import RunPlan
from agentrl.config.schema import RunConfig
from agentrl.secrets import redact


def plan_json(cfg: RunConfig, plan: RunPlan, refusal: str | None = None) -> str:
    """One JSON object: the plan's fields at the top level, the resolved config under "config";
    `runnable` false with the `refusal` when the backend or transport cannot run it."""
    out = plan.to_json()
    out["runnable"], out["refusal"] = refusal is None, refusal
    for e, spec in zip(out["engines"], plan.engines, strict=True):
        e["command"] = engine_command_preview(cfg, spec)
    out["recipe"] = cfg.recipe
    out["mode"] = cfg.mode
    out["config"] = cfg.model_dump(mode="json")
    out["memory_estimate_gb_per_gpu"] = _memory_estimate(cfg, plan)
    from agentrl.sync.update_time import update_estimate

    out["weight_update_estimate"] = update_estimate(cfg, plan)
    return redact(json.dumps(out, indent=2))


def _memory_estimate(cfg: RunConfig, plan: RunPlan) -> dict:
    """Per-GPU memory by role (agentrl/config/memory.py); {"unavailable": why} for a model it has
    no shapes for."""
    from agentrl.config.memory import engine_memory, trainer_memory

    try:
        out = {"trainer": trainer_memory(cfg, plan)}
        if plan.engine_kind == "sglang" and plan.engines:
            out["engine"] = engine_memory(cfg, plan)
    except (KeyError, ValueError) as err:
        return {"unavailable": str(err)}
    return out


def print_plan(cfg: RunConfig, plan: RunPlan, console: Console | None = None) -> None:
    """Print the plan as tables; the rendered text passes through `redact` before it leaves."""
    console = console or Console()
    with console.capture() as captured:
        _render_plan(cfg, plan, console)
    console.file.write(redact(captured.get()))


def show_plan(cfg: RunConfig, plan: RunPlan, as_json: bool) -> str | None:
    """Print the plan (JSON or tables) with its runnability, and return the refusal `train` would give
    (None when the trainer backend and the weight transport accept it): a dry run never shows as
    runnable a plan that is not. The caller decides the exit."""
    from agentrl.config.plan import PlanError, check_plan_runnable

    try:
        check_plan_runnable(plan)
        refusal = None
    except PlanError as e:
        refusal = str(e)
    if as_json:
        print(plan_json(cfg, plan, refusal=refusal), flush=True)
    else:
        print_plan(cfg, plan)
    return refusal


def engine_command_preview(cfg: RunConfig, spec) -> str:
    """Node 0's command of engine `spec`, with the addresses only its node knows as placeholders."""
    from agentrl.rollout.engine_cmd import engine_argv

    node0 = f"<ip of node {spec.nodes[0]}>"
    argv = engine_argv(cfg, spec, node_rank=0, host=_bind_preview(cfg), port=spec.port or 0,
                       dist_init_addr=f"{node0}:<free port>" if len(spec.nodes) > 1 else None)
    return shlex.join(argv)


def _bind_preview(cfg: RunConfig) -> str:
    return "<node ip>" if cfg.cluster.host == "node_ip" else cfg.cluster.host


def _render_plan(cfg: RunConfig, plan: RunPlan, console: Console) -> None:
    lay = plan.layout
    head = Table(title=f"agentrl plan: recipe {cfg.recipe}, model {plan.model}, {cfg.mode} mode", show_header=False)
    head.add_column(style="bold")
    head.add_column()
    head.add_row("cluster", f"{plan.num_nodes} node(s) x {plan.gpus_per_node} GPU(s), {plan.hardware}")
    head.add_row("roles", f"{plan.train_nodes} train node(s), {plan.inference_nodes} inference node(s)"
                 + (" (shared machine)" if plan.num_nodes == 1 else "")
                 + ("; trainer and engines share each GPU" if plan.colocated else ""))
    where = f"{plan.train_gpus} GPU(s)" if plan.gpus_per_rank else "CPU (gloo)"
    head.add_row("trainer", f"{plan.backend} backend, {lay.world} rank(s) on {where}; {lay.describe()}")
    head.add_row("pipeline", f"layers per stage {list(lay.pp_split)}; stages start on layers {lay.stage_first_layers}")
    head.add_row("weights", f"{plan.weight_transport} to {len(plan.engines)} engine(s)")
    head.add_row("batch", f"{cfg.algorithm.prompts_per_step} prompts x {cfg.algorithm.group_size} samples per step; "
                 f"max {cfg.buffer.max_episodes_in_flight} episodes in flight; max staleness {cfg.buffer.max_staleness}")
    head.add_row("optimizer", f"Adam lr {cfg.train.optimizer.lr:g}, wd {cfg.train.optimizer.weight_decay:g}, "
                 f"betas ({cfg.train.optimizer.beta1:g}, {cfg.train.optimizer.beta2:g}), state: {cfg.train.optimizer.offload}")
    head.add_row("sandboxes", f"{cfg.sandbox.backend}; env {cfg.env.name}; agent {cfg.agent.action_format}, "
                 f"{cfg.agent.max_turns} turns")
    head.add_row("run dir", str(cfg.logging.run_dir))
    console.print(head)

    nodes = Table(title="nodes")
    for c in ("node", "role", "GPUs"):
        nodes.add_column(c)
    for r in plan.node_roles:
        nodes.add_row(str(r.node), r.role, str(r.gpus))
    console.print(nodes)

    eng = Table(title=f"engines ({plan.engine_kind}); command of node_rank 0, addresses filled in where it runs")
    for c in ("#", "node(s)", "GPUs", "port", "command"):
        eng.add_column(c, overflow="fold")
    for e in plan.engines:
        eng.add_row(str(e.index), ",".join(map(str, e.nodes)), f"{e.gpus:g}", str(e.port or "free"),
                    redact(engine_command_preview(cfg, e)))
    console.print(eng)
    envs = {k: v for e in plan.engines for k, v in e.env.items()}
    if envs:
        console.print("engine environment: " + redact(" ".join(f"{k}={v}" for k, v in sorted(envs.items()))))
    _render_memory(cfg, plan, console)
    _render_update_time(cfg, plan, console)
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")


def _render_memory(cfg: RunConfig, plan: RunPlan, console: Console) -> None:
    from agentrl.config.memory import HARDWARE, memory_rows

    try:
        rows = memory_rows(cfg, plan)
    except (KeyError, ValueError) as err:
        console.print(f"memory estimate unavailable: {err}")
        return
    hbm = HARDWARE.get(plan.hardware, {}).get("hbm_gb")
    mem = Table(title="memory estimate per GPU, GB (agentrl bench capacity)" + (f"; HBM {hbm:g} GB" if hbm else ""))
    for c in ("role", "weights", "grads", "activations (full recompute)", "optimizer", "KV pool", "total"):
        mem.add_column(c)
    for r in rows:
        mem.add_row(*r)
    console.print(mem)


_SHORT = {"broadcast": "bcast", "gather_nic": "NIC", "gather_nvlink": "NVLink", "fp8_launch": "FP8"}


def _render_update_time(cfg: RunConfig, plan: RunPlan, console: Console) -> None:
    """The predicted time of one full weight update, stage by stage (agentrl.sync.update_time)."""
    from agentrl.sync.update_time import update_estimate

    est = update_estimate(cfg, plan)
    if "unavailable" in est:
        console.print(f"weight update estimate unavailable: {est['unavailable']}")
        return
    e, other = est["configured"], est["other"]
    buckets = sum(s["buckets"] for s in e["stages"])
    t = Table(title=f"one full weight update, predicted: {'FP8' if e['fp8'] else 'bf16'}, {e['gb_per_engine_gpu']:.0f} "
                    f"GB to every engine GPU over {e['link']} at {e['broadcast_gbps']:.0f} GB/s, {buckets} buckets")
    # bcast: to every engine GPU; NIC / NVLink: the sender gathering experts and TP shards; FP8: launches
    for c in ("stage", "GB", "bcast s", "NIC s", "NVLink s", "FP8 s", "total s", "bound"):
        t.add_column(c)
    for s in e["stages"]:
        t.add_row(str(s["stage"]), f"{s['gb']:.0f}", f"{s['broadcast_s']:.2f}", f"{s['gather_nic_s']:.2f}",
                  f"{s['gather_nvlink_s']:.2f}", f"{s['fp8_launch_s']:.2f}", f"{s['seconds']:.2f}", _SHORT[s["dominant"]])
    console.print(t)
    console.print(f"weight update: {e['seconds']:.1f} s predicted (goal {e['goal_s']:g} s; "
                  f"{'FP8' if other['fp8'] else 'bf16'} would take {other['seconds']:.1f} s); stages run one after "
                  "another, each engine GPU receives every tensor")
