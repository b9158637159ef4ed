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

import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="run_glm5_2_daytona.py",
    help=__doc__,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)

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
ModelName = Annotated[str | None, typer.Option(
    "--model-name", help="GLM-5.2 (default), GLM-5.2_5layer, tiny, smollm2-135m or gemma3-270m; picks the recipe when --config "
    "is not given, overrides the recipe's model when it is.")]
ConfigOpt = Annotated[str | None, typer.Option("--config", help="Recipe name (configs/NAME.yaml) or YAML path.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a field: section.key=value (repeatable).")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the resolved plan and start nothing.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="With --dry-run: one JSON object instead of tables.")]
SandboxOpt = Annotated[SandboxBackend | None, typer.Option("--sandbox", help="Sandbox backend: local or daytona.")]
RunDir = Annotated[Path | None, typer.Option("--run-dir", help="Where metrics, logs and checkpoints go.")]


def resolve(model_name, num_nodes, gpus_per_node, hardware, config, overrides, sandbox=None, run_dir=None):
    """The front door (agentrl.config.front); exits with a clear, redacted message on bad input.
    Whether the backend can run the plan is checked by the caller (`_show`, `_train`)."""
    from agentrl.config.front import FrontDoorError, resolve_run

    try:
        return resolve_run(config=config, model_name=model_name, num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                           hardware=hardware.value if hardware is not None else None, overrides=overrides,
                           sandbox=sandbox.value if sandbox is not None else None, run_dir=run_dir,
                           check_runnable=False)
    except FrontDoorError as e:
        _fail(str(e))


def _fail(msg: str, code: int = 2):
    from agentrl.config.front import error_line

    typer.echo(error_line(msg), err=True)
    raise typer.Exit(code)


def _show(cfg, plan, as_json: bool) -> None:
    """The plan, then, if the trainer backend or the weight transport would refuse it, the same
    refusal `train` gives (exit 2): the dry run never shows a plan as runnable that is not."""
    from agentrl.config.show import show_plan

    refusal = show_plan(cfg, plan, as_json)
    if refusal:
        _fail(f"this plan cannot run: {refusal}")


@app.command()
def prepare(model_name: ModelName = None, num_nodes: NumNodes = None, gpus_per_node: GpusPerNode = None,
            hardware: HardwareOpt = None, config: ConfigOpt = None, set_: SetOpt = None, dry_run: DryRun = False,
            as_json: JsonOpt = False,
            fp8: Annotated[bool, typer.Option("--fp8", help="Also write the engines' block-FP8 HF checkpoint "
                                              "(model.rollout_path) that FP8 weight updates match.")] = False) -> None:
    """Validate the HF checkpoint (model.path) and convert it to Megatron torch_dist (model.megatron_dir);
    with --fp8, also to a block-FP8 HF checkpoint for the engines (model.rollout_path)."""
    cfg, plan = resolve(model_name, num_nodes, gpus_per_node, hardware, config, set_)
    if dry_run:
        return _show(cfg, plan, as_json)
    _prepare(cfg, plan, fp8=fp8)


def _prepare(cfg, plan, fp8: bool = False) -> None:
    from agentrl.models.checkpoint import CheckpointError, validate_glm_checkpoint
    from agentrl.models.prepare import convert_hf_to_megatron

    m = cfg.model
    if fp8 and (m.path is None or m.rollout_path is None):
        _fail("prepare --fp8 needs model.path (the HF checkpoint folder) and model.rollout_path (where the FP8 "
              "checkpoint for the engines goes): --set model.rollout_path=/data/GLM-5.2-FP8")
    if m.path is None or (m.megatron_dir is None and not fp8):
        _fail("prepare needs model.path (the HF checkpoint folder) and model.megatron_dir (where the "
              "torch_dist checkpoint goes): --set model.path=/data/GLM-5.2 --set model.megatron_dir=/data/GLM-5.2_torch_dist")
    try:
        validate_glm_checkpoint(m.path, m.name)
    except CheckpointError as e:
        _fail(str(e))
    if fp8:
        from agentrl.models.prepare import write_fp8_checkpoint

        typer.echo(f"prepare: writing the engines' FP8 checkpoint to {m.rollout_path}", err=True)
        counts = write_fp8_checkpoint(m.path, m.rollout_path)
        typer.echo(f"prepare: wrote {m.rollout_path} ({counts['fp8']} FP8 tensors, {counts['kept']} kept)", err=True)
        if m.megatron_dir is None:
            return
    typer.echo(f"prepare: {m.path} is a valid {m.name} checkpoint; converting to {m.megatron_dir}", err=True)
    out = convert_hf_to_megatron(m.path, m.megatron_dir, plan.layout)
    typer.echo(f"prepare: wrote {out}", err=True)


