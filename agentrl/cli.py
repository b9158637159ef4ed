"""The `agentrl` command. Each area of the library registers one Typer sub-app here; sub-app modules
import only typer at module level and import heavy libraries inside their commands.

Sub-apps that are not part of the library (the benchmarks, bench/ in the repository) are found
through entry points of group `agentrl.commands` (NAME = "module:typer_app"), so agentrl imports
none of them by name. One that is missing or cannot be loaded still answers `agentrl NAME` with a
one-line error saying how to get it.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

import typer

COMMANDS_GROUP = "agentrl.commands"
# Entry-point commands a full checkout provides, and how to get each when it is not there.
EXPECTED_COMMANDS = {
    "bench": "the benchmarks are the bench/ package of the agentrl repository: install the checkout "
             "with `pip install -e .` (or `make setup`)",
}

app = typer.Typer(
    name="agentrl",
    help="Ray-native, fully-asynchronous RL for agentic LLMs.",
    no_args_is_help=True,
    add_completion=False,
)


def _register() -> None:
    from agentrl.config.cli import app as config_app
    from agentrl.envs.tasks_cli import app as tasks_app
    from agentrl.eval_cli import eval_command
    from agentrl.models.cli import app as models_app
    from agentrl.rollout.engine_cli import app as engine_app
    from agentrl.view.cli import view

    app.add_typer(config_app, name="config", help="Show and check run configs.")
    app.add_typer(models_app, name="models")
    app.add_typer(tasks_app, name="tasks", help="Check task folders end to end.")
    app.add_typer(engine_app, name="engine")
    app.command("view")(view)
    app.command("eval")(eval_command)
    add_entry_point_commands(app)


def add_entry_point_commands(target: typer.Typer, found: list[EntryPoint] | None = None) -> None:
    """Add the sub-apps of group `agentrl.commands` (or `found`) to `target`; a missing or broken
    one becomes a command that prints why and how to get it, and exits 1."""
    eps = {ep.name: ep for ep in (entry_points(group=COMMANDS_GROUP) if found is None else found)}
    for name in sorted(set(eps) | set(EXPECTED_COMMANDS)):
        how = EXPECTED_COMMANDS.get(name, f"reinstall the package that declares entry point {name!r}")
        ep = eps.get(name)
        if ep is None:
            missing = f"no {COMMANDS_GROUP!r} entry point named {name!r} is installed"
            _add_unavailable(target, name, f"{missing}; {how}")
            continue
        try:
            sub = ep.load()
        except Exception as err:  # noqa: BLE001 - any import error of a plugin: say which and how to get it
            cause = " ".join(f"{type(err).__name__}: {err}".split())  # one line, whatever the message
            _add_unavailable(target, name, f"cannot load {ep.value!r} ({cause}); {how}")
            continue
        target.add_typer(sub, name=name)


def _add_unavailable(target: typer.Typer, name: str, why: str) -> None:
    def unavailable() -> None:
        typer.echo(f"error: agentrl {name}: {why}", err=True)
        raise typer.Exit(1)

    target.command(name, help=f"(not available: {why})", add_help_option=False,
                   context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(unavailable)


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
