"""End-to-end: the launcher's local run trains the tiny GLM for real on this machine (embedded
engine, bubblewrap sandboxes, terminal-bench-2 fixture tasks, Ray actors), in both modes, and a
second invocation resumes from the checkpoint without retraining anything."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launchers" / "run_glm5_2_daytona.py"


def launch(run_dir: Path, *sets: str, timeout=900) -> subprocess.CompletedProcess:
    args = [sys.executable, str(LAUNCHER), "train", "--model-name", "tiny", "--num-nodes", "1",
            "--run-dir", str(run_dir), "--set", "cluster.dashboard=false", "--set", "rollout.max_new_tokens=24",
            "--set", "agent.max_turns=2", "--set", "algorithm.group_size=2"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_local_run_trains_and_resumes(tmp_path, mode):
    run = tmp_path / mode
    r = launch(run, "train.max_steps=2", f"mode={mode}", "train.checkpoint_every=1")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(run)
    assert [x["step"] for x in rows] == [1, 2]
    for x in rows:
        assert {"step", "reward_mean", "staleness_max", "weight_version", "episodes_infra_error"} <= set(x)
        assert x["weight_version"] == x["step"]
        assert 0 <= x["staleness_max"] <= 2
    assert (run / "curves.png").stat().st_size > 1000
    assert (run / "checkpoints" / "latest" / "state.pt").exists()
    # Resume: one more step on top; the trained groups of steps 1-2 are not trained again.
    r = launch(run, "train.max_steps=3", f"mode={mode}", "train.checkpoint_every=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 2" in r.stderr
    rows = metrics(run)
    assert [x["step"] for x in rows] == [1, 2, 3]
    trained = [json.loads(x) for x in (run / "replay.log.jsonl").read_text().splitlines()
               if '"type":"trained"' in x]
    groups = [g for rec in trained for g in rec["groups"]]
    assert len(groups) == len(set(groups)) == 3 * 2  # 3 steps x prompts_per_step, none twice
    # Every group was admitted once, with its own draw and seeds: the resumed run reused neither
    # a group id nor a seed of the first run (agentrl/policy/seeding.py).
    admitted = [json.loads(x) for x in (run / "replay.log.jsonl").read_text().splitlines()
                if '"type":"admitted"' in x]
    assert set(groups) <= {a["group"] for a in admitted}
    assert len({a["group"] for a in admitted}) == len(admitted)
    assert len({(a["draw"], a["attempt"]) for a in admitted}) == len(admitted)
    seeds = [s for a in admitted for s in a["seeds"]]
    assert len(seeds) == len(set(seeds)) == 2 * len(admitted)


@pytest.mark.slow
def test_engine_killed_mid_run_is_restarted_and_never_rewarded(tmp_path):
    """Kill this run's engine (its pid from RUN_DIR/processes.json) while it is generating: the run
    finishes, the engine is restarted and given the current weights, and the episodes that were on it
    end as infra errors (at least one), never trained."""
    import os
    import signal
    import time
    import urllib.request

    run = tmp_path / "kill"
    args = [sys.executable, str(LAUNCHER), "train", "--model-name", "tiny", "--num-nodes", "1", "--run-dir", str(run),
            "--set", "cluster.dashboard=false", "--set", "rollout.max_new_tokens=48", "--set", "agent.max_turns=2",
            "--set", "algorithm.group_size=2", "--set", "train.max_steps=5",
            # Staleness 1: what was generated before the kill can train at most two more steps, so
            # steps 4-5 need the restarted engine and the run cannot end before it is restarted.
            "--set", "buffer.max_staleness=1"]
    p = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    seen = []
    killed = None
    deadline = time.time() + 600
    for line in p.stderr:
        seen.append(line)
        if killed is None and line.startswith("step    1"):
            [engine] = json.loads((run / "processes.json").read_text())["engines"]
            # Wait until requests are decoding on it, so the kill lands on live episodes.
            until = time.time() + 60
            while time.time() < until:
                info = json.loads(urllib.request.urlopen(engine["url"] + "/server_info", timeout=5).read())
                if info["internal_states"][0].get("num_running", 0) > 0:
                    break
                time.sleep(0.05)
            killed = engine["pid"]
            os.kill(killed, signal.SIGKILL)
        if time.time() > deadline:
            p.kill()
            break
    assert p.wait(timeout=600) == 0, "".join(seen)[-3000:]
    text = "".join(seen)
    assert killed is not None and "engine 0 restarted; re-sending weights" in text
    rows = metrics(run)
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5]
    log = (run / "replay.log.jsonl").read_text().splitlines()
    hit = {json.loads(x)["episode_id"] for x in log if '"type":"traj"' in x and '"outcome":"infra_error:engine' in x}
    assert hit, "no episode was on the engine when it died"
    trained = {g for x in log if '"type":"trained"' in x for g in json.loads(x)["groups"]}
    assert not {e.rsplit("-", 1)[0] for e in hit} & trained  # a group with an infra error is never trained


@pytest.mark.slow
def test_metrics_reach_prometheus_during_a_local_run(tmp_path):
    """While a local run trains, Ray's Prometheus endpoint carries the agentrl_* series."""
    import time
    import urllib.request

    from agentrl.cluster.engine_process import free_port

    port = free_port()
    args = [sys.executable, str(LAUNCHER), "train", "--model-name", "tiny", "--num-nodes", "1",
            "--run-dir", str(tmp_path / "m"), "--set", "cluster.dashboard=false", "--set", "rollout.max_new_tokens=24",
            "--set", "agent.max_turns=2", "--set", "algorithm.group_size=2", "--set", "train.max_steps=4",
            "--set", f"cluster.metrics_export_port={port}"]
    p = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    found = ""
    try:
        for line in p.stderr:
            if line.startswith("step    2"):
                deadline = time.time() + 30
                while time.time() < deadline and "agentrl_step" not in found:
                    try:
                        found = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                    except OSError:
                        pass
                    time.sleep(1)
                break
        rest = p.communicate(timeout=600)[1]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, rest[-2000:]
    names = {ln.split("{")[0] for ln in found.splitlines() if ln.startswith("ray_agentrl_")}
    for want in ("ray_agentrl_step", "ray_agentrl_reward_mean", "ray_agentrl_staleness_max",
                 "ray_agentrl_episodes_finished_total", "ray_agentrl_buffer_ready_groups"):
        assert want in names, (want, sorted(names))


