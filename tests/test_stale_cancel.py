"""Stale cancellation: the doomed-group rule (agentrl/policy/stale_cancel.py), the episode worker's
facts and cancellation (agentrl/cluster/episode_worker.py), the buffer's retirement of a cancelled
group (agentrl/buffer/replay.py). A cancelled request's abort on its engine: tests/test_engine_client.py."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.agent.runner import EpisodeSummary
from agentrl.agent.trajectory import Trajectory
from agentrl.buffer.audit import audit_log
from agentrl.buffer.replay import ReplayBuffer
from agentrl.cluster.episode_worker import EpisodeWorker, GenerationTally
from agentrl.config.loader import load_config
from agentrl.policy.stale_cancel import CANCEL_REASON_PREFIX, CANCELLED, StaleCancelPolicy
from agentrl.rollout.types import GenerateResult, SamplingParams

# -- the rule ------------------------------------------------------------------------------------


def test_a_group_is_doomed_only_once_its_oldest_known_token_is_past_the_bound():
    p = StaleCancelPolicy(max_staleness=1)
    assert not p.doomed(3, 3) and not p.doomed(3, 4)  # lag 0 and lag == bound still train
    assert p.doomed(3, 5) and p.doomed(0, 9)  # lag bound + 1: never trains again
    assert not p.doomed(None, 100)  # nothing known sampled yet: never called doomed
    assert p.reason(3, 5) == f"{CANCEL_REASON_PREFIX}2" and p.reason(3, 5).startswith("stale")


def test_under_the_per_token_rule_a_running_group_is_never_doomed():
    assert not StaleCancelPolicy(max_staleness=0, per_token=True).doomed(0, 50)


def test_bound_zero_dooms_a_group_at_the_first_update_after_its_first_token():
    p = StaleCancelPolicy(max_staleness=0)
    assert not p.doomed(2, 2) and p.doomed(2, 3)


# -- the worker ----------------------------------------------------------------------------------


class SlowEngine:
    """A Generator: one token per call at the current version, after `delay_s`."""

    def __init__(self, delay_s: float = 0.01):
        self.version, self.delay_s, self.calls = 0, delay_s, 0

    async def generate(self, input_ids, sampling, *, session_id, rid=None):
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        return GenerateResult([7], [-0.1], [self.version], "stop")


class TurnsRunner:
    """Plays `turns[k]` one-token turns for episode k through the worker's generator."""

    def __init__(self, generator, turns: list[int]):
        self.generator, self.turns, self.seeds = generator, turns, {}

    async def run(self, task_id, episode_id, group_id, *, evaluate=False, resume=None, recorder=None, seed=None):
        self.seeds[episode_id] = seed
        k = int(episode_id.rsplit("-", 1)[1])
        ids, versions = [1], [-1]
        for _ in range(self.turns[k]):
            r = await self.generator.generate(ids, SamplingParams(max_new_tokens=1), session_id=episode_id)
            ids += r.output_ids
            versions += r.weight_versions
        traj = Trajectory(episode_id, task_id, group_id, 1, ids, [0] + [1] * (len(ids) - 1),
                          [0.0] * len(ids), versions, "scored", 1.0, self.turns[k])
        return traj, EpisodeSummary(episode_id, task_id, group_id, "scored", 1.0, len(ids), len(ids) - 1,
                                    self.turns[k], traj.oldest_version, evaluate, 0.0)


class ListBuffer:
    def __init__(self):
        self.added = []

        class _Add:
            @staticmethod
            async def remote(traj):
                self.added.append(traj)
                return True

        self.add = _Add


def make_worker(turns: list[int], engine: SlowEngine) -> EpisodeWorker:
    w = EpisodeWorker(load_config("local", []).model_dump(mode="json"), ["http://unused"], "buf", "run", 0, "/tmp")
    w.tally = GenerationTally(engine)
    w.runner = TurnsRunner(w.tally, turns)
    w.buffer = ListBuffer()
    return w


