"""Concurrent start-up and the trainer ranks' calls: a rank's death is the error raised, even when
a survivor's collective error arrives first; answers come back in rank order; trainers and engines
start side by side and a failure of either surfaces as itself."""

import asyncio

import pytest

from agentrl.cluster import trainer_group
from agentrl.cluster.trainer_group import gather_ranks


async def _after(delay: float, value=None, error: BaseException | None = None):
    await asyncio.sleep(delay)
    if error is not None:
        raise error
    return value


def test_answers_in_rank_order():
    calls = [_after(0.05, "r0"), _after(0.0, "r1"), _after(0.02, "r2")]
    assert asyncio.run(gather_ranks(calls)) == ["r0", "r1", "r2"]


def test_a_dead_rank_is_named_though_a_survivor_failed_first():
    from ray.exceptions import ActorDiedError

    calls = [_after(0.0, error=RuntimeError("gloo: Connection reset by peer")), _after(0.2, error=ActorDiedError())]
    with pytest.raises(ActorDiedError):
        asyncio.run(gather_ranks(calls))


def test_a_rank_that_never_answers_does_not_hold_the_error(monkeypatch):
    monkeypatch.setattr(trainer_group, "RANK_DEATH_GRACE_S", 0.1)

    async def run():
        stuck = asyncio.Event()  # a survivor blocked in a collective forever
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ValueError, match="bad batch"):
            await gather_ranks([_after(0.0, error=ValueError("bad batch")), stuck.wait()])
        return asyncio.get_running_loop().time() - t0

    assert asyncio.run(run()) < 2.0


def test_start_together_cancels_the_other_and_raises_the_failure_itself():
    """Orchestrator start-up: trainers and engines start side by side; the first failure cancels
    the other start and surfaces as its own type (the launcher handles each type), not a group."""
    from agentrl.orchestrator import _together

    cancelled = []

    async def slow_engines():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append("engines")
            raise

    class TrainerStartError(RuntimeError):
        pass

    async def failing_trainers():
        await asyncio.sleep(0.01)
        raise TrainerStartError("rank 1 could not build its model")

    async def run():
        with pytest.raises(TrainerStartError, match="rank 1"):
            await _together(failing_trainers(), slow_engines())
        return await _together(_after(0.02, "trainers"), _after(0.0, ["http://e0"]))

    assert asyncio.run(run()) == ["trainers", ["http://e0"]]
    assert cancelled == ["engines"]
