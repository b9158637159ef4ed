#!/usr/bin/env python3
"""Launch GLM-5.2 (or a small local model) agentic RL on terminal-bench-2.

  prepare      validate the HF checkpoint and convert it to Megatron torch_dist
  prepare-cp   copy the converted checkpoint to node-local disk (resumable, checksummed)
  train        run the fully-async training loop
  full-train   prepare, then train

Every subcommand takes the same options; `--dry-run` prints the resolved plan (node roles,
parallel layout, pipeline split, engine command lines) and starts nothing.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(
    name="run_glm5_2_daytona.py",
    help=__doc__,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)

# Which recipe a model name starts from when --config is not given.
DEFAULT_RECIPE = {
    "GLM-5.2": "glm5_2_tbench2",
    "GLM-5.2_5layer": "glm5_2_5layer_1node",
    "tiny": "local",
    "smollm2-135m": "local_smollm2",
}


class Hardware(str, Enum):
    H200 = "H200"
    B200 = "B200"
    GB300 = "GB300"
    cpu = "cpu"


class SandboxBackend(str, Enum):
    local = "local"
    daytona = "daytona"


NumNodes = Annotated[int | None, typer.Option("--num-nodes", help="Nodes in the cluster (default: the recipe's).")]
GpusPerNode = Annotated[int | None, typer.Option("--gpus-per-node", help="GPUs per node (0 = CPU).")]
HardwareOpt = Annotated[Hardware | None, typer.Option("--hardware", help="H200, B200, GB300 or cpu.")]
ModelName = Annotated[str, typer.Option("--model-name", help=f"One of {', '.join(DEFAULT_RECIPE)}.")]
ConfigOpt = Annotated[str | None, typer.Option("--config", help="Recipe name (configs/NAME.yaml) or YAML path.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a field: section.key=value (repeatable).")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the resolved plan and start nothing.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="With --dry-run: one JSON object instead of tables.")]
SandboxOpt = Annotated[SandboxBackend | None, typer.Option("--sandbox", help="Sandbox backend: local or daytona.")]
RunDir = Annotated[Path | None, typer.Option("--run-dir", help="Where metrics, logs and checkpoints go.")]


def resolve(model_name, num_nodes, gpus_per_node, hardware, config, overrides, sandbox=None, run_dir=None):
    """Recipe -> launcher options -> --set overrides; exits with a clear message on bad input."""
    from agentrl.config.loader import ConfigError, load_config
    from agentrl.config.plan import PlanError, resolve_plan

    if config is None and model_name not in DEFAULT_RECIPE:
        _fail(f"--model-name {model_name!r} is not a known model; use one of {', '.join(DEFAULT_RECIPE)} "
              f"or pass --config with a recipe")
    extra: dict[str, Any] = {"model": {"name": model_name}}
    cluster: dict[str, Any] = {}
    if num_nodes is not None:
        cluster["num_nodes"] = num_nodes
        if num_nodes == 1:
            cluster["train_nodes"] = None
    if gpus_per_node is not None:
        cluster["gpus_per_node"] = gpus_per_node
    if hardware is not None:
        cluster["hardware"] = hardware.value
    if cluster:
        extra["cluster"] = cluster
    if sandbox is not None:
        extra["sandbox"] = {"backend": sandbox.value}
    if run_dir is not None:
        extra["logging"] = {"run_dir": str(run_dir)}
    try:
        cfg = load_config(config or DEFAULT_RECIPE[model_name], overrides or [], extra)
        if num_nodes is not None and num_nodes > 1 and cfg.cluster.train_nodes is not None \
                and cfg.cluster.train_nodes >= num_nodes:
            cfg.cluster.train_nodes = num_nodes // 2
        plan = resolve_plan(cfg)
    except (ConfigError, PlanError, ValueError) as e:
        _fail(str(e))
    return cfg, plan


def _fail(msg: str, code: int = 2):
    from agentrl.secrets import redact

    typer.echo(f"error: {redact(msg)}", err=True)
    raise typer.Exit(code)


def _show(cfg, plan, as_json: bool) -> None:
    from agentrl.config.show import plan_json, print_plan

    if as_json:
        typer.echo(plan_json(cfg, plan))
    else:
        print_plan(cfg, plan)


def _not_built(what: str, issue: str) -> None:
    _fail(f"{what} is not built yet (issue {issue}); nothing was started. "
          f"Use --dry-run to see the plan.", code=3)


@app.command()
def prepare(model_name: ModelName = "GLM-5.2", num_nodes: NumNodes = None, gpus_per_node: GpusPerNode = None,
            hardware: HardwareOpt = None, config: ConfigOpt = None, set_: SetOpt = None, dry_run: DryRun = False,
            as_json: JsonOpt = False) -> None:
    """Validate the HF checkpoint (model.path) and convert it to Megatron torch_dist (model.megatron_dir)."""
    cfg, plan = resolve(model_name, num_nodes, gpus_per_node, hardware, config, set_)
    if dry_run:
        return _show(cfg, plan, as_json)
    _prepare(cfg, plan)


def _prepare(cfg, plan) -> None:
    from agentrl.models.checkpoint import CheckpointError, validate_glm_checkpoint
    from agentrl.models.prepare import convert_hf_to_megatron

    m = cfg.model
    if m.path is None or m.megatron_dir is None:
        _fail("prepare needs model.path (the HF checkpoint folder) and model.megatron_dir (where the "
              "torch_dist checkpoint goes): --set model.path=/data/GLM-5.2 --set model.megatron_dir=/data/GLM-5.2_torch_dist")
    try:
        validate_glm_checkpoint(m.path, m.name)
    except CheckpointError as e:
        _fail(str(e))
    typer.echo(f"prepare: {m.path} is a valid {m.name} checkpoint; converting to {m.megatron_dir}", err=True)
    out = convert_hf_to_megatron(m.path, m.megatron_dir, plan.layout)
    typer.echo(f"prepare: wrote {out}", err=True)


@app.command("prepare-cp")
def prepare_cp(model_name: ModelName = "GLM-5.2", num_nodes: NumNodes = None, gpus_per_node: GpusPerNode = None,
               hardware: HardwareOpt = None, config: ConfigOpt = None, set_: SetOpt = None,
               dry_run: DryRun = False, as_json: JsonOpt = False) -> None:
    """Copy the converted checkpoint to node-local disk (model.local_dir); run on every node."""
    cfg, plan = resolve(model_name, num_nodes, gpus_per_node, hardware, config, set_)
    if dry_run:
        return _show(cfg, plan, as_json)
    from agentrl.models.prepare import copy_checkpoint_to_local

    m = cfg.model
    if m.megatron_dir is None or m.local_dir is None:
        _fail("prepare-cp needs model.megatron_dir (the converted checkpoint on shared storage) and "
              "model.local_dir (node-local destination)")
    try:
        report = copy_checkpoint_to_local(m.megatron_dir, m.local_dir)
    except (FileNotFoundError, OSError) as e:
        _fail(str(e))
    typer.echo(f"prepare-cp: {len(report.copied)} copied, {len(report.skipped)} already verified, "
               f"{len(report.recopied)} re-copied (corrupt or stale), {report.bytes_copied / 1e9:.2f} GB", err=True)


@app.command()
def train(model_name: ModelName = "GLM-5.2", num_nodes: NumNodes = None, gpus_per_node: GpusPerNode = None,
          hardware: HardwareOpt = None, config: ConfigOpt = None, set_: SetOpt = None, dry_run: DryRun = False,
          as_json: JsonOpt = False, sandbox: SandboxOpt = None, run_dir: RunDir = None,
          quiet: Annotated[bool, typer.Option("--quiet", help="No progress lines or status panel (the final JSON "
                                                               "summary and errors still print).")] = False,
          rehearse: Annotated[bool, typer.Option("--rehearse", help="Place the plan for real on a simulated local "
                                                 "Ray cluster (no model work), report and stop.")] = False) -> None:
    """Run fully-async agentic RL: trainer, engines, episode workers, replay buffer on Ray."""
    cfg, plan = resolve(model_name, num_nodes, gpus_per_node, hardware, config, set_, sandbox, run_dir)
    if dry_run:
        return _show(cfg, plan, as_json)
    if rehearse:
        from agentrl.cluster.rehearsal_report import run_for_launcher

        raise typer.Exit(run_for_launcher(plan, cfg.cluster.episode_workers, as_json, typer.echo))
    _train(cfg, plan, quiet)


def _train(cfg, plan, quiet: bool = False) -> None:
    import asyncio
    import json

    if plan.engine_kind != "embedded":  # the trainer side (torch or megatron backend) is in the loop
        _not_built(f"the {plan.engine_kind} engine actor in the run loop (SGLang needs its own environment: "
                   f"it pins another torch; the {plan.backend} trainer backend is ready)", "[R]")
    from agentrl.orchestrator import Orchestrator
    from agentrl.progress import Progress

    try:
        summary = asyncio.run(Orchestrator(cfg, plan, Progress(quiet=quiet)).run())
    except KeyboardInterrupt:
        _fail("interrupted; engines, workers and sandboxes were stopped", code=130)
    except Exception as e:
        from ray.exceptions import RayActorError

        if not isinstance(e, RayActorError):
            raise
        who = next((ln.split(":", 1)[1].strip() for ln in str(e).splitlines() if "class_name:" in ln), "an actor")
        _fail(f"the run stopped: {who} died ({type(e).__name__}; killed, out of memory or crashed). Processes "
              f"and sandboxes were stopped; accepted trajectories are kept in {cfg.logging.run_dir}/replay.log.jsonl. "
              f"Run the same command again to resume from the last checkpoint.", code=1)
    typer.echo(json.dumps({"run_dir": str(cfg.logging.run_dir), "steps": summary["steps"],
                           "wall_s": round(summary["wall_s"], 1), "evals": summary["evals"]}))


@app.command("full-train")
def full_train(model_name: ModelName = "GLM-5.2", num_nodes: NumNodes = None, gpus_per_node: GpusPerNode = None,
               hardware: HardwareOpt = None, config: ConfigOpt = None, set_: SetOpt = None,
               dry_run: DryRun = False, as_json: JsonOpt = False, sandbox: SandboxOpt = None,
               run_dir: RunDir = None) -> None:
    """prepare, then train."""
    cfg, plan = resolve(model_name, num_nodes, gpus_per_node, hardware, config, set_, sandbox, run_dir)
    if dry_run:
        return _show(cfg, plan, as_json)
    if plan.backend == "megatron":
        _prepare(cfg, plan)
    _train(cfg, plan)


def main() -> None:
    # Typer names the option after the parameter; `--set` is a keyword in Python, hence set_.
    app(prog_name="run_glm5_2_daytona.py")


if __name__ == "__main__":
    sys.exit(main())
