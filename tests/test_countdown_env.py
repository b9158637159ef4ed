"""The countdown package: one class, deterministic tasks, exact verification."""

from __future__ import annotations

import re

import pytest
from agentrl_countdown import CountdownEnv

from agentrl.envs.base import Action, Env


def test_is_an_env_with_deterministic_tasks():
    a, b = CountdownEnv(num_tasks=50, seed=3), CountdownEnv(num_tasks=50, seed=3)
    assert isinstance(a, Env)
    assert a.task_ids() == b.task_ids() and len(a.task_ids()) == 50
    assert [a.puzzle(t) for t in a.task_ids()] == [b.puzzle(t) for t in b.task_ids()]
    other = CountdownEnv(num_tasks=50, seed=4)
    assert [a.puzzle(t)[0] for t in a.task_ids()] != [other.puzzle(t)[0] for t in other.task_ids()]
    assert a.puzzle("countdown-3-0") == ([8, 21, 14, 23], 66)  # pinned: same on every machine


def test_every_task_is_solvable_by_its_oracle():
    env = CountdownEnv(num_tasks=300, num_numbers=5, max_number=50)
    for task in env.task_ids():
        numbers, target = env.puzzle(task)
        env._numbers = numbers  # check() works on the current puzzle
        assert env.check(env.solution(task)) == target, task
        assert target > 0


async def test_correct_answer_ends_the_episode_with_reward_one():
    env = CountdownEnv(num_tasks=5)
    task = env.task_ids()[2]
    numbers, target = env.puzzle(task)
    first = await env.reset(task, episode_id="e1")
    assert f"Target: {target}" in first.text and ", ".join(map(str, numbers)) in first.text
    obs = await env.step(Action(text=env.solution(task)))
    assert obs.done and obs.metadata["correct"]
    verdict = await env.score()
    assert (verdict.reward, verdict.status, verdict.done) == (1.0, "scored", True)
    assert env.state.step_count == 1 and env.state.task_id == task and env.state.episode_id == "e1"


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ("", "empty"),
        ("2 ** 3", r"only \+ - \* /"),
        ("-{a} + {a}", "only the given integers"),
        ("{a} + {a} + {a} + {a} + {a}", "more often than given"),
        ("{a} / ({a} - {a})", "division by zero|more often"),
        ("__import__('os')", "only the given integers"),
        ("{a} +", "not an arithmetic expression"),
        ("1" * 300, "longer than"),
    ],
)
async def test_invalid_answers_are_explained_and_never_rewarded(answer, why):
    env = CountdownEnv(num_tasks=1, max_attempts=1)
    task = env.task_ids()[0]
    numbers, _ = env.puzzle(task)
    await env.reset(task)
    obs = await env.step(Action(text=answer.format(a=numbers[0])))
    assert obs.done and "Invalid answer" in obs.text
    assert re.search(why, obs.text), obs.text
    assert (await env.score()).reward == 0.0


async def test_wrong_value_is_explained_and_retries_are_bounded():
    env = CountdownEnv(num_tasks=1, max_attempts=2)
    task = env.task_ids()[0]
    numbers, target = env.puzzle(task)
    await env.reset(task)
    wrong = next(str(n) for n in numbers if n != target)  # a valid expression of the wrong value
    obs = await env.step(Action(command=wrong))
    assert not obs.done and f"the target is {target}" in obs.text and "Attempts left: 1" in obs.text
    obs = await env.step(Action(keystrokes=f"{env.solution(task)}\n"))  # terminal-shaped action
    assert obs.done and obs.metadata["correct"]
    assert (await env.score()).reward == 1.0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        await env.step(Action(text="1"))


async def test_division_is_exact():
    env = CountdownEnv(num_tasks=1)
    await env.reset(env.task_ids()[0])
    env._numbers, env._target = [3, 6, 2], 1  # (6 / 3) / 2 = 1 exactly; 3 / 2 is not an integer
    assert env.check("(6 / 3) / 2") == 1
    obs = await env.step(Action(text="3 / 2"))
    assert "3/2 (not an integer)" in obs.text and not obs.metadata["correct"]


async def test_misuse_has_clear_errors():
    with pytest.raises(ValueError, match="num_numbers must be an integer >= 2"):
        CountdownEnv(num_numbers=1)
    env = CountdownEnv(num_tasks=2)
    with pytest.raises(ValueError, match="unknown task id 'countdown-0-9'.*index < 2"):
        await env.reset("countdown-0-9")
    with pytest.raises(RuntimeError, match="before reset"):
        await env.step(Action(text="1"))
    await env.close()
