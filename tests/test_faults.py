"""Fault injection: the cheap scenarios run here (sandbox, bad input, security, disk full); the
ones that need a full local training run are in test_faults_slow.py. Each scenario checks its own
expectations against a real component; these tests run them through the registry and assert they
held, and test the harness itself (selection, report, a failing scenario is reported, not raised)."""

from __future__ import annotations

import json
import shutil

import pytest

from bench.faults import run_faults, run_scenario, select
from bench.faults_base import Checks, Outcome, Scenario, lost_trajectories

HAVE_TOOLS = bool(shutil.which("bwrap") and shutil.which("tmux"))
# Scenarios that import transformers and build models cost ~20-30 s each on a loaded 2-core machine;
# they run in the slow suite and in `agentrl bench faults`.
HEAVY = {"input_oversized_prompt", "input_wrong_architecture_checkpoint", "security_secret_checkpoint",
         "sandbox_gigabyte_of_output", "task_solution_hangs", "task_runaway_output", "task_test_sh_hangs",
         "sandbox_dies_mid_episode", "security_secret_plan_output"}
FAST = [s.name for s in select(include_slow=False) if s.name not in HEAVY]
NEEDS_SANDBOX = {"sandbox_hanging_command", "task_reward_file_missing", "task_reward_file_nan",
                 "task_reward_file_garbage", "security_sandbox_isolation", "security_sandbox_process_flood",
                 "input_malformed_model_output", "worker_replay_log_disk_full", "sandbox_dies_mid_episode",
                 "sandbox_gigabyte_of_output", "task_solution_hangs", "task_runaway_output", "task_test_sh_hangs",
                 "input_oversized_prompt"}
# The integrity scenarios (bench/faults_integrity.py) all play or score tasks in real sandboxes.
NEEDS_SANDBOX |= {n for n in FAST if n.startswith("integrity_")}


def _run(name: str) -> dict:
    if name in NEEDS_SANDBOX and not HAVE_TOOLS:
        pytest.skip("needs bubblewrap and tmux (CI installs them; tests/test_system_tools.py fails without)")
    (s,) = select([name])
    return run_scenario(s)


@pytest.mark.parametrize("name", FAST)
def test_cheap_scenario_passes(name):
    e = _run(name)
    assert e["passed"], e["observed"]
    assert e["trajectories_lost"] == 0
    assert "NOT:" not in e["observed"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HEAVY))
def test_heavy_scenario_passes(name):
    e = _run(name)
    assert e["passed"], e["observed"]


def test_every_issue_bullet_has_a_scenario():
    names = {s.name for s in select()}
    for want in ("sandbox_create_429_storm", "sandbox_slow_creates", "sandbox_dies_mid_episode",
                 "sandbox_hanging_command", "sandbox_gigabyte_of_output", "task_test_sh_hangs",
                 "task_reward_file_missing", "task_reward_file_garbage", "engine_killed_mid_generation",
                 "worker_episode_worker_killed", "worker_trainer_killed_then_resumed", "worker_replay_log_disk_full",
                 "worker_launcher_ctrl_c", "input_malformed_task_toml", "input_malformed_model_output",
                 "input_oversized_prompt", "input_bad_config_value", "input_wrong_architecture_checkpoint",
                 "security_secret_scan_of_a_run", "security_secret_plan_output", "security_bind_addresses",
                 "security_sandbox_isolation"):
        assert want in names, want
    assert all(s.slow for s in select() if s.name.startswith(("engine_", "worker_")) and "disk_full" not in s.name)


def test_unknown_scenario_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown fault scenario.*nope"):
        select(["nope"])


def test_report_has_the_fields_and_a_failure_is_reported(tmp_path, monkeypatch):
    from bench import faults

    def broken(tmp):
        raise RuntimeError("boom")

    def lossy(tmp):
        c = Checks()
        c(True, "fine")
        return c.outcome(trajectories_lost=2)

    fake = [Scenario("ok_one", "input", "passes", lambda tmp: Outcome("seen", True)),
            Scenario("raises", "input", "raises", broken), Scenario("lossy", "input", "loses", lossy)]
    monkeypatch.setattr(faults, "scenarios", lambda: fake)
    out = tmp_path / "faults.json"
    lines: list[str] = []
    report = run_faults(out, echo=lines.append)
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(report))
    assert {"machine", "scenarios", "passed", "failed", "trajectories_lost"} <= set(data)
    assert "versions" in data["machine"]
    by = {e["scenario"]: e for e in data["scenarios"]}
    for e in by.values():
        assert {"scenario", "expected", "observed", "passed", "trajectories_lost"} <= set(e)
    assert by["ok_one"]["passed"] and not by["raises"]["passed"] and "RuntimeError: boom" in by["raises"]["observed"]
    assert not by["lossy"]["passed"] and by["lossy"]["trajectories_lost"] == 2  # a loss fails the scenario
    assert data["failed"] == 2 and any(line.startswith("[2/3] FAIL raises") for line in lines)


def test_lost_trajectories_counts_from_the_log(tmp_path, monkeypatch):
    from agentrl.agent.trajectory import Trajectory
    from agentrl.buffer.log import DurableLog
    from agentrl.buffer.replay import LOG_NAME, ReplayBuffer

    def traj(gid, k):
        t = Trajectory(episode_id=f"{gid}-{k}", task_id="t", group_id=gid, prompt_len=1, token_ids=[1, 2],
                       loss_mask=[0, 1], rollout_logprobs=[0.0, -0.1], weight_versions=[-1, 0],
                       outcome="scored", reward=1.0)
        return {"type": "traj", **t.to_dict()}

    log = DurableLog(tmp_path / LOG_NAME, fsync=False)  # what a buffer of group size 2 wrote
    for rec in [traj(g, k) for g in ("a", "b", "c") for k in (0, 1)] + [traj("d", 0)]:
        log.append(rec)
    log.append({"type": "trained", "step": 1, "groups": ["a"]})
    log.close()
    before = (tmp_path / LOG_NAME).read_bytes()
    assert lost_trajectories(tmp_path)[0] == 0
    _, counts = lost_trajectories(tmp_path)
    assert counts == {"accepted": 7, "in_trained_groups": 2, "in_retired_groups": 0, "back_in_buffer": 5, "lost": 0}
    assert (tmp_path / LOG_NAME).read_bytes() == before  # the evidence is left as it was
    # A recovery that drops a group (the bug this count exists to catch) shows as lost.
    real = ReplayBuffer._insert
    monkeypatch.setattr(ReplayBuffer, "_insert", lambda self, t: t.group_id != "c" and real(self, t))
    assert lost_trajectories(tmp_path)[0] == 2