@app.command("prepare-cp")
def prepare_cp(model_name: ModelName = None, num_nodes: NumNodes = None, gpus_per_node: GpusPerNode = None,
               hardware: HardwareOpt = None, config: ConfigOpt = None, set_: SetOpt = None,
               dry_run: DryRun = False, as_json: JsonOpt = False,
               role: Annotated[str, typer.Option("--role", help="all (default), train or inference: which "
                                                 "checkpoints this node needs.")] = "all") -> None:
    """Copy checkpoints to node-local disk; run on every node. Training nodes: the converted Megatron
    checkpoint (model.megatron_dir -> model.local_dir). Inference nodes: the engines' rollout checkpoint
    (model.rollout_path -> model.rollout_local_dir). Each pair that is set is copied (sha256-checked,
    resumable); --role limits it to one kind of node."""
    cfg, plan = resolve(model_name, num_nodes, gpus_per_node, hardware, config, set_)
    if dry_run:
        return _show(cfg, plan, as_json)
    from agentrl.models.prepare import copy_checkpoint_to_local

    m = cfg.model
    pairs = {"train": ("model.megatron_dir", m.megatron_dir, "model.local_dir", m.local_dir),
             "inference": ("model.rollout_path", m.rollout_path, "model.rollout_local_dir", m.rollout_local_dir)}
    chosen = [r for r in pairs if role in ("all", r) and pairs[r][1] is not None and pairs[r][3] is not None]
    if not chosen:
        _fail("prepare-cp has nothing to copy: set model.megatron_dir and model.local_dir (training nodes) and/or "
              "model.rollout_path and model.rollout_local_dir (inference nodes)")
    for r in chosen:
        src_field, src, dst_field, dst = pairs[r]
        try:
            report = copy_checkpoint_to_local(src, dst)
        except (FileNotFoundError, OSError) as e:
            _fail(f"{src_field} -> {dst_field}: {e}")
        typer.echo(f"prepare-cp ({r}): {len(report.copied)} copied, {len(report.skipped)} already verified, "
                   f"{len(report.recopied)} re-copied (corrupt or stale), {report.bytes_copied / 1e9:.2f} GB", err=True)


