"""The front door: every command that takes a run config (the launcher's subcommands, `agentrl
config show`, `agentrl eval`) resolves it here, and prints its errors through `error_line`, which
redacts secrets. So `--config`, `--set`, the launcher's shortcuts and the resolved plan mean the
same thing everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentrl.config.loader import ConfigError, load_config
from agentrl.config.plan import PlanError, RunPlan, resolve_plan
from agentrl.config.schema import RunConfig

# Which recipe a model name starts from when --config is not given.
DEFAULT_RECIPE = {
    "GLM-5.2": "glm5_2_tbench2",
    "GLM-5.2_5layer": "glm5_2_5layer_1node",
    "tiny": "local",
    "smollm2-135m": "local_smollm2",
    "gemma3-270m": "local_smollm2",  # the same small-model CPU recipe (scripts/install_gemma3.sh first)
}
DEFAULT_MODEL = "GLM-5.2"


class FrontDoorError(ValueError):
    """A config or plan that cannot run; the message names the field and the fix."""


def resolve_run(*, config: str | Path | None = None, model_name: str | None = None, num_nodes: int | None = None,
                gpus_per_node: int | None = None, hardware: str | None = None, overrides: list[str] | None = None,
                sandbox: str | None = None, run_dir: Path | None = None,
                check_runnable: bool = True) -> tuple[RunConfig, RunPlan]:
    """Recipe (by --config, else the model's default) -> shortcut options -> --set overrides -> plan.
    `model_name` overrides the recipe's model only when given."""
    if config is None:
        model_name = model_name or DEFAULT_MODEL
        if model_name not in DEFAULT_RECIPE:
            raise FrontDoorError(f"--model-name {model_name!r} is not a known model; use one of "
                                 f"{', '.join(DEFAULT_RECIPE)} or pass --config with a recipe")
        config = DEFAULT_RECIPE[model_name]
    extra: dict[str, Any] = {}
    if model_name is not None:
        extra["model"] = {"name": model_name}
    cluster: dict[str, Any] = {}
    if num_nodes is not None:
        cluster["num_nodes"] = num_nodes
        if num_nodes == 1:
            cluster["train_nodes"] = None
    if gpus_per_node is not None:
        cluster["gpus_per_node"] = gpus_per_node
    if hardware is not None:
        cluster["hardware"] = hardware
    if cluster:
        extra["cluster"] = cluster
    if sandbox is not None:
        extra["sandbox"] = {"backend": sandbox}
    if run_dir is not None:
        extra["logging"] = {"run_dir": str(run_dir)}
    try:
        cfg = load_config(config, overrides or [], extra)
        if num_nodes is not None and num_nodes > 1 and cfg.cluster.train_nodes is not None \
                and cfg.cluster.train_nodes >= num_nodes:
            cfg.cluster.train_nodes = num_nodes // 2
        return cfg, resolve_plan(cfg, check_runnable=check_runnable)
    except (ConfigError, PlanError, ValueError) as e:
        raise FrontDoorError(str(e)) from None


def error_line(err: BaseException | str) -> str:
    """`error: ...` with every secret value of the environment masked."""
    from agentrl.secrets import redact

    return f"error: {redact(str(err))}"


def unwritable_folder(folder: Path) -> str | None:
    """Why `folder` cannot hold a command's output (made if missing), or None when it can: checked
    before the work, so that a report or a run that cannot be written never costs the work first."""
    import tempfile

    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        return f"cannot write there ({err.strerror or err})"
    return None
