"""`agentrl view RUN_DIR [--out FILE]`: write the run's HTML report and print its path.
Only typer and the standard library at module level."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def view(
    run_dir: Annotated[Path, typer.Argument(help="The run dir (logging.run_dir of the run).")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Where to write the page; default RUN_DIR/report.html.")
    ] = None,
    max_episodes: Annotated[int, typer.Option(min=1, help="Newest episodes listed with transcripts.")] = 300,
) -> None:
    """Render a static HTML report (config, curves, steps, episodes, staleness swimlane)."""
    from agentrl.view.report import write_report

    try:
        path = write_report(run_dir, out, max_episodes=max_episodes)
    except (FileNotFoundError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(path))
