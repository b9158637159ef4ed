"""The lognormal env: heavy-tailed durations spent in a real sandbox, a learnable reward rule,
named by import path (no entry point), and the `text` action format that hands it the whole reply."""

import math
import shutil
import statistics
import time

import pytest

from agentrl.agent.actions import make_action_format
from agentrl.config.schema import SandboxConfig
from agentrl.envs.base import Action
from agentrl.envs.registry import available_envs, load_env_factory
from bench.lognormal_env import ENV_NAME, LognormalEnv


class _Recorder:
    """A provider whose sandboxes record commands (the fast tests do not need bwrap)."""

    def __init__(self):
        self.commands, self.closed = [], 0

    async def create(self, spec):
        rec = self

        class Box:
            id = "box"

            async def exec(self, command, **kw):
                from agentrl.sandbox.base import ExecResult

                rec.commands.append(command)
                return ExecResult(exit_code=0, output="")

            async def close(self):
                rec.closed += 1

        return Box()


def test_durations_are_lognormal_capped_and_deterministic():
    env = LognormalEnv(_Recorder(), median_s=2.0, sigma=1.0, max_s=30.0)
    draws = [env.draw_duration(f"e{i}") for i in range(4000)]
    assert env.draw_duration("e7") == draws[7]
    assert max(draws) <= 30.0
    assert statistics.median(draws) == pytest.approx(2.0, rel=0.1)
    logs = [math.log(d) for d in draws if d < 30.0]
    assert statistics.pstdev(logs) == pytest.approx(1.0, rel=0.15)
    # heavy tail: the p99 is far beyond the median
    assert sorted(draws)[int(0.99 * len(draws))] > 8 * statistics.median(draws)


async def test_episode_sleeps_in_its_sandbox_and_scores_the_rule():
    prov = _Recorder()
    env = LognormalEnv(prov, median_s=1.0, sigma=0.5, max_s=10.0, target_chars="ae")
    obs = await env.reset("lognormal-1", episode_id="ep-1")
    assert "one word" in obs.text
    step = await env.step(Action(text="  Apple pie"))
    assert step.done
    assert prov.commands == [f"sleep {env.draw_duration('ep-1'):.3f}"]
    verdict = await env.score()
    assert (verdict.reward, verdict.status) == (1.0, "scored")
    await env.close()
    assert prov.closed == 1
    assert env.reward_for("banana") == 0.0 and env.reward_for("   ") == 0.0 and env.reward_for("") == 0.0


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="median_s"):
        LognormalEnv(_Recorder(), median_s=0)
    with pytest.raises(ValueError, match="sandbox provider"):
        LognormalEnv(None)
    with pytest.raises(ValueError, match="unknown task"):
        import asyncio

        asyncio.run(LognormalEnv(_Recorder()).reset("nope"))


def test_named_by_import_path_not_registered_and_text_format_passes_the_reply():
    assert load_env_factory(ENV_NAME) is LognormalEnv
    assert not any("lognormal" in ep.value for ep in available_envs().values())  # no production entry point
    turn = make_action_format("text").parse("<think>x</think> echo hi ")
    assert [a.text for a in turn.actions] == ["echo hi"] and turn.error is None


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
async def test_real_local_sandbox_spends_the_drawn_time(tmp_path):
    from agentrl.sandbox.local import LocalSandboxProvider

    prov = LocalSandboxProvider(SandboxConfig(), "test-lognormal", root_dir=tmp_path)
    env = LognormalEnv(prov, median_s=0.3, sigma=0.0, max_s=5.0)
    try:
        await env.reset("lognormal-0", episode_id="x")
        t0 = time.perf_counter()
        await env.step(Action(text="a"))
        assert time.perf_counter() - t0 >= 0.3
    finally:
        await env.close()
        await prov.aclose()


async def test_context_words_make_a_fixed_per_task_prompt():
    env = LognormalEnv(_Recorder(), context_words=50)
    a = (await env.reset("lognormal-1", episode_id="x")).text
    b = (await env.reset("lognormal-1", episode_id="y")).text
    c = (await env.reset("lognormal-2", episode_id="x")).text
    await env.close()
    assert a == b != c and len(a.split("Context: ")[1].split()) == 50
    with pytest.raises(ValueError, match="context_words"):
        LognormalEnv(_Recorder(), context_words=-1)


async def test_durations_come_from_the_reset_seed_when_there_is_one():
    """Two runs of one seed give their k-th groups the same reset seeds (agentrl/policy/seeding.py):
    the async-vs-sync bench then plays the same durations on both sides, whatever the episode ids."""
    from bench.lognormal_env import LognormalEnv

    env = LognormalEnv(_Recorder(), median_s=1.0, sigma=1.0, max_s=60.0)
    seeds = [11, 12, 13, 2**62]
    durations = [env.draw_duration(f"run-a-{i}", s) for i, s in enumerate(seeds)]
    assert durations == [env.draw_duration(f"run-b-{i}", s) for i, s in enumerate(seeds)]
    assert len(set(durations)) == len(durations)  # the seed is what is drawn from
    assert env.draw_duration("x") == env.draw_duration("x") != env.draw_duration("y")  # no seed: the id
    await env.reset("lognormal-0", episode_id="run-c-0", seed=seeds[0])  # what reset plays is that draw
    assert env.duration_s == durations[0]
    await env.close()
