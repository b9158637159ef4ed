"""Episode seeds (agentrl/policy/seeding.py): the k-th group of two runs of one seed gets the same task
and seeds whatever else happens between, a re-admission is a new attempt, the replay log keeps every
admission so a resumed run never draws the same seeds again, and the turns env plays its episode
lengths from them."""

from __future__ import annotations

from agentrl.buffer.replay import ReplayBuffer
from agentrl.policy.sampling import RoundRobinSampler
from agentrl.policy.seeding import SEED_MASK, SeedSchedule, episode_seeds
from bench.turns_env import TurnsEnv


def test_seeds_are_a_pure_function_of_run_seed_draw_attempt_and_episode():
    a = episode_seeds(7, draw=3, attempt=0, n=4)
    assert a == episode_seeds(7, 3, 0, 4) and len(set(a)) == 4 and all(0 <= s <= SEED_MASK for s in a)
    others = [episode_seeds(8, 3, 0, 4), episode_seeds(7, 4, 0, 4), episode_seeds(7, 3, 1, 4)]
    assert all(not set(a) & set(o) for o in others)


def admissions(run_seed: int, readmit_every: int | None) -> list[tuple[int, str, tuple[int, ...]]]:
    """Fresh draws of a run loop (task from a seeded sampler, seeds from the schedule) with a
    re-admission of the previous group after every `readmit_every` draws (an off run's stale groups)."""
    sampler, seeds = RoundRobinSampler([f"t{i}" for i in range(5)], seed=run_seed), SeedSchedule(run_seed, 4)
    fresh, last = [], None
    for k in range(12):
        if readmit_every and k and k % readmit_every == 0:
            again = seeds.assign(last)
            seeds.started(last, again)
            assert (again.draw, again.attempt) == (fresh[-1][0], 1)
            assert not set(again.seeds) & set(fresh[-1][2])  # run again with new seeds
        g = seeds.assign(None)
        last = f"gid{k}"
        seeds.started(last, g)
        fresh.append((g.draw, sampler.next_task(), g.seeds))
    return fresh


def test_the_kth_group_of_two_runs_gets_the_same_task_and_seeds_even_when_one_re_admits_groups():
    assert admissions(0, None) == admissions(0, 3)  # re-admissions do not shift the fresh draws
    assert [d for d, _, _ in admissions(0, None)] == list(range(12))
    assert admissions(0, None) != admissions(1, None)


def test_a_forgotten_or_unknown_lineage_gets_a_new_draw():
    s = SeedSchedule(0, 2)
    first = s.assign(None)
    s.started("g0", first)
    s.forget("g0")
    assert (s.assign("g0").draw, s.assign("from-before-a-restart").attempt) == (1, 0)


def test_the_replay_log_keeps_every_admission_so_a_resumed_run_draws_on_past_it(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=1, fsync=False)
    s = SeedSchedule(0, 2)
    for lineage in (None, None, None):
        g = s.assign(lineage)
        buf.admitted(f"g{g.draw}", "t", g.draw, g.attempt, list(g.seeds))
    used = {seed for d in range(3) for seed in episode_seeds(0, d, 0, 2)}
    buf.close()
    again = ReplayBuffer(tmp_path, group_size=2, max_staleness=1, fsync=False, resume_step=0)
    assert again.recovery()["next_draw"] == 3
    resumed = SeedSchedule(0, 2)  # a run restarted from a checkpoint taken before those admissions
    resumed.on_resume(again.recovery()["next_draw"])
    assert resumed.assign(None).draw == 3 and not set(resumed.assign(None).seeds) & used


def test_a_group_continued_after_a_crash_gets_its_logged_seeds_back(tmp_path):
    from agentrl.agent.trajectory import Trajectory

    buf = ReplayBuffer(tmp_path, group_size=2, max_staleness=1, fsync=False, resume_in_flight=True)
    buf.admitted("gA", "t", 0, 0, [111, 222])
    buf.add(Trajectory("gA-0", "t", "gA", 1, [1, 2], [0, 1], [0.0, -0.1], [-1, 0], "scored", 1.0, 1))
    buf.close()
    again = ReplayBuffer(tmp_path, group_size=2, max_staleness=1, fsync=False, resume_in_flight=True)
    [g] = again.resumable()
    assert g["group_id"] == "gA" and g["accepted"] == ["gA-0"] and g["seeds"] == [111, 222]


async def test_the_turns_env_draws_an_episodes_length_from_its_reset_seed():
    env = TurnsEnv(median_turns=3, sigma=2.0, max_turns=64)
    seeds = episode_seeds(0, 5, 0, 16)
    lengths = [env.draw_turns(f"run-a-{i}", s) for i, s in enumerate(seeds)]
    assert lengths == [env.draw_turns(f"other-run-{i}", s) for i, s in enumerate(seeds)]  # ids differ, turns do not
    assert len(set(lengths)) > 1
    await env.reset("turns-0", episode_id="x", seed=seeds[3])
    assert env.turns == lengths[3]
    await env.reset("turns-0", episode_id="y")  # no seed: from the episode id, as before
    assert env.turns == env.draw_turns("y")
