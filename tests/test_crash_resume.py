"""Crash-safe resume (issue [I]): SIGKILL the trainer rank at three moments of a local run (before the
first checkpoint, during a step, during a weight update), rerun the same command each time, and read
the replay log and metrics: no step trained twice in the surviving history, no acknowledged
trajectory lost, the resume says what it is."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launchers" / "run_glm5_2_daytona.py"


def command(run: Path, *sets: str) -> list[str]:
    base = ["cluster.dashboard=false", "rollout.max_new_tokens=24", "agent.max_turns=2", "algorithm.group_size=2"]
    return [sys.executable, str(LAUNCHER), "train", "--config", "local", "--run-dir", str(run),
            *[a for s in base + list(sets) for a in ("--set", s)]]


def trainer_pid(run: Path) -> int:
    return json.loads((run / "processes.json").read_text())["trainers"][0]["pid"]


def engine_paused(run: Path) -> bool:
    [engine] = json.loads((run / "processes.json").read_text())["engines"]
    info = json.loads(urllib.request.urlopen(engine["url"] + "/server_info", timeout=5).read())
    return bool(info["internal_states"][0].get("paused"))


def crash(run: Path, sets: list[str], when) -> str:
    """Start a run, SIGKILL its trainer rank once `when(line, run)` says so; returns stderr."""
    p = subprocess.Popen(command(run, *sets), stderr=subprocess.PIPE, text=True, cwd=ROOT)
    seen, killed = [], False
    deadline = time.time() + 600
    for line in p.stderr:
        seen.append(line)
        if not killed and when(line, run):
            os.kill(trainer_pid(run), signal.SIGKILL)
            killed = True
        if time.time() > deadline:
            p.kill()
    p.wait(timeout=300)
    text = "".join(seen)
    assert killed and p.returncode == 1 and "TrainerWorker died" in text, text[-3000:]
    return text


def during_update(line: str, run: Path) -> bool:
    if not line.startswith("step "):  # after any step (a resumed run numbers its steps from the checkpoint)
        return False
    until = time.time() + 120  # the next update pauses the engine (pause -> begin -> buckets -> end -> continue)
    while time.time() < until:
        try:
            if engine_paused(run):
                return True
        except OSError:
            pass
        time.sleep(0.01)
    return True


def check_history(run: Path, steps: int) -> None:
    from agentrl.buffer.audit import audit_log

    rows = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, steps + 1)), rows  # each step once; rolled-back rows moved aside
    audit = audit_log(run, resume_step=steps)
    assert audit.groups_in_two_steps == ()
    assert sorted(audit.groups_by_step) == list(range(1, steps + 1))
    kept = (len(audit.trajectories_in(audit.trained_groups)) + len(audit.trajectories_in(audit.retired_groups))
            + len(audit.untrained_trajectories))
    assert kept == len(audit.accepted)  # every acknowledged trajectory is accounted for


@pytest.mark.slow
def test_kill_before_the_first_checkpoint_then_resume(tmp_path):
    run = tmp_path / "early"
    sets = ["train.max_steps=3", "train.checkpoint_every=100"]  # the only checkpoint is at the last step
    crash(run, sets, lambda line, _run: line.startswith("step    2"))
    r = subprocess.run(command(run, *sets), capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "no checkpoint: starting at step 0" in r.stderr and "acknowledged trajectories kept" in r.stderr
    assert "step(s) after the checkpoint were lost with the crash" in r.stderr
    assert (run / "metrics.rolled_back.jsonl").exists()
    check_history(run, 3)


@pytest.mark.slow
def test_kill_mid_step_and_mid_update_then_resume(tmp_path):
    run = tmp_path / "mid"
    sets = ["train.max_steps=4", "train.checkpoint_every=1"]
    # mid-step: the trainer is stepping right after it announced the previous step (batches are ready)
    crash(run, sets, lambda line, _run: line.startswith("step    2") and not time.sleep(0.3))
    assert (run / "checkpoints" / "latest").exists()
    crash(run, sets, during_update)
    r = subprocess.run(command(run, *sets), capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step" in r.stderr
    check_history(run, 4)
