"""The replay-log audit: every acknowledged trajectory in exactly one of trained / retired /
untrained, resume semantics matching a reopened buffer, rolled-back and retrained steps, double
training reported, and the log left untouched. Logs are written record by record (the log format
is the contract), so the audit is tested apart from the buffer's methods."""

import pytest

from agentrl.agent.trajectory import SCORED, Trajectory
from agentrl.buffer.audit import audit_log
from agentrl.buffer.log import DurableLog
from agentrl.buffer.replay import LOG_NAME, ReplayBuffer


def traj(gid, k, version=0):
    t = Trajectory(episode_id=f"{gid}-{k}", task_id=f"task-{gid}", group_id=gid, prompt_len=1,
                   token_ids=[1, 2], loss_mask=[0, 1], rollout_logprobs=[0.0, -0.1],
                   weight_versions=[-1, version], outcome=SCORED, reward=1.0)
    return {"type": "traj", **t.to_dict()}


def write(tmp_path, *records):
    log = DurableLog(tmp_path / LOG_NAME, fsync=False)
    for r in records:
        log.append(r)
    log.close()


def three_steps(tmp_path):
    """g1..g3 trained at steps 1-3, 'old' retired stale, 'late' complete but untrained, 'half'
    incomplete: 13 acknowledged trajectories."""
    recs = [traj("old", 0), traj("old", 1), {"type": "retired", "group": "old", "reason": "stale_lag_2"}]
    for step, gid in enumerate(("g1", "g2", "g3"), 1):
        recs += [traj(gid, 0, step), traj(gid, 1, step), {"type": "trained", "step": step, "groups": [gid]}]
    recs += [traj("late", 0, 3), traj("late", 1, 3), traj("half", 0, 3), traj("bad", 0), traj("bad", 1),
             {"type": "retired", "group": "bad", "reason": "infra_error"}]
    write(tmp_path, *recs)


def test_every_acknowledged_trajectory_has_one_state(tmp_path):
    three_steps(tmp_path)
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
    three_steps(tmp_path)
    a = audit_log(tmp_path, resume_step=1)
    assert a.trained_groups == {"g1"} and a.untrained_groups == {"g2", "g3", "late", "half"}
    assert a.groups_by_step == {1: ("g1",)}
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=10, resume_step=1)
    try:  # the complete untrained groups are the ones a buffer reopened there serves
        assert buf.ready_groups() == len(a.untrained_groups - {"half"}) == 3
    finally:
        buf.close()


def test_a_rolled_back_step_trained_again_and_a_group_trained_twice(tmp_path):
    three_steps(tmp_path)
    # resumed from step 2's checkpoint: step 3's update was lost; step 3 trains 'late' this time
    write(tmp_path, {"type": "rollback", "to_step": 2, "steps": [3]},
          {"type": "trained", "step": 3, "groups": ["late"]})
    a = audit_log(tmp_path)
    assert a.steps_trained_more_than_once == (3,) and a.groups_by_step[3] == ("late",)
    assert "g3" in a.untrained_groups and "late" in a.trained_groups and a.groups_in_two_steps == ()
    write(tmp_path, {"type": "trained", "step": 4, "groups": ["g1"]})  # g1 again: a real double training
    assert audit_log(tmp_path).groups_in_two_steps == ("g1",)


def test_torn_tail_is_skipped_and_the_log_left_as_it_was(tmp_path):
    three_steps(tmp_path)
    with open(tmp_path / LOG_NAME, "ab") as f:
        f.write(b'{"type":"traj","episode_id":"torn-0"')
    before = (tmp_path / LOG_NAME).read_bytes()
    a = audit_log(tmp_path)
    assert "torn-0" not in a.accepted and len(a.accepted) == 13
    assert (tmp_path / LOG_NAME).read_bytes() == before


def test_a_malformed_line_is_skipped_and_listed(tmp_path):
    three_steps(tmp_path)
    with open(tmp_path / LOG_NAME, "ab") as f:
        f.write(b"not json\n")  # line 19, after the 18 records of three_steps
    write(tmp_path, traj("after", 0))
    a = audit_log(tmp_path)
    assert len(a.accepted) == 14 and "after-0" in a.accepted  # the records after it still count
    assert len(a.malformed) == 1 and ":19:" in a.malformed[0] and a.counts()["malformed_lines"] == 1


def test_empty_folder_and_unknown_record(tmp_path):
    a = audit_log(tmp_path)
    assert a.accepted == {} and a.resume_step == 0 and a.counts()["accepted"] == 0
    write(tmp_path, {"type": "mystery"})
    with pytest.raises(ValueError, match="unknown record type 'mystery'"):
        audit_log(tmp_path)
