"""The cluster path on one machine (recipe local_cluster): two simulated nodes on a local Ray, a
Megatron trainer of two gloo ranks (EP2 x DP2), two embedded engines started by the engine actors on
the inference node, through the real launcher. It trains, a trainer rank is killed mid-run, and the
same command resumes: no step trained twice (replay log and metrics), no acknowledged trajectory lost."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launchers" / "run_glm5_2_daytona.py"


def launch(run_dir: Path, *sets: str) -> list[str]:
    return [sys.executable, str(LAUNCHER), "train", "--config", "local_cluster", "--run-dir", str(run_dir),
            *[a for s in sets for a in ("--set", s)]]


def metrics_steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_local_cluster_trains_survives_a_killed_rank_and_resumes(tmp_path):
    from agentrl.buffer.audit import audit_log

    run = tmp_path / "cluster"
    p = subprocess.Popen(launch(run, "train.max_steps=5"), stderr=subprocess.PIPE, text=True, cwd=ROOT)
    seen, killed = [], None
    deadline = time.time() + 900
    for line in p.stderr:
        seen.append(line)
        if killed is None and line.startswith("step    2"):
            procs = json.loads((run / "processes.json").read_text())
            assert [t["rank"] for t in procs["trainers"]] == [0, 1]
            assert {t["coords"]["ep"] for t in procs["trainers"]} == {0, 1}  # EP2: each rank its own experts
            assert len(procs["engines"]) == 2 and all(e["pid"] for e in procs["engines"])
            killed = procs["trainers"][1]["pid"]
            os.kill(killed, signal.SIGKILL)
        if time.time() > deadline:
            p.kill()
            break
    p.wait(timeout=300)
    text = "".join(seen)
    assert killed is not None, text[-3000:]
    assert p.returncode == 1 and "TrainerWorker died" in text and "Run the same command again" in text, text[-3000:]
    before = metrics_steps(run)
    assert before[:2] == [1, 2]

    r = subprocess.run(launch(run, "train.max_steps=5"), capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step" in r.stderr
    steps = metrics_steps(run)
    assert steps == [1, 2, 3, 4, 5]  # each step once in the surviving history
    audit = audit_log(run, resume_step=5)
    assert audit.groups_in_two_steps == ()  # no group trained twice
    assert sorted(audit.groups_by_step) == [1, 2, 3, 4, 5]
    # Every acknowledged trajectory is trained, retired (counted) or still waiting in the buffer.
    assert len(audit.accepted) == (len(audit.trajectories_in(audit.trained_groups))
                                   + len(audit.trajectories_in(audit.retired_groups)) + len(audit.untrained_trajectories))
    plan = json.loads((run / "plan.json").read_text())
    assert plan["layout"]["ep"] == 2 and plan["layout"]["world"] == 2 and plan["num_nodes"] == 2
