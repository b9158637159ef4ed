"""`agentrl harbor ...`: agentrl beside Harbor. Only typer at module level; each command imports
what it needs (the optional `harbor` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="Harbor (the terminal-bench harness) beside agentrl: ATIF export, "
                                             "oracle/nop parity. Needs the harbor extra.")


@app.command("atif")
def atif(
    run_dir: Annotated[Path, typer.Argument(help="An agentrl run dir (logging.run_dir) with transcripts/.")],
    out: Annotated[Path, typer.Option(help="A folder of Harbor jobs: `harbor view OUT` opens it.")] = Path("jobs"),
    job_name: Annotated[str | None, typer.Option(help="Job folder name; default agentrl-<run dir name>.")] = None,
) -> None:
    """Write the run's transcripts as ATIF trajectories in a Harbor job folder (agentrl/harbor/viewer_job.py)."""
    try:
        from agentrl.harbor.viewer_job import export_run
    except ImportError as err:
        typer.echo(f"error: {err}; install the harbor extra (pip install harbor==0.26.0)", err=True)
        raise typer.Exit(2) from None
    try:
        job_dir, n = export_run(run_dir, out, job_name=job_name)
    except (FileNotFoundError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {n} trajectories to {job_dir}; open them with: harbor view {out}")


@app.command("parity")
def parity(
    out: Annotated[Path, typer.Option(help="Where the JSON summary goes.")] = Path("bench/results/harbor_oracle.json"),
    tasks: Annotated[Path | None, typer.Option(help="A folder of tasks; default the fixtures.")] = None,
    concurrent: Annotated[int, typer.Option(min=1, help="Trials at once.")] = 2,
) -> None:
    """Harbor's oracle and nop agents on the tasks in agentrl's local sandbox vs agentrl's expectations."""
    import json
    import tempfile

    from agentrl.config.front import unwritable_folder
    from agentrl.harbor.parity import expectations, oracle_and_nop
    from envs.tbench2.loader import DEFAULT_TASKS_DIR

    tasks_dir = tasks or DEFAULT_TASKS_DIR
    try:  # before Harbor's jobs run (minutes): no tasks, or nowhere to write the summary, is one line now
        loadable = expectations(tasks_dir)[0]["oracle"]
    except FileNotFoundError:
        _fail(f"--tasks {tasks_dir}: not a folder of task folders")
    if not loadable:
        _fail(f"--tasks {tasks_dir}: no task folder in it loads (`agentrl tasks check {tasks_dir}` says why)")
    if why := unwritable_folder(out.parent):
        _fail(f"--out {out}: {why}")
    report = oracle_and_nop(tasks_dir, Path(tempfile.mkdtemp(prefix="harbor-parity-")), n_concurrent=concurrent)
    out.write_text(json.dumps(report, indent=1) + "\n")
    typer.echo(f"{'ok' if report['ok'] else 'MISMATCH'}: {len(report['mismatches'])} mismatch(es); wrote {out}")
    raise typer.Exit(0 if report["ok"] else 1)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
