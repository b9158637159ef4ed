"""kill -9 with episodes in flight (issue [V]): a local run with partial rollout and
buffer.resume_in_flight (tiny GLM, embedded engine, the turns env running one real sandbox command
per turn) is killed whole, the launcher and every process under it, with SIGKILL, while episodes
are mid-way. The rerun continues the recorded episodes in fresh sandboxes (their commands replayed)
instead of starting their groups again: each one's trajectory starts with exactly the recorded
tokens, and nothing acknowledged is lost or trained twice."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launchers" / "run_glm5_2_daytona.py"
ENV_KWARGS = {"median_turns": 6, "sigma": 0.3, "max_turns": 10, "num_tasks": 4, "sandbox": True}
SETS = ["cluster.dashboard=false", "env.name=bench.turns_env:TurnsEnv", f"env.kwargs={json.dumps(ENV_KWARGS)}",
        "env.eval_every=0", "agent.action_format=text", "agent.max_turns=10", "agent.max_context_tokens=2048",
        "rollout.max_new_tokens=16", "rollout.partial=true", "buffer.resume_in_flight=true",
        "algorithm.group_size=2", "algorithm.prompts_per_step=2", "train.checkpoint_every=1"]


def command(run: Path, steps: int) -> list[str]:
    args = [sys.executable, str(LAUNCHER), "train", "--config", "local", "--run-dir", str(run)]
    for s in [*SETS, f"train.max_steps={steps}"]:
        args += ["--set", s]
    return args


def in_flight(run: Path) -> dict:
    """Recorded episodes that are neither accepted nor of a trained or retired group: what a rerun continues."""
    from agentrl.buffer.audit import audit_log
    from agentrl.buffer.partial_log import PARTIAL_LOG_NAME, read_chains

    audit = audit_log(run)
    chains = read_chains(run / PARTIAL_LOG_NAME, lambda *_: None)
    done = audit.trained_groups | audit.retired_groups
    return {e: c for e, c in chains.items() if e not in audit.accepted and c.group_id not in done}


def kill_everything(root: int) -> None:
    from bench.faults_run import descendants

    for _ in range(3):  # processes started while the first ones die are caught the next time round
        for pid in descendants(root):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.5)


@pytest.fixture
def short_tmpdir():
    """A short TMPDIR for the runs (Ray's socket paths are limited to ~107 characters), removed after."""
    path = tempfile.mkdtemp(prefix="agentrl-v25-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_kill_9_with_episodes_in_flight_then_they_continue(tmp_path, short_tmpdir):
    run = tmp_path / "run"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TMPDIR": short_tmpdir}
    p = subprocess.Popen(command(run, 2), stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                         start_new_session=True)
    seen, killed = [], False
    deadline = time.time() + 600
    for line in p.stderr:
        seen.append(line)
        if line.startswith("step    1"):
            # Kill once an episode has run commands in its sandbox and is still going.
            while time.time() < deadline and not any(c.steps for c in in_flight(run).values()):
                time.sleep(0.2)
            kill_everything(p.pid)
            killed = True
            break
    p.wait(timeout=120)
    assert killed and p.returncode == -signal.SIGKILL, "".join(seen)[-3000:]
    before = in_flight(run)
    assert any(c.steps for c in before.values()), before

    r = subprocess.run(command(run, 4), check=False, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "were in flight at the crash: they go on" in r.stderr, r.stderr[-3000:]
    accepted = {}
    for line in (run / "replay.log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "traj":
            accepted[rec["episode_id"]] = rec
    still = in_flight(run)
    continued = replayed = 0
    for eid, snap in before.items():
        if eid in accepted:  # finished in the rerun: the recorded prefix, token for token
            t = accepted[eid]
            assert "resume_diverged" not in t["info"], t["info"]
            n = len(snap.token_ids)
            assert t["token_ids"][:n] == snap.token_ids and t["weight_versions"][:n] == snap.versions
            assert t["rollout_logprobs"][:n] == snap.logprobs
            assert t["info"]["resumed"]["steps"] == len(snap.steps) and t["outcome"] == "scored"
            continued += 1
            replayed += len(snap.steps)
        else:  # still running when the rerun stopped: its record goes on from the recorded one
            assert eid in still and still[eid].token_ids[:len(snap.token_ids)] == snap.token_ids
    assert continued >= 1
    print(f"in flight at the kill: {len(before)} recorded episodes; {continued} continued and finished "
          f"({replayed} commands replayed), {len(before) - continued} still running at the rerun's end")
    from tests.test_crash_resume import check_history

    check_history(run, 4)
