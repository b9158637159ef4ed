"""`agentrl bench ...`: every benchmark writes JSON under bench/results/ with machine and versions."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True,
                  help="Benchmarks writing bench/results/*.json (the bench/ package, outside the library).")
RESULTS = Path("bench/results")


@app.command("engine")
def engine(out: Path = typer.Option(RESULTS / "engine.json", help="Where the JSON report goes."),
           models: list[str] = typer.Option(["tiny", "smollm2-135m"], "--model", help="Models (repeatable)."),
           concurrency: list[int] = typer.Option([1, 8, 32], help="Concurrent requests (repeatable)."),
           new_tokens: int = typer.Option(64, help="Tokens generated per request."),
           torch_threads: int = typer.Option(1, help="torch threads of the engine; 1 is steadiest on a small "
                                                     "shared CPU machine (2 threads ran ~8x slower under load).")) -> None:
    """Embedded engine throughput at several concurrencies, and the client's per-request overhead."""
    from bench.engine import run_engine_bench

    report = run_engine_bench(out, tuple(models), tuple(concurrency), new_tokens=new_tokens,
                              torch_threads=torch_threads)
    typer.echo(f"wrote {out} (batching_speedup_32 = {report.get('batching_speedup_32')})")


@app.command("kernels")
def kernels(out: Path = typer.Option(RESULTS / "kernels.json", help="Where the JSON report goes."),
            only: list[str] = typer.Option([], help="Kernel families to run (default: all).")) -> None:
    """Triton kernels at GLM-5.2 dimensions (needs a CUDA GPU: without one it refuses, and the recorded
    report is left as it is)."""
    from bench.kernels import main

    code = main(["--out", str(out), *(["--only", ",".join(only)] if only else [])])
    if code:
        raise typer.Exit(code)
    typer.echo(f"wrote {out}")


@app.command("offload")
def offload(out: Path = typer.Option(RESULTS / "offload.json", help="Where the JSON report goes."),
            state_gb: float = typer.Option(0.3, help="Optimizer state size to stream (GB)."),
            directory: Path | None = typer.Option(None, "--dir", help="Node-local folder to stream through."),
            bucket_mb: int = typer.Option(64, help="Bucket size (MB of optimizer state).")) -> None:
    """Disk-offloaded Adam: streaming rate against the disk's measured bandwidth, and step-time
    overhead against in-memory AdamW."""
    from bench.offload import run_offload_bench

    report = run_offload_bench(out, state_gb, directory=directory, bucket_mb=bucket_mb)
    typer.echo(f"wrote {out} (offload_stream_efficiency = {report.get('offload_stream_efficiency')})")


@app.command("faults")
def faults(out: Path = typer.Option(RESULTS / "faults.json", help="Where the JSON report goes."),
           only: list[str] = typer.Option([], help="Scenarios to run (repeatable; default: all)."),
           fast: bool = typer.Option(False, help="Skip the scenarios that need full local training runs.")) -> None:
    """Fault injection into real local components; exit code 1 when any scenario fails."""
    from bench.faults import run_faults

    try:
        report = run_faults(out, only=only or None, include_slow=not fast, echo=typer.echo)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {out}: {report['passed']} passed, {report['failed']} failed, "
               f"trajectories_lost={report['trajectories_lost']}")
    if report["failed"]:
        raise typer.Exit(1)


@app.command("async-vs-sync")
def async_vs_sync(out: Path = typer.Option(RESULTS / "async_vs_sync.json", help="JSON report (a PNG goes beside it)."),
                  steps: int = typer.Option(20, help="Optimizer steps per mode (equal trained-trajectory budget)."),
                  prompts_per_step: int = typer.Option(8, help="Groups per optimizer step."),
                  group_size: int = typer.Option(4, help="Samples per prompt (GRPO group)."),
                  median_s: float = typer.Option(2.0, help="Episode duration: lognormal median (s)."),
                  sigma: float = typer.Option(1.0, help="Episode duration: lognormal shape (heavier tail when larger)."),
                  max_s: float = typer.Option(30.0, help="Episode duration cap (the episode time limit, s)."),
                  in_flight: int = typer.Option(96, help="Async: episodes running at once."),
                  max_staleness: int = typer.Option(4, help="Async: max version lag of a trained group."),
                  context_words: int = typer.Option(0, help="Per-task prompt words (longer trajectories, longer "
                                                            "trainer steps; engines reuse the shared prefix)."),
                  mode: list[str] = typer.Option(["sync", "async"], help="Modes to run (repeatable).")) -> None:
    """The same heavy-tailed workload through the real run loop in sync and async mode."""
    from bench.async_sync import Workload, run_async_vs_sync

    w = Workload(steps=steps, prompts_per_step=prompts_per_step, group_size=group_size, median_s=median_s,
                 sigma=sigma, max_s=max_s, in_flight=in_flight, max_staleness=max_staleness, context_words=context_words)
    r = run_async_vs_sync(out, w, modes=tuple(mode))
    typer.echo(f"wrote {out} (speedup = {r.get('speedup')}, trainer_idle_ratio_async = "
               f"{r.get('trainer_idle_ratio_async')}, staleness_p95 = {r.get('staleness_p95')})")


