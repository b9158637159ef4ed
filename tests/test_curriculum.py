"""The pass-rate curriculum (agentrl/policy/curriculum.py): bands, mix, EMA, checkpoint state."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from agentrl.config.schema import CurriculumConfig
from agentrl.policy.curriculum import PassRateCurriculum
from agentrl.policy.dynamic_sampling import is_zero_variance


def test_tasks_fall_into_bands_by_their_pass_rate_and_unseen_ones_are_normal():
    c = PassRateCurriculum(["solved", "failed", "half", "new"], seed=0)
    c.observe("solved", [1.0] * 8)
    c.observe("failed", [0.0] * 8)
    c.observe("half", [1.0, 0.0] * 4)
    assert c.bands() == {"hard": ["failed"], "normal": ["half", "new"], "easy": ["solved"]}
    assert c.pass_rate("new") is None and c.pass_rate("half") == 0.5


def test_pass_rate_is_an_ema_and_missing_rewards_are_left_out():
    c = PassRateCurriculum(["t"], ema=0.5)
    c.observe("t", [1.0, 1.0, 0.0, 0.0])
    c.observe("t", [1.0, None, 1.0])  # an infra error is no evidence either way
    assert c.pass_rate("t") == pytest.approx(0.75)
    c.observe("t", [None, None])
    assert c.pass_rate("t") == pytest.approx(0.75) and c.groups["t"] == 2
    latest = PassRateCurriculum(["t"], ema=1.0)  # prime-rl's rule: the latest group only
    latest.observe("t", [1.0])
    latest.observe("t", [0.0])
    assert latest.pass_rate("t") == 0.0
    with pytest.raises(KeyError, match="not a training task"):
        c.observe("eval-task", [1.0])


def test_draws_follow_the_band_mix_whatever_the_band_sizes():
    tasks = [f"hard{i}" for i in range(80)] + [f"norm{i}" for i in range(10)] + [f"easy{i}" for i in range(10)]
    c = PassRateCurriculum(tasks, seed=1, weights={"hard": 0.2, "normal": 0.7, "easy": 0.1})
    for t in tasks:
        c.observe(t, [0.0] * 8 if t.startswith("hard") else [1.0] * 8 if t.startswith("easy") else [1.0, 0.0] * 4)
    drawn = Counter(c.next_task()[:4] for _ in range(20000))
    assert drawn["hard"] / 20000 == pytest.approx(0.2, abs=0.015)
    assert drawn["norm"] / 20000 == pytest.approx(0.7, abs=0.015)
    assert drawn["easy"] / 20000 == pytest.approx(0.1, abs=0.015)
    assert c.metrics()["curriculum_hard_tasks"] == 80.0


def test_an_empty_band_gives_its_share_to_the_others():
    c = PassRateCurriculum(["a", "b"], seed=2)
    c.observe("a", [0.0])
    c.observe("b", [1.0])  # no normal task: hard 0.2 vs easy 0.1 -> 2:1
    drawn = Counter(c.next_task() for _ in range(9000))
    assert drawn["a"] / 9000 == pytest.approx(2 / 3, abs=0.02)
    only_normal_weighted = PassRateCurriculum(["a"], weights={"hard": 0.0, "normal": 1.0, "easy": 0.0})
    only_normal_weighted.observe("a", [0.0])
    assert only_normal_weighted.next_task() == "a"  # every band weighted 0 holds no task: any task


def test_the_curriculum_finds_more_groups_with_signal_than_round_robin():
    """The point of it: with mostly unsolvable tasks, more groups of 8 have reward variance."""
    truth = {f"t{i}": (0.0 if i < 80 else 0.5 if i < 90 else 1.0) for i in range(100)}
    world = random.Random(0)

    def informative_share(next_task, observe) -> float:
        useful = 0
        for _ in range(600):
            task = next_task()
            rewards = [float(world.random() < truth[task]) for _ in range(8)]
            observe(task, rewards)
            useful += not is_zero_variance(rewards)
        return useful / 600

    c = PassRateCurriculum(list(truth), seed=3)
    order = list(truth)
    cycle = iter(order * 10)
    with_curriculum = informative_share(c.next_task, c.observe)
    round_robin = informative_share(lambda: next(cycle), lambda t, r: None)
    assert round_robin < 0.15 and with_curriculum > 0.5


def test_state_dict_round_trips_through_json_and_resumes_the_same_draws():
    tasks = [f"t{i}" for i in range(20)]
    a = PassRateCurriculum(tasks, seed=4)
    for i, t in enumerate(tasks):
        a.observe(t, [float(i % 3 == 0)] * 4)
    for _ in range(7):
        a.next_task()
    state = json.loads(json.dumps(a.state_dict()))
    b = PassRateCurriculum(tasks, seed=999)
    b.load_state_dict(state)
    assert [a.next_task() for _ in range(50)] == [b.next_task() for _ in range(50)]
    assert b.rates == a.rates and b.metrics() == a.metrics()


def test_loading_keeps_only_tasks_still_in_the_set_and_ignores_other_samplers():
    a = PassRateCurriculum(["x", "y"])
    a.observe("x", [1.0])
    a.observe("y", [0.0])
    b = PassRateCurriculum(["y", "z"])
    b.load_state_dict(a.state_dict())
    assert b.rates == {"y": 0.0}
    c = PassRateCurriculum(["x"])
    c.load_state_dict({"kind": "round_robin", "order": ["x"], "position": 3})
    assert c.rates == {}


def test_built_from_the_config_section_and_bad_values_are_named():
    cfg = CurriculumConfig(sampler="pass_rate", ema=1.0, hard_below=0.1, easy_above=0.9, hard_weight=0.0)
    c = PassRateCurriculum.from_config(["a"], cfg, seed=0)
    assert (c.ema, c.hard_below, c.easy_above, c.weights["hard"]) == (1.0, 0.1, 0.9, 0.0)
    with pytest.raises(ValueError, match="hard_below"):
        CurriculumConfig(hard_below=0.8, easy_above=0.5)
    with pytest.raises(ValueError, match="no training task"):
        PassRateCurriculum([])
