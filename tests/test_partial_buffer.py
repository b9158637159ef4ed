"""Partial rollout in the buffer and the loss: the per-token staleness rule, the stale-token policy
(mask / tis) and the batch's token facts; in-flight episodes recorded in the sidecar survive a
reopen (chains merged, a gap cuts a chain, accepted episodes and done groups drop out, compaction)
and come back as groups to continue instead of being retired."""

from __future__ import annotations

import json

import pytest

from agentrl.agent.resume import EpisodeSnapshot
from agentrl.agent.trajectory import SCORED, Trajectory, infra_error
from agentrl.buffer.audit import audit_log
from agentrl.buffer.batch_view import version_spans
from agentrl.buffer.partial_log import PARTIAL_LOG_NAME
from agentrl.buffer.replay import ReplayBuffer
from agentrl.buffer.staleness import StalenessBound
from agentrl.train.loss import apply_stale_tokens


def traj(gid, k, versions, reward=1.0, outcome=SCORED, info=None):
    """Prompt of 2 tokens, then one sampled token per entry of `versions`."""
    n = len(versions)
    return Trajectory(episode_id=f"{gid}-{k}", task_id="t", group_id=gid, prompt_len=2, token_ids=list(range(2 + n)),
                      loss_mask=[0, 0] + [1] * n, rollout_logprobs=[0.0, 0.0] + [-0.5] * n,
                      weight_versions=[-1, -1] + list(versions), outcome=outcome,
                      reward=reward if outcome == SCORED else None, info=info or {})


def test_the_per_token_rule_judges_a_group_by_its_newest_token():
    group = [traj("g", 0, [1, 1, 4]), traj("g", 1, [3, 3])]
    assert StalenessBound(1).group_lag(group, 5) == 4  # whole-group rule: the oldest token (1)
    assert StalenessBound(1, per_token=True).group_lag(group, 5) == 1  # the newest token (4)
    assert StalenessBound(1, per_token=True).group_lag([traj("g", 0, [])], 5) is None


def test_mask_leaves_stale_tokens_out_and_tis_keeps_them():
    t = traj("g", 0, [2, 3, 4, 5])
    masked, n = apply_stale_tokens(t, current_version=5, max_staleness=1, policy="mask")
    assert n == 2 and masked.loss_mask == [0, 0, 0, 0, 1, 1] and t.loss_mask == [0, 0, 1, 1, 1, 1]
    kept, n = apply_stale_tokens(t, 5, 1, "tis")
    assert n == 2 and kept is t
    with pytest.raises(ValueError, match="stale_tokens"):
        apply_stale_tokens(t, 5, 1, "drop")
    assert version_spans(t.loss_mask, t.weight_versions) == 4 and version_spans([0, 1, 1], [-1, 3, 3]) == 1


@pytest.mark.parametrize("policy", ["mask", "tis"])
def test_a_long_continued_group_trains_under_partial_and_is_retired_without(tmp_path, policy):
    slow = [traj("g", 0, [1, 2, 3, 4], info={"interruptions": 3, "carried_tokens": 3}), traj("g", 1, [2])]
    plain = ReplayBuffer(tmp_path / "off", group_size=2, max_staleness=1)
    for t in slow:
        plain.add(t)
    assert plain.take_batch(1, current_version=4) is None and plain.counters["stale_retired"] == 1
    buf = ReplayBuffer(tmp_path / policy, group_size=2, max_staleness=1, partial=True, stale_tokens=policy)
    for t in slow:
        buf.add(t)
    b = buf.take_batch(1, current_version=4)
    assert b.staleness == [0]
    facts = b.tokens
    assert facts["trajectories_interrupted"] == 1 and facts["tokens_carried_over"] == 3
    assert facts["version_spans_max"] == 4 and facts["version_spans_mean"] == 2.5 and facts["stale_tokens"] == 3
    trained = buf.batch_trajectories(b.batch_id)
    if policy == "mask":  # the early finisher is stale throughout: its reward counts, its tokens do not
        assert trained[0].loss_mask == [0, 0, 0, 0, 1, 1] and trained[1].loss_mask == [0, 0, 0]
        assert facts["trained_tokens"] == 2 and facts["token_lag_max"] == 1
    else:
        assert trained[0].loss_mask == slow[0].loss_mask and facts["trained_tokens"] == 5
        assert facts["token_lag_max"] == 3
    # the stored trajectory is never changed: the replay log and a resume see what was sampled
    assert buf._taken[b.batch_id][0].trajectories["g-0"].loss_mask == slow[0].loss_mask
    buf.mark_trained(1, b.batch_id)
    # Even its newest token too old: retired under partial as well.
    for t in [traj("h", 0, [1]), traj("h", 1, [2])]:
        buf.add(t)
    assert buf.take_batch(1, current_version=4) is None and buf.counters["stale_retired"] == 1


