"""`agentrl bench ...`: every benchmark writes JSON under bench/results/ with machine and versions."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)
RESULTS = Path("bench/results")


@app.command("engine")
def engine(out: Path = typer.Option(RESULTS / "engine.json", help="Where the JSON report goes."),
           models: list[str] = typer.Option(["tiny", "smollm2-135m"], "--model", help="Models (repeatable)."),
           concurrency: list[int] = typer.Option([1, 8, 32], help="Concurrent requests (repeatable)."),
           new_tokens: int = typer.Option(64, help="Tokens generated per request."),
           torch_threads: int = typer.Option(1, help="torch threads of the engine; 1 is steadiest on a small "
                                                     "shared CPU machine (2 threads ran ~8x slower under load).")) -> None:
    """Embedded engine throughput at several concurrencies, and the client's per-request overhead."""
    from agentrl.bench.engine import run_engine_bench

    report = run_engine_bench(out, tuple(models), tuple(concurrency), new_tokens=new_tokens,
                              torch_threads=torch_threads)
    typer.echo(f"wrote {out} (batching_speedup_32 = {report.get('batching_speedup_32')})")


@app.command("kernels")
def kernels(out: Path = typer.Option(RESULTS / "kernels.json", help="Where the JSON report goes."),
            only: list[str] = typer.Option([], help="Kernel families to run (default: all).")) -> None:
    """Triton kernels at GLM-5.2 dimensions (needs a CUDA GPU for meaningful numbers)."""
    from agentrl.bench.kernels import run_kernel_bench

    run_kernel_bench(out, only=set(only) or None)
    typer.echo(f"wrote {out}")


@app.command("offload")
def offload(out: Path = typer.Option(RESULTS / "offload.json", help="Where the JSON report goes."),
            state_gb: float = typer.Option(0.3, help="Optimizer state size to stream (GB)."),
            directory: Path | None = typer.Option(None, "--dir", help="Node-local folder to stream through."),
            bucket_mb: int = typer.Option(64, help="Bucket size (MB of optimizer state).")) -> None:
    """Disk-offloaded Adam: streaming rate against the disk's measured bandwidth, and step-time
    overhead against in-memory AdamW."""
    from agentrl.bench.offload import run_offload_bench

    report = run_offload_bench(out, state_gb, directory=directory, bucket_mb=bucket_mb)
    typer.echo(f"wrote {out} (offload_stream_efficiency = {report.get('offload_stream_efficiency')})")


@app.command("faults")
def faults(out: Path = typer.Option(RESULTS / "faults.json", help="Where the JSON report goes."),
           only: list[str] = typer.Option([], help="Scenarios to run (repeatable; default: all)."),
           fast: bool = typer.Option(False, help="Skip the scenarios that need full local training runs.")) -> None:
    """Fault injection into real local components; exit code 1 when any scenario fails."""
    from agentrl.bench.faults import run_faults

    try:
        report = run_faults(out, only=only or None, include_slow=not fast, echo=typer.echo)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {out}: {report['passed']} passed, {report['failed']} failed, "
               f"trajectories_lost={report['trajectories_lost']}")
    if report["failed"]:
        raise typer.Exit(1)
