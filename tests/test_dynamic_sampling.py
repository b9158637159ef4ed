"""Dynamic sampling (agentrl/policy/dynamic_sampling.py): zero-variance groups out, counted, capped."""

from __future__ import annotations

import pytest

from agentrl.agent.trajectory import Trajectory
from agentrl.config.schema import AlgorithmConfig
from agentrl.policy.dynamic_sampling import DynamicSampler, GroupRewards, groups_of, is_zero_variance
from agentrl.train.loss import group_advantages


def g(gid: str, *rewards: float) -> GroupRewards:
    return GroupRewards(gid, f"task-{gid}", tuple(rewards))


def test_zero_variance_groups_are_dropped_and_counted_by_kind():
    s = DynamicSampler()
    sel = s.select([g("a", 0, 0, 0), g("b", 1, 0, 0), g("c", 1, 1, 1), g("d", 0.5, 0.5 + 1e-12)])
    assert sel.kept_ids == ["b"] and sel.dropped_ids == ["a", "c", "d"]
    m = s.metrics()
    assert (m["dynamic_sampling_dropped_unsolved"], m["dynamic_sampling_dropped_solved"]) == (1.0, 2.0)
    assert m["dynamic_sampling_groups_seen"] == 4.0 and m["dynamic_sampling_drop_rate"] == 0.75


def test_dropped_groups_are_exactly_those_without_gradient():
    groups = [g("a", 0, 0, 0, 0), g("b", 1, 0, 1, 0), g("c", 1, 1, 1, 1)]
    sel = DynamicSampler().select(groups)
    for grp in groups:
        adv = group_advantages(list(grp.rewards), [grp.group_id] * len(grp.rewards)).advantages
        assert (grp in sel.dropped) == all(a == 0.0 for a in adv)


def test_disabled_keeps_everything_but_still_counts():
    s = DynamicSampler(enabled=False)
    sel = s.select([g("a", 0, 0), g("b", 0, 1)])
    assert sel.kept_ids == ["a", "b"] and not sel.dropped
    assert s.metrics()["dynamic_sampling_zero_variance"] == 1.0


def test_a_long_streak_lets_one_group_through_so_the_run_keeps_stepping():
    s = DynamicSampler(max_skips=2)
    kept = [bool(s.select([g(str(i), 0, 0)]).kept) for i in range(6)]
    assert kept == [False, False, True, False, False, True]
    s.select([g("x", 0, 0)])
    s.select([g("y", 0, 1)])  # a group with signal resets the streak
    assert s.streak == 0
    assert s.metrics()["dynamic_sampling_let_through"] == 2.0


def test_groups_of_trajectories_and_state_round_trip():
    def traj(gid, eid, reward, outcome="scored"):
        return Trajectory(eid, "t1", gid, 1, [1, 2], [0, 1], [0.0, -0.1], [-1, 0], outcome, reward)

    groups = groups_of([traj("g1", "e1", 1.0), traj("g2", "e2", 0.0), traj("g1", "e3", None, "truncated")])
    assert groups == [GroupRewards("g1", "t1", (1.0, 0.0)), GroupRewards("g2", "t1", (0.0,))]
    assert is_zero_variance([None, 0.0]) and not is_zero_variance([None, 1.0])
    a = DynamicSampler.from_config(AlgorithmConfig(dynamic_sampling=True, dynamic_sampling_max_skips=5))
    a.select(groups)
    b = DynamicSampler(max_skips=5)
    b.load_state_dict(a.state_dict())
    assert b.metrics() == a.metrics() and b.streak == a.streak == 1
    with pytest.raises(ValueError, match="not a DynamicSampler state"):
        b.load_state_dict({"kind": "pass_rate"})
    with pytest.raises(ValueError, match="dynamic_sampling_max_skips"):
        DynamicSampler(max_skips=-1)
