"""The run loop's policies: admission (capacity formula, resume hook, episode budget) and retry
(infra vs data failures, a budget per group lineage)."""

import pytest

from agentrl.policy.admission import AdmissionPolicy
from agentrl.policy.retry import INFRA_RETRIES, NoPlayableTasks, RetryPolicy, UnplayableTasks, failure_kind


def test_admission_capacity_formula():
    a = AdmissionPolicy(groups_per_step=2, group_size=4, max_staleness=1, max_episodes_in_flight=100)
    assert a.capacity(version=0) == 4  # (1 + 0 + 1) * 2
    for _ in range(4):
        a.on_start()
    assert a.capacity(0) == 0 and a.capacity(1) == 2
    a.on_group_retired()
    assert a.capacity(0) == 1
    small = AdmissionPolicy(groups_per_step=8, group_size=4, max_staleness=8, max_episodes_in_flight=8)
    assert small.capacity(0) == 2  # episode budget binds
    small.on_start()
    small.on_episodes_end(4)
    assert small.running_episodes == 0


def test_partial_lead_admits_that_many_more_steps_of_groups_and_no_more():
    """lead_steps=2 with B=3: (1 + 2 + 0 + 1) * 3 = 12 groups at version 0, against 6 without the
    lead; the episode budget still caps it, and a negative lead is refused naming the field."""
    base = AdmissionPolicy(groups_per_step=3, group_size=2, max_staleness=1, max_episodes_in_flight=1000)
    ahead = AdmissionPolicy(groups_per_step=3, group_size=2, max_staleness=1, max_episodes_in_flight=1000,
                            lead_steps=2)
    assert (base.capacity(0), ahead.capacity(0)) == (6, 12)
    for _ in range(12):
        ahead.on_start()
    assert ahead.capacity(0) == 0 and ahead.capacity(1) == 3
    capped = AdmissionPolicy(groups_per_step=3, group_size=2, max_staleness=1, max_episodes_in_flight=8,
                             lead_steps=5)
    assert capped.capacity(0) == 4  # 8 episodes // group of 2
    with pytest.raises(ValueError, match="rollout.partial_lead_steps=-1"):
        AdmissionPolicy(groups_per_step=3, group_size=2, max_staleness=1, max_episodes_in_flight=8, lead_steps=-1)


def test_after_a_resume_at_step_n_admission_holds_the_staleness_capacity():
    """Without the resume hook a run resumed at version 5 would see (2 + 5 + 1) * 4 = 32 free slots and
    start 32 groups at once; every group beyond (max_staleness + 1) * B of them ends up stale."""
    fresh = AdmissionPolicy(groups_per_step=4, group_size=2, max_staleness=2, max_episodes_in_flight=1000)
    # An uninterrupted run: 5 steps trained, 3 groups waiting in the buffer at version 5.
    for _ in range(5 * 4 + 3):
        fresh.on_start()
    resumed = AdmissionPolicy(groups_per_step=4, group_size=2, max_staleness=2, max_episodes_in_flight=1000)
    resumed.on_resume(version=5, buffered_groups=3)
    assert resumed.capacity(5) == fresh.capacity(5) == (2 + 5 + 1) * 4 - 23 == 9
    never_hooked = AdmissionPolicy(groups_per_step=4, group_size=2, max_staleness=2, max_episodes_in_flight=1000)
    assert never_hooked.capacity(5) == 32  # the bug the hook fixes


def test_admission_refuses_a_budget_no_group_fits():
    with pytest.raises(ValueError, match="max_episodes_in_flight=4 is below algorithm.group_size=8"):
        AdmissionPolicy(groups_per_step=1, group_size=8, max_staleness=1, max_episodes_in_flight=4)


def test_admission_counts_never_go_negative():
    a = AdmissionPolicy(groups_per_step=1, group_size=2, max_staleness=0, max_episodes_in_flight=4)
    with pytest.raises(ValueError):
        a.on_group_retired()
    with pytest.raises(ValueError):
        a.on_episodes_end(1)


def test_failures_are_classified():
    assert failure_kind("scored") is None and failure_kind("truncated") is None
    assert failure_kind("infra_error:sandbox") == "infra" and failure_kind("infra_error:worker") == "infra"
    assert failure_kind("infra_error:task") == "data"


def test_infra_retries_are_budgeted_per_lineage_not_per_task():
    r = RetryPolicy()
    for i in range(INFRA_RETRIES):
        d = r.decide("g1", ["scored", "infra_error:engine"])
        assert d.retry and f"retry {i + 1} of {INFRA_RETRIES}" in d.reason
    d = r.decide("g1", ["infra_error:engine"])
    assert not d.retry and "dropped" in d.reason and r.counters["infra_dropped"] == 1
    assert r.decide("g2", ["infra_error:sandbox"]).retry  # another admission of the same task: its own budget


def test_data_failures_are_not_retried_by_default():
    r = RetryPolicy()
    d = r.decide("g", ["infra_error:task"])
    assert not d.retry and r.counters["data_dropped"] == 1 and d.kind == "data"
    assert r.decide("h", ["infra_error:engine"]).kind == "infra"


def round_robin(pool):
    state = {"i": -1}

    def next_task():
        state["i"] = (state["i"] + 1) % len(pool)
        return pool[state["i"]]
    return next_task


def test_unplayable_tasks_are_skipped_and_all_unplayable_stops_the_run():
    pool = ["a", "b", "c"]
    u, draw = UnplayableTasks(), round_robin(pool)
    assert [u.draw(draw, pool) for _ in range(3)] == pool
    u.mark("a", "prompt too long")
    u.mark("a", "a later reason")  # the first reason is kept
    assert {u.draw(draw, pool) for _ in range(6)} == {"b", "c"}
    u.mark("b", "x")
    assert {u.draw(draw, pool) for _ in range(4)} == {"c"}
    u.mark("c", "y")
    with pytest.raises(NoPlayableTasks, match=r"every training task \(3\).*a: prompt too long"):
        u.draw(draw, pool)
    u.note_error("a", "the episode's own message")  # arriving after the drop, it is the better reason
    with pytest.raises(NoPlayableTasks, match="a: the episode's own message"):
        u.draw(draw, pool)


def test_unplayable_draws_give_up_for_the_round_on_a_sampler_that_keeps_returning_them():
    u = UnplayableTasks()
    u.mark("bad", "why")
    assert u.draw(lambda: "bad", ["bad", "good"]) is None  # "good" is still playable: no stop, no hang
