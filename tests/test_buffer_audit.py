"""The replay-log audit: every acknowledged trajectory in exactly one of trained / retired /
untrained, resume semantics matching a reopened buffer, retrained steps and double training
reported, and the log left untouched."""

import pytest

from agentrl.agent.trajectory import SCORED, Trajectory, infra_error
from agentrl.buffer.audit import audit_log
from agentrl.buffer.log import DurableLog
from agentrl.buffer.replay import LOG_NAME, ReplayBuffer


def traj(gid, k, version=0, outcome=SCORED):
    return Trajectory(episode_id=f"{gid}-{k}", task_id=f"task-{gid}", group_id=gid, prompt_len=1,
                      token_ids=[1, 2], loss_mask=[0, 1], rollout_logprobs=[0.0, -0.1],
                      weight_versions=[-1, version], outcome=outcome, reward=1.0 if outcome == SCORED else None)


def fill(buf, gid, n=2, **kw):
    for k in range(n):
        buf.add(traj(gid, k, **kw))


def run_three_steps(tmp_path):
    """g1..g3 trained at steps 1-3, 'old' retired stale, 'bad' retired for an infra error, 'half'
    incomplete, 'late' complete but never taken."""
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=1, stale_policy="drop")
    fill(buf, "old", version=0)
    buf.add(traj("bad", 0))
    buf.add(traj("bad", 1, outcome=infra_error("sandbox")))
    for step, gid in enumerate(("g1", "g2", "g3"), 1):
        fill(buf, gid, version=step)
        batch = buf.take_batch(1, current_version=step + 1)  # 'old' (lag >= 2) is dropped on the way
        assert batch.group_ids == [gid]
        buf.mark_trained(step, batch.group_ids)
    fill(buf, "late", version=3)
    buf.add(traj("half", 0, version=3))
    buf.close()


def test_every_acknowledged_trajectory_has_one_state(tmp_path):
    run_three_steps(tmp_path)
    a = audit_log(tmp_path)
    assert a.resume_step == 3 and len(a.accepted) == 13
    assert a.trained_groups == {"g1", "g2", "g3"} and a.retired_groups == {"old", "bad"}
    assert a.untrained_groups == {"late", "half"}
    assert sorted(a.untrained_trajectories) == ["half-0", "late-0", "late-1"]
    c = a.counts()
    assert c["in_trained_groups"] + c["in_retired_groups"] + c["untrained"] == c["accepted"] == 13
    assert a.groups_by_step == {1: ("g1",), 2: ("g2",), 3: ("g3",)}
    assert a.steps_trained_more_than_once == () and a.groups_in_two_steps == ()


def test_resume_step_returns_later_groups_as_a_reopened_buffer_does(tmp_path):
    run_three_steps(tmp_path)
    a = audit_log(tmp_path, resume_step=1)
    assert a.trained_groups == {"g1"} and a.untrained_groups == {"g2", "g3", "late", "half"}
    assert a.groups_by_step == {1: ("g1",)}
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=10, resume_step=1)
    try:  # the complete untrained groups are exactly the ones the reopened buffer serves
        batch = buf.take_batch(buf.ready_groups(), current_version=3)
        assert set(batch.group_ids) == a.untrained_groups - {"half"}
        assert buf.retire_incomplete("half", "audit") == len(a.trajectories_in(frozenset({"half"})))
    finally:
        buf.close()


def test_a_step_trained_again_after_a_resume_and_a_group_trained_twice(tmp_path):
    run_three_steps(tmp_path)
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=10, resume_step=2)  # step 3's update was lost
    batch = buf.take_batch(1, current_version=2)
    assert batch.group_ids == ["g3"]
    buf.mark_trained(3, batch.group_ids)
    buf.close()
    a = audit_log(tmp_path)
    assert a.steps_trained_more_than_once == (3,) and a.groups_in_two_steps == ()
    log = DurableLog(tmp_path / LOG_NAME)
    log.append({"type": "trained", "step": 4, "groups": ["g1"]})  # g1 again: a real double training
    log.close()
    assert audit_log(tmp_path).groups_in_two_steps == ("g1",)


def test_torn_tail_is_skipped_and_the_log_left_as_it_was(tmp_path):
    run_three_steps(tmp_path)
    with open(tmp_path / LOG_NAME, "ab") as f:
        f.write(b'{"type":"traj","episode_id":"torn-0"')
    before = (tmp_path / LOG_NAME).read_bytes()
    a = audit_log(tmp_path)
    assert "torn-0" not in a.accepted and len(a.accepted) == 13
    assert (tmp_path / LOG_NAME).read_bytes() == before


def test_empty_folder_and_unknown_record(tmp_path):
    a = audit_log(tmp_path)
    assert a.accepted == {} and a.resume_step == 0 and a.counts()["accepted"] == 0
    log = DurableLog(tmp_path / LOG_NAME)
    log.append({"type": "mystery"})
    log.close()
    with pytest.raises(ValueError, match="unknown record type 'mystery'"):
        audit_log(tmp_path)