@app.command("partial")
def partial(out: Path = typer.Option(RESULTS / "partial_rollout.json", help="Where the JSON report goes."),
            steps: int = typer.Option(16, help="Optimizer steps per variant."),
            prompts_per_step: int = typer.Option(4, help="Groups per optimizer step."),
            group_size: int = typer.Option(4, help="Samples per prompt (GRPO group)."),
            median_turns: float = typer.Option(3.0, help="Turns per episode: lognormal median."),
            sigma: float = typer.Option(1.2, help="Turns per episode: lognormal shape (heavier tail when larger)."),
            max_turns: int = typer.Option(16, help="Turns per episode: cap."),
            tokens_per_turn: int = typer.Option(24, help="Tokens each turn generates (rollout.max_new_tokens)."),
            max_staleness: int = typer.Option(1, help="The staleness bound both variants train under."),
            in_flight: int = typer.Option(48, help="Episodes running at once (at most)."),
            sandbox: bool = typer.Option(False, help="Run one real sandbox command per turn."),
            partial_lead_steps: int = typer.Option(2, help="The *_lead variants' admission lead in steps "
                                                           "(rollout.partial_lead_steps)."),
            variant: list[str] = typer.Option(["off", "mask"], help="Variants: off, off_keep, mask, tis, mask_lead, tis_lead (repeatable)."),
            repeats: int = typer.Option(2, help="Interleaved rounds of the variants (the shared machine's load "
                                                "changes; each variant reports its mean).")) -> None:
    """Partial rollout off vs on: the same multi-turn workload through the real run loop, one after the other."""
    from bench.partial import PartialWorkload, run_partial_bench

    w = PartialWorkload(steps=steps, prompts_per_step=prompts_per_step, group_size=group_size,
                        median_turns=median_turns, sigma=sigma, max_turns=max_turns, tokens_per_turn=tokens_per_turn,
                        max_staleness=max_staleness, in_flight=in_flight, sandbox=sandbox,
                        partial_lead_steps=partial_lead_steps)
    r = run_partial_bench(out, w, variants=tuple(variant), repeats=repeats)
    typer.echo(f"wrote {out} (throughput_gain_mask = {r.get('throughput_gain_mask')}, "
               f"throughput_gain_tis = {r.get('throughput_gain_tis')})")


@app.command("weight-sync")
def weight_sync(out: Path = typer.Option(RESULTS / "weight_sync.json", help="Where the JSON report goes."),
                models: list[str] = typer.Option(["tiny", "smollm2-135m"], "--model", help="Models (repeatable)."),
                rounds: int = typer.Option(5, help="Full updates per model.")) -> None:
    """Time and GB/s of a full weight update into an embedded engine (safetensors tensor path)."""
    from bench.weight_sync import run_weight_sync_bench

    r = run_weight_sync_bench(out, tuple(models), rounds)
    typer.echo(f"wrote {out} " + ", ".join(f"{m}: {v['gbps_median']:.2f} GB/s" for m, v in r["models"].items()))


@app.command("buffer")
def buffer(out: Path = typer.Option(RESULTS / "buffer.json", help="Where the JSON report goes."),
           groups: int = typer.Option(64, help="Groups ingested."),
           tokens: int = typer.Option(2048, help="Tokens per trajectory."),
           directory: Path | None = typer.Option(None, "--dir", help="Folder (disk) for the log.")) -> None:
    """Replay buffer ingest / serve / recovery rates with fsync on and off."""
    from bench.buffer import run_buffer_bench

    r = run_buffer_bench(out, groups=groups, tokens=tokens, directory=directory)
    typer.echo(f"wrote {out} (durability_cost_x = {r['durability_cost_x']:.2f})")


@app.command("sandbox")
def sandbox(out: Path = typer.Option(RESULTS / "sandbox.json", help="Where the JSON report goes."),
            rounds: int = typer.Option(10, help="Sequential create/exec/delete cycles per backend."),
            concurrency: int = typer.Option(8, help="Sandboxes cycled at once."),
            backend: list[str] = typer.Option(["local", "daytona"], help="Backends (repeatable).")) -> None:
    """Create / exec / delete latency: local bubblewrap and Daytona (real SDK) against its stand-in."""
    from bench.sandbox import run_sandbox_bench

    run_sandbox_bench(out, rounds=rounds, concurrency=concurrency, backends=tuple(backend))
    typer.echo(f"wrote {out}")


