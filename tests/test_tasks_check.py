"""`agentrl tasks check`: oracle and empty attempts, adversarial fixtures, exit codes, no leaks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from agentrl.config.schema import SandboxConfig
from agentrl.sandbox.local import LocalSandboxProvider
from envs.tbench2.check import check_task, check_tasks, run_oracle, task_dirs_of
from envs.tbench2.loader import DEFAULT_TASKS_DIR

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

REPO = Path(__file__).resolve().parents[1]
ADVERSARIAL = [
    "runaway-output",
    "hanging-command",
    "verifier-hangs",
    "planted-reward",
    "missing-reward",
    "nan-reward",
    "malformed-toml",
]
# Command lines only the adversarial fixtures start; none may survive its sandbox.
LEAK_MARKERS = [b"this line repeats forever", b"sleep\x00100000", b"tail\x00-f\x00/dev/null"]


def host_processes_matching(markers: list[bytes]) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if any(m in cmd for m in markers):
            found.append(int(name))
    return found


@pytest.fixture
async def provider(tmp_path):
    p = LocalSandboxProvider(
        SandboxConfig(), run_id=f"chk{uuid.uuid4().hex[:6]}", root_dir=tmp_path / "boxes"
    )
    yield p
    await p.aclose()


async def settled_processes(markers: list[bytes], within_s: float) -> set[int]:
    """The matching processes once none has ended for a moment (up to `within_s`): a sandbox that an
    earlier test closed may still be tearing down (seen under load: 1 run in 3)."""
    import asyncio

    found = set(host_processes_matching(markers))
    for _ in range(int(within_s / 0.25)):
        if not found:
            break
        await asyncio.sleep(0.25)
        now = set(host_processes_matching(markers))
        if now == found:
            break
        found = now
    return found


async def test_adversarial_fixtures_end_right_and_leave_nothing(provider):
    host_paths = [Path(p) for p in ("/app", "/logs/verifier", "/solution", "/tests")]
    before = {p: p.exists() for p in host_paths}
    # Another test's processes (the other slow lane runs these fixtures too) are not this test's.
    others = await settled_processes(LEAK_MARKERS, 10.0)
    results = await check_tasks(provider, task_dirs_of(DEFAULT_TASKS_DIR, ADVERSARIAL), jobs=4)
    by_name = {r.task: r for r in results}
    assert all(r.ok for r in results), [(r.task, r.error) for r in results if not r.ok]
    assert (by_name["runaway-output"].status, by_name["runaway-output"].reward) == ("scored", 1.0)
    assert by_name["runaway-output"].solve_timed_out and by_name["hanging-command"].solve_timed_out
    assert (by_name["planted-reward"].status, by_name["planted-reward"].reward) == ("scored", 0.0)
    assert by_name["verifier-hangs"].status == "infra_error:verifier_timeout"
    assert by_name["verifier-hangs"].empty_status == "infra_error:verifier_timeout"
    for name in ("missing-reward", "nan-reward"):
        assert (by_name[name].status, by_name[name].reward, by_name[name].empty_reward) == (
            "infra_error:verifier",
            None,
            None,
        )
    assert (
        by_name["malformed-toml"].status == "invalid"
        and "[verifier].timeout_sec" in by_name["malformed-toml"].error
    )
    # Nothing outlives its sandbox: no process, no sandbox folder, no file on the host's paths.
    assert set(host_processes_matching(LEAK_MARKERS)) - others == set()
    assert list(provider.base_dir.iterdir()) == []
    assert {p: p.exists() for p in host_paths} == before


def copy_task(tmp_path: Path, name: str) -> Path:
    dest = tmp_path / "tasks" / name
    shutil.copytree(DEFAULT_TASKS_DIR / name, dest)
    return dest


async def test_broken_tasks_fail_the_check(provider, tmp_path):
    d = copy_task(tmp_path, "create-greeting")
    (d / "solution" / "solve.sh").write_text("echo wrong > /app/greeting.txt\n")
    r = await check_task(provider, d)
    assert not r.ok and r.reward == 0.0 and "oracle scored 0.0, expected 1.0" in r.error

    d = copy_task(tmp_path, "count-lines")
    (d / "tests" / "test.sh").write_text("mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt\n")
    r = await check_task(provider, d)  # a test that passes an empty attempt is broken
    assert not r.ok and r.empty_reward == 1.0 and "empty attempt scored 1.0" in r.error

    d = copy_task(tmp_path, "malformed-toml")
    (d / "expected_error.txt").write_text("some other field")
    r = await check_task(provider, d)
    assert not r.ok and r.status == "invalid"
    (d / "expected_error.txt").unlink()
    assert not (await check_task(provider, d)).ok

    d = copy_task(tmp_path, "sort-names")
    (d / "solution" / "solve.sh").unlink()
    r = await check_task(provider, d)
    assert not r.ok and "solve.sh is missing" in r.error


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "tasks", "check", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_cli_json_and_exit_codes(tmp_path):
    res = run_cli(str(DEFAULT_TASKS_DIR), "--json", "--task", "make-executable", "--task", "malformed-toml")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [r["task"] for r in rows] == ["make-executable", "malformed-toml"]
    assert {k: rows[0][k] for k in ("status", "reward", "empty_reward", "error")} == {
        "status": "scored",
        "reward": 1.0,
        "empty_reward": 0.0,
        "error": None,
    }
    assert rows[0]["unsupported"] == ["line 1: FROM ubuntu:24.04"]
    assert rows[1]["status"] == "invalid" and rows[1]["reward"] is None
    assert "[1/2]" in res.stderr and "2/2 tasks passed" in res.stderr

    d = copy_task(tmp_path, "rename-logs")
    (d / "solution" / "solve.sh").write_text("true\n")
    res = run_cli(str(d), "--json")  # one task folder works as DIR too
    assert res.returncode == 1 and json.loads(res.stdout)[0]["reward"] == 0.0 and "FAIL" in res.stderr

    res = run_cli(str(DEFAULT_TASKS_DIR), "--task", "no-such-task")
    assert res.returncode != 0 and "no-such-task" in res.stderr

    env = {k: v for k, v in os.environ.items() if k != "DAYTONA_API_KEY"}
    res = run_cli(str(DEFAULT_TASKS_DIR), "--backend", "daytona", "--task", "count-lines", env=env)
    assert (
        res.returncode == 2 and "DAYTONA_API_KEY is not set" in res.stderr and "Traceback" not in res.stderr
    )


@pytest.mark.slow
def test_every_fixture_passes_through_the_cli():
    res = run_cli(str(DEFAULT_TASKS_DIR), "--json", "--jobs", "2")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert len(rows) >= 12 and all(r["ok"] for r in rows)
    normal = [r for r in rows if r["task"] not in ADVERSARIAL]
    assert normal and all(r["reward"] == 1.0 and r["empty_reward"] == 0.0 for r in normal)


HEADLINE_FORGERIES = ["setsid-writer", "tests-replacer", "tmux-writer"]  # the three the issue saw score 1.0


async def test_hack_forgeries_are_armed_and_score_nothing(provider):
    from envs.tbench2.forgeries import by_name

    r = await check_task(provider, DEFAULT_TASKS_DIR / "write-name", hack=by_name(HEADLINE_FORGERIES))
    assert r.ok, r.error
    assert (r.status, r.reward, r.empty_status) == ("scored", 1.0, None)
    rows = {f.forgery: f for f in r.forgeries}
    assert list(rows) == HEADLINE_FORGERIES
    for f in rows.values():  # each trick was in place when scoring began, and none passed
        assert f.armed and (f.status, f.reward) == ("scored", 0.0), f
    assert list(provider.base_dir.iterdir()) == []  # every episode's sandbox is gone


async def test_fresh_verifier_defeats_a_program_the_tests_trust(provider):
    from envs.tbench2.check import run_forgery
    from envs.tbench2.forgeries import by_name
    from envs.tbench2.loader import load_task

    task = load_task(DEFAULT_TASKS_DIR / "hijack-path")
    assert (task.verifier_sandbox, task.verifier_outputs) == ("fresh", ["/app/sum.txt"])
    (fake,) = by_name(["fake-bin-on-path"])
    same = await run_forgery(provider, task, fake, verifier_sandbox="same")
    assert same.armed and same.reward == 1.0  # in the agent's own sandbox the fake sumcheck wins
    fresh = await run_forgery(provider, task, fake)
    assert fresh.armed and fresh.reward == 0.0 and "fresh verifier sandbox" in fresh.detail
    oracle, _ = await run_oracle(provider, task)
    assert oracle.reward == 1.0 and "carried 1 file(s)" in oracle.detail


def test_cli_hack_reports_a_forged_pass_and_exits_1(tmp_path):
    d = copy_task(tmp_path, "hijack-path")
    toml = d / "task.toml"
    toml.write_text(toml.read_text().replace('environment_mode = "separate"', 'environment_mode = "shared"'))
    res = run_cli(str(d), "--hack", "--forgery", "fake-bin-on-path", "--json")
    assert res.returncode == 1, res.stderr
    assert "FORGED hijack-path: fake-bin-on-path scored 1" in res.stderr
    (row,) = json.loads(res.stdout)
    assert [(f["forgery"], f["armed"], f["reward"]) for f in row["forgeries"]] == [("fake-bin-on-path", True, 1.0)]
    from typer.testing import CliRunner

    from agentrl.envs.tasks_cli import app

    res = CliRunner().invoke(app, ["check", str(d), "--forgery", "setsid-writer"])
    assert res.exit_code == 2 and "--forgery needs --hack" in res.output
    res = CliRunner().invoke(app, ["check", str(d), "--hack", "--forgery", "no-such-trick"])
    assert res.exit_code == 2 and "no-such-trick" in res.output and "setsid-writer" in res.output


@pytest.mark.slow
def test_no_known_forgery_scores_on_any_fixture():
    res = run_cli(str(DEFAULT_TASKS_DIR), "--hack", "--json", "--jobs", "2", timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout)
    assert len(rows) >= 20 and all(r["ok"] for r in rows)
    assert all(f["reward"] in (None, 0.0) for r in rows for f in r["forgeries"] or [])
