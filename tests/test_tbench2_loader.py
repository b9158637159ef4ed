"""terminal-bench-2 task loading (both task.toml schemas), reward parsing, fixture splits."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from envs.tbench2.loader import (
    DEFAULT_TASKS_DIR,
    TaskFormatError,
    expected_error,
    list_task_dirs,
    load_splits,
    load_task,
)
from envs.tbench2.scorer import parse_reward_json, parse_reward_txt

LEGACY = """version = "1.0"
[metadata]
difficulty = "hard"
category = "ops"
tags = ["a", "b"]
[verifier]
timeout_sec = 120.0
[agent]
timeout_sec = 1800
[environment]
docker_image = "ghcr.io/example/task:1"
cpus = 2
memory = "{memory}"
storage = "20G"
"""

NEW = """schema_version = "1.1"
[task]
name = "t"
description = "a task"
[metadata]
difficulty = "easy"
[verifier]
timeout_sec = 30
[verifier.env]
MODE = "strict"
[agent]
timeout_sec = 60
[environment]
build_timeout_sec = 900
docker_image = "img:latest"
cpus = 1
memory_mb = 4096
storage_mb = 8192
gpus = 0
allow_internet = false
[environment.env]
DEBUG = 1
"""


def make_task(
    root: Path, toml: str, *, dockerfile: str = "FROM x\nWORKDIR /work\nENV A=1\n", name: str = "t"
) -> Path:
    d = root / name
    for sub in ("environment", "solution", "tests"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "instruction.md").write_text("Do the thing.\n")
    (d / "task.toml").write_text(toml)
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    (d / "solution" / "solve.sh").write_text("true\n")
    (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    return d


def test_legacy_schema(tmp_path):
    t = load_task(make_task(tmp_path, LEGACY.format(memory="2G")))
    assert t.schema_version == "1.0"
    assert (t.memory_mb, t.storage_mb, t.cpus) == (2048, 20480, 2.0)
    assert (t.agent_timeout_s, t.verifier_timeout_s) == (1800.0, 120.0)
    assert t.docker_image == "ghcr.io/example/task:1" and t.tags == ["a", "b"] and t.difficulty == "hard"
    assert t.allow_internet is True  # legacy tasks had network by default
    assert t.workdir == "/work" and t.unsupported_locally == ["line 1: FROM x"]
    spec = t.sandbox_spec(labels={"episode": "e1"})
    assert spec.image == "ghcr.io/example/task:1" and spec.memory_mb == 2048 and spec.disk_mb == 20480
    assert spec.workdir == "/work" and spec.labels == {"task": "t", "episode": "e1"}
    assert spec.files_dir == str(t.path / "environment")


@pytest.mark.parametrize(
    ("memory", "mb"), [("512M", 512), ("1.5G", 1536), ("2Gi", 2048), ("4GB", 4096), ("1024", 1024)]
)
def test_legacy_sizes(tmp_path, memory, mb):
    assert load_task(make_task(tmp_path, LEGACY.format(memory=memory))).memory_mb == mb


def test_new_schema(tmp_path):
    t = load_task(make_task(tmp_path, NEW))
    assert t.schema_version == "1.1" and t.description == "a task"
    assert (t.memory_mb, t.storage_mb, t.build_timeout_s) == (4096, 8192, 900.0)
    assert (
        t.allow_internet is False
        and t.verifier_env == {"MODE": "strict"}
        and t.environment_env == {"DEBUG": "1"}
    )
    assert t.sandbox_spec().env == {"DEBUG": "1"} and t.sandbox_spec().allow_network is False
    assert t.expected_status == "scored" and t.expected_reward == 1.0 and not t.adversarial


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("version = \n", "task.toml: not valid TOML"),
        (NEW.replace("timeout_sec = 30", 'timeout_sec = "soon"'), "[verifier].timeout_sec"),
        (NEW.replace("memory_mb = 4096", "memory_mb = -1"), "[environment].memory_mb"),
        (LEGACY.format(memory="2Q"), "[environment].memory"),
        (NEW.replace("allow_internet = false", 'allow_internet = "no"'), "[environment].allow_internet"),
        (NEW.replace('schema_version = "1.1"', 'schema_version = "2.0"'), "schema_version"),
        (NEW.replace('schema_version = "1.1"\n', ""), 'version = "1.0"'),
        (NEW.replace('difficulty = "easy"', "difficulty = 3"), "[metadata].difficulty"),
        (NEW.replace("DEBUG = 1", "DEBUG = [1]"), "[environment.env]"),
    ],
)
def test_errors_name_file_and_field(tmp_path, toml, needle):
    with pytest.raises(TaskFormatError) as err:
        load_task(make_task(tmp_path, toml))
    assert needle in str(err.value) and "task t:" in str(err.value)


def test_missing_files_and_bad_dockerfile(tmp_path):
    d = make_task(tmp_path, NEW)
    (d / "tests" / "test.sh").unlink()
    with pytest.raises(TaskFormatError, match="tests/test.sh: missing"):
        load_task(d)
    d = make_task(tmp_path, NEW, dockerfile="FROM x\nENV =1\n", name="bad-docker")
    with pytest.raises(TaskFormatError, match=r"environment/Dockerfile.*Dockerfile:2"):
        load_task(d)
    d = make_task(tmp_path, NEW, name="empty-instruction")
    (d / "instruction.md").write_text("  \n")
    with pytest.raises(TaskFormatError, match="instruction.md: is empty"):
        load_task(d)
    d = make_task(tmp_path, NEW, name="no-solution")
    shutil.rmtree(d / "solution")
    assert load_task(d).solution_path is None  # optional for training; `tasks check` rejects it


def test_fixtures_load_with_both_schemas():
    dirs = list_task_dirs(DEFAULT_TASKS_DIR)
    assert len(dirs) >= 12
    loaded, invalid = [], []
    for d in dirs:
        try:
            loaded.append(load_task(d))
        except TaskFormatError as err:
            invalid.append((d, err))
    assert {t.schema_version for t in loaded} == {"1.0", "1.1"}
    assert [d.name for d, _ in invalid] == ["malformed-toml"]
    d, err = invalid[0]
    assert expected_error(d) in str(err)
    for t in loaded:
        assert t.workdir == "/app" and t.solution_path is not None and t.instruction
    adversarial = {t.name: (t.expected_status, t.expected_reward) for t in loaded if t.adversarial}
    assert adversarial == {
        "verifier-hangs": ("infra_error:verifier_timeout", None),
        "planted-reward": ("scored", 0.0),
        "missing-reward": ("infra_error:verifier", None),
        "nan-reward": ("infra_error:verifier", None),
    }


def test_splits_are_disjoint_easy_tasks():
    splits = load_splits(DEFAULT_TASKS_DIR)
    train, held_out = set(splits["train"]), set(splits["eval"])
    assert train and held_out and not train & held_out
    for name in train | held_out:
        t = load_task(DEFAULT_TASKS_DIR / name)
        assert t.difficulty == "easy" and not t.adversarial and t.category != "adversarial"


@pytest.mark.parametrize(
    ("text", "reward"),
    [('{"reward": 0.5, "other": 1}', 0.5), ('{"a": 1, "b": 0}', 0.5), ('{"x": 2}', 2.0)],
)
def test_reward_json(text, reward):
    assert parse_reward_json(text) == reward


@pytest.mark.parametrize(
    "text", ["", "{}", "[1]", '{"reward": NaN}', '{"reward": true}', '{"reward": "1"}', "nope"]
)
def test_reward_json_rejects(text):
    with pytest.raises(ValueError):
        parse_reward_json(text)


def test_reward_txt():
    assert parse_reward_txt(" 1\n") == 1.0 and parse_reward_txt("0.25") == 0.25
    for bad in ("", "  \n", "nan", "inf", "one", "1 2"):
        with pytest.raises(ValueError):
            parse_reward_txt(bad)
    assert not math.isnan(parse_reward_txt("-0"))
