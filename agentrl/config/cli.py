"""`agentrl config`: show a recipe resolved with overrides, list recipes."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("show")
def show(
    recipe: str = typer.Option("local", "--config", "-c", help="Recipe name (configs/NAME.yaml) or YAML path."),
    overrides: list[str] = typer.Option([], "--set", "-s", help="Override a field: section.key=value (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan and resolved config as one JSON object."),
) -> None:
    """Resolve a recipe plus overrides and print the plan (nothing is started)."""
    from agentrl.config.front import FrontDoorError, error_line, resolve_run
    from agentrl.config.show import show_plan

    try:
        cfg, plan = resolve_run(config=recipe, overrides=overrides, check_runnable=False)
    except FrontDoorError as e:
        typer.echo(error_line(e), err=True)
        raise typer.Exit(2) from None
    refusal = show_plan(cfg, plan, as_json)
    if refusal:
        typer.echo(error_line(f"this plan cannot run: {refusal}"), err=True)
        raise typer.Exit(2)


@app.command("recipes")
def recipes() -> None:
    """List the recipes shipped in configs/."""
    from agentrl.config.loader import RECIPES_DIR, list_recipes

    for name in list_recipes():
        first = (Path(RECIPES_DIR) / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ")
        typer.echo(f"{name:24s} {first}")