def test_the_worker_reports_each_groups_oldest_known_version_and_cancels_it_with_its_tokens_counted():
    async def go():
        engine = SlowEngine()
        w = make_worker([2, 1000], engine)  # episode 0 finishes, episode 1 runs on
        run = asyncio.ensure_future(w.run_group("t", "gA", 2, False, None, [11, 22]))
        while w.tally.tokens.get("gA-1", 0) < 5:
            await asyncio.sleep(0.01)
        engine.version = 3  # later tokens are newer: the oldest known stays 0
        await asyncio.sleep(0.05)
        assert w.oldest_versions() == {"gA": 0}
        assert w.tokens_in_flight() == w.tally.tokens["gA-1"] > 0  # the finished episode no longer counts
        assert w.cancel_group("gA", "stale_cancelled_lag_3")
        summaries = await asyncio.wait_for(run, 5)
        assert [s["outcome"] for s in summaries] == ["scored", CANCELLED]
        cancelled = summaries[1]
        assert cancelled["generated"] > 5 and cancelled["error"] == "stale_cancelled_lag_3"
        assert cancelled["oldest_version"] == 0
        assert [t.episode_id for t in w.buffer.added] == ["gA-0"]  # the cancelled one sent nothing
        assert w.runner.seeds == {"gA-0": 11, "gA-1": 22}
        assert w.oldest_versions() == {} and w.tally.tokens == {}  # nothing left behind
        assert not w.cancel_group("gA", "again")  # not running any more

    asyncio.run(go())


def test_cancelling_a_group_whose_episodes_have_not_started_still_returns_their_summaries():
    async def go():
        w = make_worker([50, 50], SlowEngine())
        run = asyncio.ensure_future(w.run_group("t", "gB", 2, False, None, None))
        await asyncio.sleep(0)  # the episodes are scheduled, not yet started
        assert w.cancel_group("gB", "why")
        summaries = await asyncio.wait_for(run, 5)
        assert [s["outcome"] for s in summaries] == [CANCELLED, CANCELLED]
        assert all(s["generated"] == 0 for s in summaries)

    asyncio.run(go())


def test_shutdown_still_cancels_a_group_run_and_eval_groups_are_never_reported():
    async def go():
        w = make_worker([1000], SlowEngine())
        ev = asyncio.ensure_future(w.run_group("t", "eval0-t", 1, True))
        run = asyncio.ensure_future(w.run_group("t", "gC", 1))
        await asyncio.sleep(0.05)
        assert set(w.oldest_versions()) == {"gC"}
        run.cancel()
        ev.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(go())


# -- the buffer ----------------------------------------------------------------------------------


def traj(gid: str, k: int, version: int = 0) -> Trajectory:
    return Trajectory(f"{gid}-{k}", "t", gid, 1, [1, 2], [0, 1], [0.0, -0.1], [-1, version], "scored", 1.0, 1)


def test_the_buffer_retires_a_cancelled_group_once_accounts_for_its_trajectories_and_drops_stragglers(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=3, max_staleness=1, fsync=False)
    buf.add(traj("g1", 0))
    assert buf.retire_cancelled("g1", "t", "stale_cancelled_lag_2")
    assert not buf.retire_cancelled("g1", "t", "stale_cancelled_lag_2")  # one fact per group
    buf.add(traj("g1", 1))  # a late straggler of the cancelled group
    assert buf.retire_cancelled("g2", "t2", "stale_cancelled_lag_2")  # nothing accepted: still one fact
    facts = buf.pop_retired()
    assert [(r.group_id, r.task_id, r.reason, r.outcomes) for r in facts] == [
        ("g1", "t", "stale_cancelled_lag_2", ("scored",)), ("g2", "t2", "stale_cancelled_lag_2", ())]
    assert buf.stats()["cancelled_groups"] == 2 and buf.stats()["pending_groups"] == 0
    audit = audit_log(tmp_path)
    assert audit.untrained_trajectories == [] and audit.counts()["in_retired_groups"] == 1  # nothing acknowledged lost


def test_a_group_taken_for_training_is_not_retired_by_a_late_cancel(tmp_path):
    buf = ReplayBuffer(tmp_path, group_size=1, max_staleness=1, fsync=False)
    buf.add(traj("g1", 0, version=1))
    batch = buf.take_batch(1, current_version=1)
    assert batch is not None and not buf.retire_cancelled("g1", "t", "late")
    buf.mark_trained(1, batch.batch_id)
    assert not buf.retire_cancelled("g1", "t", "late") and buf.pop_retired() == []
