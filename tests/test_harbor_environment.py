"""The Harbor environment backed by agentrl's local sandbox, driven the way Harbor drives one, and
(slow) Harbor's own trial runner with its oracle and nop agents on every fixture task."""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("harbor", reason="the optional harbor extra is not installed")
if shutil.which("bwrap") is None:
    pytest.skip("the local sandbox needs bubblewrap", allow_module_level=True)

from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths
from harbor.verifier.verifier import Verifier

from agentrl.harbor.environment import TIMEOUT_EXIT_CODE, LocalSandboxEnvironment
from agentrl.harbor.jobs import trial_outcome
from envs.tbench2.loader import DEFAULT_TASKS_DIR

# Harbor warns when it reads the fixtures' older schemas (memory = "2G", allow_internet).
pytestmark = pytest.mark.filterwarnings("ignore:The '.*' field is deprecated:DeprecationWarning")


def make_env(tmp_path, task: str = "make-executable", **kw) -> LocalSandboxEnvironment:
    t = Task(DEFAULT_TASKS_DIR / task)
    paths = TrialPaths(tmp_path / "trial")
    paths.mkdir()
    return LocalSandboxEnvironment(environment_dir=t.paths.environment_dir, environment_name=task,
                                   session_id=f"{task}__test__env", trial_paths=paths,
                                   task_env_config=t.config.environment.model_copy(deep=True),
                                   root_dir=str(tmp_path / "boxes"), **kw)


async def test_exec_files_and_users_as_harbor_uses_them(tmp_path):
    env = make_env(tmp_path, persistent_env={"FROM_JOB": "job"})
    await env.start(force_build=False)
    try:
        r = await env.exec("pwd; cat run.sh; echo $FROM_JOB $ONE; ls -d /logs/agent /logs/verifier /logs/artifacts",
                           env={"ONE": "1"})
        assert r.return_code == 0 and r.stdout.split("\n")[0] == "/app"  # the Dockerfile's WORKDIR
        assert "job 1" in r.stdout and "/logs/artifacts" in r.stdout
        assert (await env.exec("exit 3")).return_code == 3
        assert (await env.exec("sleep 30", timeout_sec=1)).return_code == TIMEOUT_EXIT_CODE
        assert (await env.exec("id -u", user="root")).stdout.strip() == "0"
        with pytest.raises(RuntimeError, match="user='agent'"):
            await env.exec("true", user="agent")

        script = tmp_path / "tool.sh"
        script.write_text("#!/bin/sh\necho tool\n")
        script.chmod(0o750)
        await env.upload_file(script, "/opt/bin/tool.sh")
        assert (await env.exec("stat -c %a /opt/bin/tool.sh && /opt/bin/tool.sh")).stdout.split() == ["750", "tool"]
        await env.upload_dir(DEFAULT_TASKS_DIR / "make-executable" / "tests", "/tests")
        assert (await env.exec("ls /tests")).stdout.split() == ["run.sh.orig", "test.sh"]
        assert await env.is_dir("/tests") and await env.is_file("/tests/test.sh")

        await env.exec("chmod 755 /app/run.sh && mkdir -p /app/out/sub && echo x > /app/out/sub/f && ln -s f /app/out/l")
        await env.download_file("/app/run.sh", tmp_path / "got" / "run.sh")
        assert os.stat(tmp_path / "got" / "run.sh").st_mode & 0o777 == 0o755  # the mode travels, as with docker cp
        await env.download_dir("/app/out", tmp_path / "out")
        assert (tmp_path / "out" / "sub" / "f").read_text() == "x\n" and os.readlink(tmp_path / "out" / "l") == "f"
        with pytest.raises(FileNotFoundError):
            await env.download_file("/app/nope", tmp_path / "nope")
        with pytest.raises(RuntimeError, match="no such folder"):
            await env.download_dir("/app/nope", tmp_path / "nope")
    finally:
        await env.stop(delete=True)
    assert not any((tmp_path / "boxes").rglob("disk.img"))  # the sandbox is gone
    with pytest.raises(RuntimeError, match="not started"):
        await env.exec("true")


