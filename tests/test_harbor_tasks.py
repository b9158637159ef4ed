"""agentrl and Harbor read every fixture task the same way, and Harbor's linter accepts them.

Runs only with the optional `harbor` extra (Harbor's own task model and linter are the reference).
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("harbor", reason="the optional harbor extra is not installed")

from harbor.lint.models import DEFAULT_RULES
from harbor.lint.task import lint_task
from harbor.models.task.config import NetworkMode
from harbor.models.task.task import Task
from harbor.models.task.verifier_mode import resolve_task_verifier_mode
from pydantic import ValidationError

from envs.tbench2.generate.build import generate_tasks
from envs.tbench2.generate.registry import all_families
from envs.tbench2.loader import (
    DEFAULT_TASKS_DIR,
    TaskFormatError,
    expected_error,
    list_task_dirs,
    load_task,
)

# The findings `harbor lint` (its default rules) keeps on the fixtures, each explained in the README ("With Harbor"):
# tests of the same-sandbox defences, and deletions that agentrl's carried outputs cannot express.
EXPLAINED_LINT = {
    ("write-name", "shared-verifier"),
    ("planted-reward", "shared-verifier"),
    ("delete-log", "shared-verifier"),
    ("delete-tmp", "shared-verifier"),
    ("rename-logs", "shared-verifier"),
    ("malformed-toml", "invalid-task-config"),
}
FIXTURES = [d for d in list_task_dirs(DEFAULT_TASKS_DIR) if expected_error(d) is None]


def harbor_task(d) -> Task:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # allow_internet, memory = "2G": older schemas
        return Task(d)


@pytest.mark.parametrize("d", FIXTURES, ids=lambda d: d.name)
def test_both_read_the_same_task(d):
    ours, theirs = load_task(d), harbor_task(d)
    cfg = theirs.config
    assert theirs.instruction.strip() == ours.instruction
    assert theirs.name in (ours.name, f"agentrl/{ours.name}")
    assert cfg.agent.timeout_sec == ours.agent_timeout_s
    assert cfg.verifier.timeout_sec == ours.verifier_timeout_s
    assert cfg.environment.build_timeout_sec == ours.build_timeout_s
    env = cfg.environment
    for harbor_value, our_value in [(env.cpus, ours.cpus), (env.memory_mb, ours.memory_mb),
                                    (env.storage_mb, ours.storage_mb), (env.gpus, ours.gpus)]:
        assert harbor_value is None or harbor_value == our_value
    assert env.docker_image == ours.docker_image
    assert (env.network_mode == NetworkMode.PUBLIC) == ours.allow_internet
    assert env.env == ours.environment_env and cfg.verifier.env == ours.verifier_env
    mode = resolve_task_verifier_mode(cfg).value
    assert {"shared": "same", "separate": "fresh"}[mode] == ours.verifier_sandbox
    sources = [a if isinstance(a, str) else a.source for a in cfg.artifacts]
    assert sources == ours.verifier_outputs
    for key in ("difficulty", "category", "tags"):
        assert cfg.metadata.get(key) == getattr(ours, key) or (key == "tags" and not ours.tags)


def test_the_malformed_fixture_is_refused_by_both_for_the_same_field():
    (d,) = [d for d in list_task_dirs(DEFAULT_TASKS_DIR) if expected_error(d) is not None]
    with pytest.raises(TaskFormatError, match=r"\[verifier\]\.timeout_sec"):
        load_task(d)
    with pytest.raises(ValidationError, match="verifier.timeout_sec"):
        harbor_task(d)


def test_harbor_lint_on_the_fixtures_finds_only_the_explained():
    found = {(d.name, f.rule.value) for d in list_task_dirs(DEFAULT_TASKS_DIR) for f in lint_task(d, selected_rules=DEFAULT_RULES)}
    assert found == EXPLAINED_LINT


def test_harbor_lint_on_generated_tasks_finds_only_the_shared_verifier(tmp_path):
    """One instance of every family: generated checks read the whole of /app (absent files,
    links, modes), which a separate verifier would only see through carried outputs."""
    out = tmp_path / "generated"
    generate_tasks(out, None, 1, 0)
    dirs = list_task_dirs(out)
    assert len(dirs) == len(all_families())
    found = {f.rule.value for d in dirs for f in lint_task(d, selected_rules=DEFAULT_RULES)}
    assert found == {"shared-verifier"}
    assert harbor_task(dirs[0]).name == f"agentrl/{dirs[0].name}"


def test_parity_refuses_what_it_cannot_run_or_write_before_any_job(tmp_path):
    from typer.testing import CliRunner

    from agentrl.cli import app

    (tmp_path / "a_file").write_text("x")
    (tmp_path / "broken" / "t").mkdir(parents=True)  # a folder whose only task has no files
    (tmp_path / "broken" / "t" / "task.toml").write_text("[[[")
    cases = {("--tasks", str(tmp_path / "nope")): "not a folder of task folders",
             ("--tasks", str(tmp_path / "broken")): "no task folder in it loads",
             ("--out", str(tmp_path / "a_file" / "r.json")): "cannot write there"}
    for args, message in cases.items():
        result = CliRunner().invoke(app, ["harbor", "parity", *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)
        assert not list(tmp_path.glob("**/r.json"))