def record(eid, gid, start, tokens, *, steps=(), open_turn=0, turns=0):
    n = len(tokens)
    return EpisodeSnapshot(eid, gid, "t", 2, start=start, token_ids=list(tokens), loss_mask=[1] * n,
                           logprobs=[-0.1] * n, versions=[7] * n, steps=[{"action": {"command": c}, "text": c}
                                                                     for c in steps],
                           prompt_len=2, turns=turns, open_turn=open_turn, open_turn_budget=8).to_record()


def test_recorded_episodes_come_back_as_groups_to_continue(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=4, resume_in_flight=True)
    buf.add(traj("g1", 0, [0]))  # g1: one accepted, one in flight
    assert buf.record_partial(record("g1-1", "g1", 0, [1, 2, 3], steps=["ls"], turns=1))
    assert buf.record_partial(record("g1-1", "g1", 3, [4, 5], open_turn=2, turns=1))
    assert buf.record_partial(record("g2-0", "g2", 0, [1, 2]))  # g2: nothing accepted yet
    assert buf.record_partial(record("g2-0", "g2", 5, [9]))  # a gap: the chain ends before it
    assert buf.record_partial(record("g3-0", "g3", 0, [1]))
    buf.add(traj("g3", 0, [0]))  # accepted: its records no longer count
    assert not buf.record_partial(record("g3-0", "g3", 1, [2]))  # late record of an accepted episode
    buf.add(traj("g3", 1, [0]))
    fill_infra = [traj("g4", 0, [0], outcome=infra_error("sandbox"))]
    for t in fill_infra:
        buf.add(t)
    buf.record_partial(record("g4-1", "g4", 0, [1]))
    buf.close()

    again = ReplayBuffer(tmp_path, group_size=2, max_staleness=4, resume_in_flight=True)
    groups = {r["group_id"]: r for r in again.resumable()}
    assert sorted(groups) == ["g1", "g2"] and again.resumable() == []
    assert groups["g1"]["accepted"] == ["g1-0"] and list(groups["g1"]["snapshots"]) == ["g1-1"]
    snap = EpisodeSnapshot.from_record(groups["g1"]["snapshots"]["g1-1"])
    assert snap.token_ids == [1, 2, 3, 4, 5] and snap.open_turn == 2 and snap.records == 2
    assert [s["text"] for s in snap.steps] == ["ls"]
    assert EpisodeSnapshot.from_record(groups["g2"]["snapshots"]["g2-0"]).token_ids == [1, 2]
    assert again.counters["incomplete_at_resume"] == 1  # g4 holds an infra error: retired, not continued
    assert [r.group_id for r in again.pop_retired()] == ["g4"]
    assert again.counters["resumable_groups"] == 2 and again.counters["resumable_episodes"] == 2
    # The continued episodes complete their groups.
    again.add(traj("g1", 1, [7, 8]))
    assert again.ready_groups() == 2  # g3 (complete before the crash) and g1
    # The sidecar was compacted to one record per live episode.
    lines = [json.loads(x) for x in (tmp_path / PARTIAL_LOG_NAME).read_text().splitlines()]
    assert [(x["episode_id"], x["start"], x["records"]) for x in lines] == [("g1-1", 0, 2), ("g2-0", 0, 1)]
    # The audit still reads the replay log alone.
    audit = audit_log(tmp_path)
    assert set(audit.accepted) == {"g1-0", "g3-0", "g3-1", "g4-0", "g1-1"} and "g1" in audit.untrained_groups


def test_without_resume_in_flight_incomplete_groups_are_retired_as_before(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=4, resume_in_flight=True)
    buf.add(traj("g1", 0, [0]))
    buf.record_partial(record("g1-1", "g1", 0, [1]))
    buf.close()
    plain = ReplayBuffer(tmp_path, group_size=2, max_staleness=4)
    assert plain.resumable() == [] and not plain.record_partial(record("g9-0", "g9", 0, [1]))
    assert [(r.group_id, r.reason) for r in plain.pop_retired()] == [("g1", "incomplete_at_resume")]


def test_a_torn_last_progress_record_was_never_acknowledged(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=4, resume_in_flight=True)
    buf.record_partial(record("g1-0", "g1", 0, [1, 2]))
    buf.record_partial(record("g1-0", "g1", 2, [3]))
    buf.close()
    path = tmp_path / PARTIAL_LOG_NAME
    path.write_bytes(path.read_bytes()[:-7])  # a crash mid-write of the second record
    again = ReplayBuffer(tmp_path, group_size=2, max_staleness=4, resume_in_flight=True)
    [g] = again.resumable()
    assert EpisodeSnapshot.from_record(g["snapshots"]["g1-0"]).token_ids == [1, 2]
