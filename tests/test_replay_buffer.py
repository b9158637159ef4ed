"""Replay buffer: groups, the staleness bound (lag == max admitted, max + 1 not), infra-error
groups, duplicates, and exact resume after a kill."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from agentrl.agent.trajectory import SCORED, Trajectory, infra_error
from agentrl.buffer.log import LogWriteError
from agentrl.buffer.replay import LOG_NAME, ReplayBuffer
from agentrl.buffer.staleness import AdmissionControl, StalenessBound


def traj(gid, k, version=0, outcome=SCORED, reward=1.0, task="t"):
    return Trajectory(episode_id=f"{gid}-{k}", task_id=task, group_id=gid, prompt_len=2, token_ids=[1, 2, 3],
                      loss_mask=[0, 0, 1], rollout_logprobs=[0.0, 0.0, -0.5], weight_versions=[-1, -1, version],
                      outcome=outcome, reward=reward if outcome == SCORED else None)


def fill(buf, gid, n=2, version=0, **kw):
    for k in range(n):
        assert buf.add(traj(gid, k, version, **kw))


def test_groups_complete_and_batch_in_order(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=1)
    buf.add(traj("g1", 0))
    assert buf.ready_groups() == 0 and buf.take_batch(1, 0) is None
    buf.add(traj("g1", 1))
    fill(buf, "g2")
    b = buf.take_batch(2, 0)
    assert b.group_ids == ["g1", "g2"] and len(b.trajectories) == 4


def test_staleness_bound_is_inclusive(tmp_path):
    bound = StalenessBound(2)
    assert bound.admits(3, 5) and not bound.admits(2, 5)
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=2, stale_policy="drop")
    fill(buf, "old", version=2)  # lag 3 at version 5
    fill(buf, "edge", version=3)  # lag 2: admitted
    b = buf.take_batch(1, current_version=5)
    assert b.group_ids == ["edge"] and b.staleness == [2]
    assert buf.counters["stale_dropped"] == 1 and buf.pop_regenerate() == []


def test_stale_regenerate_policy(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=0, stale_policy="regenerate")
    fill(buf, "g", version=0, task="task-7")
    assert buf.take_batch(1, current_version=1) is None
    assert buf.counters["stale_regenerated"] == 1
    assert [r["task_id"] for r in buf.pop_regenerate()] == ["task-7"]


def test_infra_error_group_is_retried_whole_then_dropped(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=4, max_group_retries=1)
    buf.add(traj("g1", 0, task="x"))
    buf.add(traj("g1", 1, outcome=infra_error("sandbox"), task="x"))
    assert buf.ready_groups() == 0
    assert [r["task_id"] for r in buf.pop_regenerate()] == ["x"]
    buf.add(traj("g2", 0, outcome=infra_error("engine"), task="x"))
    buf.add(traj("g2", 1, task="x"))
    assert buf.pop_regenerate() == [] and buf.counters["infra_groups_dropped"] == 1
    assert buf.take_batch(1, 0) is None  # an infra error is never trained


def test_duplicates_are_acknowledged_once(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=1)
    assert buf.add(traj("g", 0)) and buf.add(traj("g", 0))
    assert buf.counters["accepted"] == 1 and buf.counters["duplicates"] == 1


def test_restart_resumes_exactly(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=10)
    for g in ("a", "b", "c", "d"):
        fill(buf, g)
    b1 = buf.take_batch(1, 0)
    buf.mark_trained(1, b1.group_ids)  # checkpoint at step 1 exists
    b2 = buf.take_batch(1, 1)
    buf.mark_trained(2, b2.group_ids)  # crash before the step-2 checkpoint
    b3 = buf.take_batch(1, 2)  # taken, never trained
    assert (b1.group_ids, b2.group_ids, b3.group_ids) == (["a"], ["b"], ["c"])
    fill(buf, "e", n=1)  # half a group
    # "crash": no close; plus a torn half-written line at the end of the log
    with open(tmp_path / LOG_NAME, "ab") as f:
        f.write(b'{"type":"traj","episode_id":"torn')
    again = ReplayBuffer(tmp_path, group_size=2, max_staleness=10, resume_step=1)
    out = again.take_batch(3, 1)
    assert out.group_ids == ["b", "c", "d"]  # a: trained at step 1; b: its step was lost
    assert again.stats()["pending_groups"] == 1  # e's first half is still there
    again.add(traj("e", 1))
    assert again.take_batch(1, 1).group_ids == ["e"]


CHILD = r"""
import sys, json
from agentrl.agent.trajectory import Trajectory
from agentrl.buffer.replay import ReplayBuffer
buf = ReplayBuffer(sys.argv[1], group_size=4, max_staleness=10)
i = 0
while True:
    gid, k = f"g{i // 4}", i % 4
    t = Trajectory(episode_id=f"{gid}-{k}", task_id="t", group_id=gid, prompt_len=1, token_ids=[1, 2] * 50,
                   loss_mask=[0, 1] * 50, rollout_logprobs=[0.0] * 100, weight_versions=[0] * 100,
                   outcome="scored", reward=1.0)
    buf.add(t)
    print(t.episode_id, flush=True)
    i += 1
"""


def test_kill_minus_nine_loses_nothing_acknowledged(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    acked = []
    deadline = time.time() + 60
    while len(acked) < 150 and time.time() < deadline:
        acked.append(p.stdout.readline().strip())
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    acked += [line.strip() for line in p.stdout.read().splitlines() if line.strip()]
    assert len(acked) >= 150
    buf = ReplayBuffer(tmp_path, group_size=4, max_staleness=10)
    got = set()
    while (b := buf.take_batch(1, 0)) is not None:
        got |= {t.episode_id for t in b.trajectories}
    got |= {t for g in buf._pending.values() for t in g.trajectories}
    assert set(acked) <= got


def test_disk_full_is_a_clear_error_and_no_corruption(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=1)
    buf.add(traj("g", 0))
    buf._log._f.close()
    buf._log._f = open("/dev/full", "ab")
    with pytest.raises(LogWriteError, match="record not accepted"):
        buf.add(traj("g", 1))
    assert buf.counters["accepted"] == 1
    lines = (tmp_path / LOG_NAME).read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["episode_id"] == "g-0"


def test_admission_capacity_formula():
    a = AdmissionControl(groups_per_step=2, group_size=4, max_staleness=1, max_episodes_in_flight=100)
    assert a.capacity(version=0) == 4  # (1 + 0 + 1) * 2
    for _ in range(4):
        a.on_start(4)
    assert a.capacity(0) == 0 and a.capacity(1) == 2
    a.on_group_retired()
    assert a.capacity(0) == 1
    small = AdmissionControl(groups_per_step=8, group_size=4, max_staleness=8, max_episodes_in_flight=8)
    assert small.capacity(0) == 2  # episode budget binds
