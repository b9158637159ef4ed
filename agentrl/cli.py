"""The `agentrl` command. Each area registers one Typer sub-app here; sub-app modules import
only typer at module level and import heavy libraries inside their commands."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="agentrl",
    help="Ray-native, fully-asynchronous RL for agentic LLMs.",
    no_args_is_help=True,
    add_completion=False,
)


def _register() -> None:
    from agentrl.config.cli import app as config_app

    app.add_typer(config_app, name="config", help="Show and check run configs.")
    # Sub-apps of other areas are added below, one line each.
    from agentrl.models.cli import app as models_app; app.add_typer(models_app, name="models")  # noqa: E702
    from agentrl.envs.tasks_cli import app as tasks_app; app.add_typer(tasks_app, name="tasks", help="Check task folders end to end.")  # noqa: E702, E501
    from agentrl.rollout.engine_cli import app as engine_app; app.add_typer(engine_app, name="engine")  # noqa: E702
    from agentrl.view.cli import view; app.command("view")(view)  # noqa: E702
    from agentrl.eval_cli import eval_command; app.command("eval")(eval_command)  # noqa: E702
    from agentrl.bench.cli import app as bench_app; app.add_typer(bench_app, name="bench", help="Benchmarks writing bench/results/*.json.")  # noqa: E702, E501


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