@pytest.mark.slow
def test_a_run_whose_every_task_cannot_be_played_stops_with_the_reason(tmp_path):
    # Every fixture prompt is over 64 tokens: each task fails once as a data error and is left
    # out of sampling; then the run stops with the field to fix instead of admitting groups forever.
    r = launch(tmp_path / "run", "agent.max_context_tokens=64", "rollout.max_new_tokens=16",
               "train.max_steps=1", timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: every training task") and "agent.max_context_tokens=64" in last, last
    assert "left out of sampling" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("to", ["pid", "group"])
def test_sigterm_finishes_the_step_in_flight_and_checkpoints_it(tmp_path, to):
    """A scheduler's SIGTERM mid-run: no new step starts, the one in flight is recorded, and a
    checkpoint of the last recorded step is saved although checkpoint_every never came; the launcher
    exits 143 saying so, and a second SIGTERM is not needed. to="group": the way GNU timeout stops
    its command, the launcher's pid and then its whole process group, where the local Ray's processes
    would die with it if they were there (agentrl/cluster/driver_session.py)."""
    import os
    import signal
    import time

    import torch

    run = tmp_path / "stop"
    args = [sys.executable, str(LAUNCHER), "train", "--model-name", "tiny", "--num-nodes", "1", "--run-dir", str(run),
            "--set", "cluster.dashboard=false", "--set", "rollout.max_new_tokens=24", "--set", "agent.max_turns=2",
            "--set", "algorithm.group_size=2", "--set", "train.max_steps=50", "--set", "train.checkpoint_every=1000"]
    p = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    seen, sent = [], None
    deadline = time.time() + 600
    for line in p.stderr:
        seen.append(line)
        if sent is None and line.startswith("step    2"):
            sent = time.time()
            os.kill(p.pid, signal.SIGTERM)
            if to == "group":
                os.killpg(p.pid, signal.SIGTERM)
        if time.time() > deadline:
            p.kill()
            break
    rc = p.wait(timeout=120)
    text = "".join(seen)
    assert sent is not None, text[-3000:]
    assert rc == 128 + signal.SIGTERM, text[-3000:]
    assert "stopped by SIGTERM at step" in text
    last = metrics(run)[-1]["step"]
    assert 2 <= last < 50
    state = torch.load(run / "checkpoints" / "latest" / "state.pt", weights_only=True)
    assert state["extra"]["step"] == last and state["version"] == last
    assert time.time() - sent < 120  # a clean stop is seconds of work, not the rest of the run
