"""The TB2 loader reads Harbor's current task schema or refuses a field by name.

Every snippet here is a valid Harbor task (checked with Harbor's own TaskConfig when the optional
`harbor` extra is installed), so a refusal is agentrl's, never a typo in the test.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from envs.tbench2.loader import DEFAULT_TASKS_DIR, TaskFormatError, load_task

BASE = """\
schema_version = "1.4"
{top}
[task]
name = "agentrl/t"

[verifier]
timeout_sec = 30.0
{verifier}
[agent]
timeout_sec = 60.0
{agent}
[environment]
cpus = 1
memory_mb = 1024
network_mode = "no-network"
{environment}
"""


try:
    from harbor.models.task.config import TaskConfig as HarborTaskConfig
except ImportError:  # the optional extra is not installed: agentrl's side is still tested
    HarborTaskConfig = None


def task(tmp_path: Path, *, top: str = "", verifier: str = "", agent: str = "", environment: str = "",
         tail: str = "", network: str = "no-network") -> Path:
    d = tmp_path / "t"
    shutil.copytree(DEFAULT_TASKS_DIR / "write-name", d)
    text = BASE.format(top=top, verifier=verifier, agent=agent, environment=environment) + tail
    text = text.replace('network_mode = "no-network"', f'network_mode = "{network}"')
    (d / "task.toml").write_text(text)
    if HarborTaskConfig is not None:
        HarborTaskConfig.model_validate_toml(text)  # a real Harbor task
    return d


def test_separate_verifier_with_artifacts_maps_onto_the_fresh_sandbox(tmp_path):
    t = load_task(task(tmp_path, top='artifacts = ["/app/name.txt", {source = "/app/out", destination = "o"}]',
                       verifier='environment_mode = "separate"'))
    assert (t.verifier_sandbox, t.verifier_outputs) == ("fresh", ["/app/name.txt", "/app/out"])
    assert (t.allow_internet, t.verifier_timeout_s, t.agent_timeout_s, t.memory_mb) == (False, 30.0, 60.0, 1024)


def test_a_verifier_environment_equal_to_the_tasks_implies_separate(tmp_path):
    t = load_task(task(tmp_path, tail='\n[verifier.environment]\ncpus = 1\nnetwork_mode = "no-network"\n'))
    assert t.verifier_sandbox == "fresh"


def test_harbor_defaults_and_shared_mode(tmp_path):
    d = task(tmp_path, verifier='environment_mode = "shared"', agent='user = "root"',
             environment='workdir = "/app"')
    (d / "task.toml").write_text((d / "task.toml").read_text().replace("timeout_sec = 30.0\n", ""))
    t = load_task(d)
    assert (t.verifier_sandbox, t.verifier_timeout_s, t.workdir) == ("same", 600.0, "/app")


def test_network_mode_wins_over_allow_internet(tmp_path):
    d = task(tmp_path, environment="allow_internet = true")
    assert load_task(d).allow_internet is False  # network_mode = "no-network", as Harbor resolves it


def test_canary_lines_are_not_part_of_the_instruction(tmp_path):
    d = task(tmp_path)
    (d / "instruction.md").write_text("<!-- BENCHMARK DATA canary GUID 1234 -->\n\nWrite the file.\n")
    assert load_task(d).instruction == "Write the file."


@pytest.mark.parametrize(
    ("parts", "named"),
    [
        ({"tail": '\n[[steps]]\nname = "one"\n'}, "[[steps]]"),
        ({"tail": '\n[[verifier.collect]]\ncommand = "true"\n'}, "[[verifier.collect]]"),
        ({"agent": 'user = "agent"'}, "[agent].user"),
        ({"verifier": "user = 1000"}, "[verifier].user"),
        ({"environment": 'allowed_hosts = ["pypi.org"]', "network": "allowlist"}, "[environment].allowed_hosts"),
        ({"agent": 'network_mode = "public"'}, "[agent].network_mode"),
        ({"environment": 'workdir = "/srv"'}, "[environment].workdir"),
        ({"environment": 'os = "windows"'}, "[environment].os"),
        ({"tail": '\n[environment.healthcheck]\ncommand = "true"\n'}, "[environment].healthcheck"),
        ({"tail": '\n[solution.env]\nTOKEN = "x"\n'}, "[solution].env"),
        ({"tail": "\n[verifier.environment]\ncpus = 2\n"}, "[verifier.environment].cpus"),
        ({"top": 'artifacts = [{source = "/app/out", exclude = ["*.log"]}]'}, "artifacts[0].exclude"),
        ({"top": 'artifacts = ["/logs/verifier/x"]', "verifier": 'environment_mode = "separate"'}, "artifacts"),
        ({"verifier": 'environment_mode = "separate"\nsandbox = "same"'}, "[verifier].sandbox"),
    ],
)
def test_unsupported_harbor_fields_are_refused_by_name(tmp_path, parts, named):
    d = task(tmp_path, **parts)
    with pytest.raises(TaskFormatError) as err:
        load_task(d)
    message = str(err.value)
    assert named in message and "\n" not in message, message


def test_a_verifier_image_in_tests_is_refused(tmp_path):
    d = task(tmp_path, verifier='environment_mode = "separate"')
    (d / "tests" / "Dockerfile").write_text("FROM ubuntu:24.04\n")
    with pytest.raises(TaskFormatError, match=r"\[verifier\].environment_mode: tests/ holds a verifier image"):
        load_task(d)