async def test_harbor_verifier_scores_a_workdir_the_agent_locked(tmp_path):
    # Harbor's verifier runs in the workdir (`env -C /app`). A folder without its owner's x bit once failed
    # it with 125 where root on Docker runs it and scores; the local sandbox's root now enters it as that
    # root does (local_isolation.ROOT_CAPS), so the agent's modes stay. A file where the workdir goes is
    # still replaced before verifying (sandbox/workdir.py), never before the agent's own commands.
    task = Task(DEFAULT_TASKS_DIR / "write-name")
    env = make_env(tmp_path, "write-name")
    await env.start(force_build=False)
    try:
        await env.exec("echo 'Ada Lovelace' > name.txt && chmod 444 .")
        assert (await env.exec("true")).return_code == 0  # root enters it, as on Docker
        verifier = Verifier(task=task, trial_paths=env.trial_paths, environment=env)
        assert (await verifier.verify()).rewards == {"reward": 1.0}
        assert (await env.exec("stat -c %a /app", cwd="/")).stdout.strip() == "444"  # the agent's mode stands
        await env.exec("chmod 755 . && rm name.txt && chmod 000 .")
        assert (await verifier.verify()).rewards == {"reward": 0.0}  # scored, not an error
        assert (await env.exec("stat -c %a /app", cwd="/")).stdout.strip() == "0"
        await env.exec("rm -rf /app && echo x > /app", cwd="/")
        assert (await env.exec("true")).return_code == 125  # the agent's commands: its file stays in the way
        await env.empty_dirs(["/logs/verifier"])  # how the shared-step and separate verifiers start
        assert (await env.exec("test -d /app && echo dir", cwd="/")).stdout.strip() == "dir"
        assert (await verifier.verify()).rewards == {"reward": 0.0}
    finally:
        await env.stop(delete=True)


async def test_nothing_the_agent_left_running_changes_harbors_verdict(tmp_path):
    # The policy's side: a detached loop that rewrites the reward file while the tests run. It
    # scored 1.0 for a task not done before the verifier ended the agent's processes.
    task = Task(DEFAULT_TASKS_DIR / "write-name")
    env = make_env(tmp_path, "write-name")
    await env.start(force_build=False)
    try:
        await env.exec("(setsid sh -c 'while :; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; "
                       "done' > /dev/null 2>&1 &)")
        assert (await env.exec("sleep 0.2; cat /logs/verifier/reward.txt", cwd="/")).stdout.strip() == "1"
        verifier = Verifier(task=task, trial_paths=env.trial_paths, environment=env)
        assert (await verifier.verify()).rewards == {"reward": 0.0}
        assert (await env.exec("cat /logs/verifier/reward.txt", cwd="/")).stdout.strip() == "0"  # the loop is gone
    finally:
        await env.stop(delete=True)


def test_compose_tasks_are_refused(tmp_path):
    task = tmp_path / "t"
    shutil.copytree(DEFAULT_TASKS_DIR / "write-name", task)
    (task / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    t = Task(task)
    paths = TrialPaths(tmp_path / "trial")
    with pytest.raises(ValueError, match="docker-compose.yaml: compose environments are not supported"):
        LocalSandboxEnvironment(environment_dir=t.paths.environment_dir, environment_name="t", session_id="t__env",
                                trial_paths=paths, task_env_config=t.config.environment)


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        ({"verifier_result": {"rewards": {"reward": 1.0}}}, ("scored", 1.0)),
        ({"verifier_result": {"rewards": {"a": 1, "b": 0}}}, ("scored", 0.5)),
        ({"verifier_result": {"rewards": {"reward": 1.0}}, "exception_info": {"exception_type": "AgentTimeoutError"}},
         ("scored", 1.0)),
        ({"exception_info": {"exception_type": "VerifierTimeoutError"}}, ("infra_error:verifier_timeout", None)),
        ({"exception_info": {"exception_type": "RewardFileNotFoundError"}}, ("infra_error:verifier", None)),
        ({"exception_info": {"exception_type": "SandboxBuildFailedError"}}, ("infra_error:harbor_SandboxBuildFailedError", None)),
        ({}, ("infra_error:harbor_no_reward", None)),
    ],
)
def test_trial_outcomes_read_like_agentrl_outcomes(result, expected):
    assert trial_outcome(result) == expected


@pytest.mark.slow
def test_harbor_oracle_and_nop_score_every_fixture_as_agentrl_expects(tmp_path):
    """`harbor run -a oracle` / `-a nop` on envs/tbench2/tasks through Harbor's trial runner and
    verifier in agentrl's sandbox: the oracle 1.0 and nop 0.0 on every task, the adversarial
    fixtures as their [metadata] says (~2 min on 2 CPUs)."""
    from agentrl.harbor.parity import oracle_and_nop

    report = oracle_and_nop(DEFAULT_TASKS_DIR, tmp_path / "jobs")
    assert report["ok"], json.dumps(report["mismatches"], indent=1)
    assert report["refused_by_agentrl"] == ["malformed-toml"]
    oracle, nop = report["oracle"]["trials"], report["nop"]["trials"]
    assert len(oracle) == len(nop) == 29
    assert sum(r["reward"] == 1.0 for r in oracle.values()) == 25  # all but planted-reward and the 3 broken verifiers
    assert all(r["reward"] in (0.0, None) for r in nop.values())
