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
from agentrl.buffer.staleness import StalenessBound


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
    assert b.group_ids == ["g1", "g2"] and b.num_trajectories == 4
    assert [t.episode_id for t in buf.batch_trajectories(b.batch_id)] == ["g1-0", "g1-1", "g2-0", "g2-1"]


def test_staleness_bound_is_inclusive(tmp_path):
    bound = StalenessBound(2)
    assert bound.admits(3, 5) and not bound.admits(2, 5)
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=2)
    fill(buf, "old", version=2, task="task-7")  # lag 3 at version 5
    fill(buf, "edge", version=3)  # lag 2: admitted
    b = buf.take_batch(1, current_version=5)
    assert b.group_ids == ["edge"] and b.staleness == [2]
    assert buf.counters["stale_retired"] == 1
    assert [(r.group_id, r.task_id, r.reason) for r in buf.pop_retired()] == [("old", "task-7", "stale_lag_3")]
    assert buf.pop_retired() == []  # a fact is reported once


def test_infra_error_group_is_retired_and_reported_never_trained(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=4)
    buf.add(traj("g1", 0, task="x"))
    buf.add(traj("g1", 1, outcome=infra_error("sandbox"), task="x"))
    assert buf.ready_groups() == 0 and buf.take_batch(1, 0) is None
    [r] = buf.pop_retired()
    assert (r.group_id, r.task_id, r.reason) == ("g1", "x", "infra_error")
    assert sorted(r.outcomes) == ["infra_error:sandbox", "scored"]


async def test_wait_ready_returns_when_groups_complete_or_a_group_retires(tmp_path):
    import asyncio

    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=4)
    assert await buf.wait_ready(1, timeout_s=0.05) == 0  # times out
    waiter = asyncio.create_task(buf.wait_ready(1, timeout_s=5))
    await asyncio.sleep(0.01)
    fill(buf, "g")
    assert await asyncio.wait_for(waiter, 1) == 1
    waiter = asyncio.create_task(buf.wait_ready(5, timeout_s=5))
    await asyncio.sleep(0.01)
    buf.add(traj("h", 0, outcome=infra_error("engine")))
    buf.add(traj("h", 1))
    assert await asyncio.wait_for(waiter, 1) == 1  # woken by the retirement, not the count


def test_duplicates_are_acknowledged_once(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=1)
    assert buf.add(traj("g", 0)) and buf.add(traj("g", 0))
    assert buf.counters["accepted"] == 1 and buf.counters["duplicates"] == 1


def test_restart_resumes_exactly(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=10)
    for g in ("a", "b", "c", "d"):
        fill(buf, g)
    b1 = buf.take_batch(1, 0)
    buf.mark_trained(1, b1.batch_id)  # checkpoint at step 1 exists
    b2 = buf.take_batch(1, 1)
    buf.mark_trained(2, b2.batch_id)  # crash before the step-2 checkpoint
    b3 = buf.take_batch(1, 2)  # taken, never trained
    assert (b1.group_ids, b2.group_ids, b3.group_ids) == (["a"], ["b"], ["c"])
    fill(buf, "e", n=1, task="te")  # half a group
    # "crash": no close; plus a torn half-written line at the end of the log
    with open(tmp_path / LOG_NAME, "ab") as f:
        f.write(b'{"type":"traj","episode_id":"torn')
    again = ReplayBuffer(tmp_path, group_size=2, max_staleness=10, resume_step=1)
    out = again.take_batch(3, 1)
    assert out.group_ids == ["b", "c", "d"]  # a: trained at step 1; b: its step was lost
    # e's first half can never complete (its other episode died with the run): retired, reported
    assert again.stats()["pending_groups"] == 0
    assert [(r.group_id, r.task_id, r.reason) for r in again.pop_retired()] == [("e", "te", "incomplete_at_resume")]
    assert again.recovery()["rolled_back_steps"] == 1
    # The step-2 update was rolled back: training b again at step 2 is its only surviving record.
    again.mark_trained(2, out.batch_id)
    third = ReplayBuffer(tmp_path, group_size=2, max_staleness=10, resume_step=2)
    assert third.take_batch(1, 2) is None and third.recovery()["rolled_back_steps"] == 0


def test_a_malformed_line_is_skipped_and_reported_not_fatal(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=10)
    fill(buf, "a")
    with open(tmp_path / LOG_NAME, "ab") as f:
        f.write(b'{"type": "traj", "episode_id": \x00 garbage\n')
        f.write(b"[1, 2, 3]\n")
    fill(buf, "b")
    again = ReplayBuffer(tmp_path, group_size=2, max_staleness=10)
    assert again.take_batch(2, 0).group_ids == ["a", "b"]
    rec = again.recovery()
    assert rec["malformed_log_lines"] == 2
    assert ":3: malformed record" in rec["malformed"][0] and ":4: malformed record" in rec["malformed"][1]


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
        got |= {t.episode_id for t in buf.batch_trajectories(b.batch_id)}
    # The last group's acknowledged part cannot complete: it is retired, and its episodes are counted.
    retired = buf.pop_retired()
    assert [r.reason for r in retired] in ([], ["incomplete_at_resume"])
    from agentrl.buffer.audit import audit_log

    got |= {e for e, g in audit_log(tmp_path).accepted.items() if g in {r.group_id for r in retired}}
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