@app.command()
def train(model_name: ModelName = None, num_nodes: NumNodes = None, gpus_per_node: GpusPerNode = None,
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

        raise typer.Exit(run_for_launcher(cfg, plan, cfg.cluster.episode_workers, as_json, typer.echo))
    _train(cfg, plan, quiet)


def preflight(cfg, plan) -> None:
    """What must hold before anything starts (Ray, trainer ranks, engines), each failure one line
    naming the field: a cluster to run on, the Daytona key, a run folder it can write (made only once
    those hold), the model and rollout checkpoints, the tokenizer, tasks to play."""
    from agentrl.cluster.ray_env import no_cluster_message, ray_address

    if plan.num_nodes > 1 and not ray_address(cfg) and not cfg.cluster.simulate_nodes:
        _fail(no_cluster_message(plan))
    if cfg.sandbox.backend == "daytona" and not os.environ.get("DAYTONA_API_KEY") and not ray_address(cfg):
        # The Ray this run starts passes this process's environment to its workers, which create the
        # sandboxes; on a cluster given by address, the nodes' own environments count instead.
        _fail("sandbox.backend=daytona: DAYTONA_API_KEY is not set; export the Daytona API key in this shell "
              "(it is never a config field), or use --sandbox local")
    from agentrl.config.front import unwritable_folder

    if why := unwritable_folder(cfg.logging.run_dir):  # else the orchestrator's start fails with a traceback
        _fail(f"logging.run_dir={cfg.logging.run_dir}: {why}; pass --run-dir a writable folder")
    m = cfg.model
    for field, path in (("model.path", m.path), ("model.rollout_path", m.rollout_path)):
        if path is not None and not Path(path).is_dir():
            _fail(f"{field}={path} is not a folder on this machine; point it at the HF checkpoint folder")
        if path is not None and not (Path(path) / "config.json").is_file():
            _fail(f"{field}={path} has no config.json: not an HF checkpoint folder; point it at one")
    if plan.engine_kind == "sglang" and m.rollout_local_dir is None and m.rollout_path is None and m.path is None:
        _fail("the SGLang engines need a checkpoint to load: set model.rollout_path (an HF folder, or the "
              "pre-converted FP8 HF checkpoint) or model.path; `prepare-cp` copies it node-locally "
              "(model.rollout_local_dir)")
    from agentrl.models.tokenizer import load_tokenizer

    try:
        load_tokenizer(m.path or m.name)
    except (ValueError, OSError) as e:
        _fail(f"model.path: the episode workers need the model's tokenizer: {e}")
    from agentrl.agent.runner import split_tasks
    from agentrl.envs.base import SplitEnv
    from agentrl.envs.registry import EnvRegistryError, make_run_env

    try:
        env = make_run_env(cfg)
        ids = list(env.task_ids())
        if not ids:
            _fail(f"env {cfg.env.name}: no task to play (env.tasks_dir={cfg.env.tasks_dir}); point env.tasks_dir at "
                  "a folder of task folders")
        split_tasks(cfg, ids, dict(env.splits()) if isinstance(env, SplitEnv) else {})
    except EnvRegistryError as e:  # names the env itself
        _fail(str(e))
    except (ValueError, LookupError, OSError) as e:
        _fail(f"env {cfg.env.name}: {e}")


def _train(cfg, plan, quiet: bool = False) -> None:
    import asyncio
    import json

    from agentrl.config.plan import PlanError, check_plan_runnable

    try:
        check_plan_runnable(plan)
    except PlanError as e:
        _fail(f"this plan cannot run: {e}")
    if _DRIVER_SESSION:
        # Before any thread or process starts: the driver (and Ray's processes under it) in a session
        # of its own, behind this process, which forwards the stop signals (agentrl/cluster/driver_session.py).
        from agentrl.cluster.driver_session import shield_driver

        shield_driver()
    preflight(cfg, plan)
    import signal

    from agentrl.cluster.ray_env import ClusterError
    from agentrl.orchestrator import Orchestrator
    from agentrl.policy.retry import NoPlayableTasks
    from agentrl.progress import Progress

    # Before the loop runs, SIGTERM (a scheduler's stop, `kill`) ends the start-up the way Ctrl-C
    # does; once it runs, _run_stoppable makes the first signal a clean stop.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    orch = Orchestrator(cfg, plan, Progress(quiet=quiet))
    try:
        summary = asyncio.run(_run_stoppable(orch))
    except (KeyboardInterrupt, asyncio.CancelledError):
        _fail("interrupted; engines, workers and sandboxes were stopped", code=130)
    except (ClusterError, NoPlayableTasks) as e:
        _fail(str(e))
    except Exception as e:
        from ray.exceptions import RayActorError, RayTaskError

        if isinstance(e, RayTaskError):  # an actor method raised: its own message says why
            cause = e.cause if e.cause is not None else e
            _fail(f"the run stopped: {type(cause).__name__}: {str(cause).splitlines()[-1] if str(cause) else ''}. "
                  f"Processes and sandboxes were stopped; accepted trajectories are kept in "
                  f"{cfg.logging.run_dir}/replay.log.jsonl.", code=1)
        if not isinstance(e, RayActorError):
            raise
        who = next((ln.split(":", 1)[1].strip() for ln in str(e).splitlines() if "class_name:" in ln), "an actor")
        _fail(f"the run stopped: {who} died ({type(e).__name__}; killed, out of memory or crashed). Processes "
              f"and sandboxes were stopped; accepted trajectories are kept in {cfg.logging.run_dir}/replay.log.jsonl. "
              f"Run the same command again to resume from the last checkpoint.", code=1)
    typer.echo(json.dumps({"run_dir": str(cfg.logging.run_dir), "steps": summary["steps"],
                           "wall_s": round(summary["wall_s"], 1), "evals": summary["evals"],
                           "stopped": summary.get("stopped")}))
    if summary.get("stopped"):
        sig = getattr(signal, summary["stopped"], None)
        saved = "its checkpoint saved" if summary["steps"] else "before its first step (nothing to checkpoint)"
        _fail(f"stopped by {summary['stopped']} at step {summary['steps']}, {saved}; run the same command to resume",
              code=128 + int(sig) if sig is not None else 1)


async def _run_stoppable(orch):
    """orch.run() with SIGTERM and SIGINT handled on the loop: the first asks for a clean stop (the
    optimizer step in flight finishes and is checkpointed, then everything shuts down: seconds, a
    checkpoint's write); a second one stops at once, without that checkpoint."""
    import asyncio
    import signal

    loop, main = asyncio.get_running_loop(), asyncio.current_task()

    def on_signal(sig: signal.Signals) -> None:
        if orch.stop_requested is not None:
            main.cancel()
            return
        orch.progress.note(f"{sig.name}: finishing the step in flight, saving a checkpoint, stopping "
                           f"({sig.name} again stops at once)")
        orch.request_stop(sig.name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await orch.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


@app.command("full-train")
def full_train(model_name: ModelName = None, num_nodes: NumNodes = None, gpus_per_node: GpusPerNode = None,
               hardware: HardwareOpt = None, config: ConfigOpt = None, set_: SetOpt = None,
               dry_run: DryRun = False, as_json: JsonOpt = False, sandbox: SandboxOpt = None,
               run_dir: RunDir = None) -> None:
    """prepare, then train."""
    cfg, plan = resolve(model_name, num_nodes, gpus_per_node, hardware, config, set_, sandbox, run_dir)
    if dry_run:
        return _show(cfg, plan, as_json)
    if plan.backend == "megatron":
        m = cfg.model
        fp8 = bool(cfg.rollout.weight_sync_fp8 and m.rollout_path is not None and not Path(m.rollout_path).exists())
        _prepare(cfg, plan, fp8=fp8)
    _train(cfg, plan)


_DRIVER_SESSION = False  # set by main(): only the command-line launcher forks its driver


def main() -> None:
    global _DRIVER_SESSION
    _DRIVER_SESSION = True
    # Typer names the option after the parameter; `--set` is a keyword in Python, hence set_.
    app(prog_name="run_glm5_2_daytona.py")


if __name__ == "__main__":
    sys.exit(main())