@app.command("capacity")
def capacity(out: Path = typer.Option(RESULTS / "capacity.json", help="Where the JSON report goes."),
             config: str = typer.Option("glm5_2_tbench2", help="Recipe name or YAML path of the plan."),
             set_: list[str] = typer.Option([], "--set", help="Override a field: section.key=value (repeatable)."),
             measured: Path = typer.Option(RESULTS / "async_vs_sync.json", help="Local async-vs-sync run to validate "
                                                                              "the loop model against (skipped if absent)."),
             episode_median_s: float = typer.Option(300.0, help="Assumed median agentic episode duration (s)."),
             tokens_per_trajectory: int = typer.Option(24000, help="Assumed mean tokens per trajectory."),
             mfu: float = typer.Option(0.25, help="Assumed training MFU.")) -> None:
    """Per-GPU memory by role, step time, generation, weight sync and staleness of a plan, validated
    against the local runs and the reference's ~6.5 min per step."""
    from bench.capacity import Assumptions
    from bench.capacity_report import run_capacity

    a = Assumptions(episode_median_s=episode_median_s, tokens_per_trajectory=tokens_per_trajectory, mfu=mfu)
    try:
        r = run_capacity(out, config, list(set_), a, measured if measured.exists() else None)
    except ValueError as e:  # a config or plan the planner refuses, hardware the model has no numbers for
        typer.echo(f"error: {' '.join(str(e).split())}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {out} (trainer step {r['plan_estimate']['step']['trainer_step_s']:.0f} s, async step "
               f"{r['plan_estimate']['loop']['async']['step_s']:.0f} s vs reference {r['plan_estimate']['reference_step_s']:.0f} s)")


@app.command("learning")
def learning(run_dir: Path = typer.Argument(..., help="A finished run's directory (metrics.jsonl, checkpoints/)."),
             out: Path = typer.Option(RESULTS / "learning.json", help="Where the JSON report goes."),
             samples: int = typer.Option(16, min=1, help="Episodes per held-out task, before and after (raised "
                                          "so that each side of each split has at least 80)."),
             concurrency: int = typer.Option(16, min=1, help="Episodes run at once."),
             plot: Path | None = typer.Option(None, help="Also draw curves and before/after bars (PNG).")) -> None:
    """Held-out pass rates of the model before training vs the run's last checkpoint (many samples,
    the run's own settings) on held-out families and held-out instances, with significance tests."""
    from bench.learning import SPLIT_FIELDS, run_learning_report

    try:
        r = run_learning_report(run_dir, out, samples, concurrency, plot=plot)
    except FileNotFoundError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    for f in [f for f in SPLIT_FIELDS.values() if f"{f}_before" in r]:
        typer.echo(f"{f}: {r[f + '_before']} -> {r[f + '_after']} on {r[f + '_samples']} samples each "
                   f"(one-sided p = {r[f + '_p_value_one_sided']})")
    typer.echo(f"wrote {out}")


@app.command("megatron")
def megatron(out: Path | None = typer.Option(None, help="Where the JSON report goes (default: bench/results/megatron.json; "
                                                 "with --small runs/bench/megatron_small.json, so that a smoke run "
                                                 "never replaces the recorded GPU report)."),
             small: bool = typer.Option(False, help="CPU smoke sizes (gloo, no 5-layer model, 30 MiB export)."),
             export_gib: float = typer.Option(8.0, help="Bytes of GLM-shaped weights to broadcast (GiB)."),
             bucket_mb: int = typer.Option(256, help="Weight-sync bucket size (MiB).")) -> None:
    """Megatron backend: loss parity with the torch backend, EP2 on two devices, weight broadcast GB/s
    against raw NCCL, FP8 quantisation time (runs bench/gpu/megatron_gpu.py all; 2 GPUs for real numbers)."""
    import shutil
    import subprocess
    import sys
    import tempfile

    if out is None:
        out = Path("runs/bench/megatron_small.json") if small else RESULTS / "megatron.json"
    script = Path(__file__).resolve().parent / "gpu" / "megatron_gpu.py"
    with tempfile.TemporaryDirectory(prefix="agentrl-megatron-bench-") as tmp:
        cmd = [sys.executable, str(script), "all", "--out-dir", tmp, "--export-gib", str(export_gib),
               "--bucket-mb", str(bucket_mb), *(["--small"] if small else [])]
        rc = subprocess.run(cmd, check=False).returncode
        produced = Path(tmp) / "megatron.json"
        if produced.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(produced, out)
            typer.echo(f"wrote {out}")
    raise typer.Exit(rc)
