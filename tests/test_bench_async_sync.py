"""The async-vs-sync runner: its workload maps onto a valid config, the headline numbers come from
both modes, and (slow) a minimal run of both modes through the real run loop."""

import json

import pytest

from agentrl.config.loader import load_config
from agentrl.config.plan import resolve_plan
from bench.async_sync import Workload, _headline, _idle_after_first, overrides, run_async_vs_sync
from bench.lognormal_env import ENV_NAME


def test_workload_becomes_a_valid_lognormal_run_config(tmp_path):
    w = Workload(steps=3, in_flight=24, median_s=0.5)
    for mode in ("sync", "async"):
        cfg = load_config("local", overrides(w, mode, tmp_path / mode))
        resolve_plan(cfg)
        assert cfg.mode == mode and cfg.env.name == ENV_NAME and cfg.agent.action_format == "text"
        assert cfg.env.kwargs["median_s"] == 0.5 and cfg.buffer.max_episodes_in_flight == 24
        assert cfg.train.max_steps == 3 and cfg.algorithm.prompts_per_step * cfg.algorithm.group_size == w.batch


def test_bad_workload_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="in_flight"):
        run_async_vs_sync(tmp_path / "x.json", Workload(in_flight=2, group_size=4))
    with pytest.raises(ValueError, match="modes"):
        run_async_vs_sync(tmp_path / "x.json", Workload(), modes=("both",))


def test_headline_speedup_and_goal():
    a = {"wall_s": 10.0, "trainer_idle_ratio": 0.05, "staleness_p95": 3, "reward_final": 0.5,
         "trainer_idle_ratio_after_first_step": 0.02}
    s = {"wall_s": 30.0, "trainer_idle_ratio": 0.7, "reward_final": 0.5}
    h = _headline({"async": a, "sync": s})
    assert h["speedup"] == 3.0 and h["goal_met"] and h["staleness_p95"] == 3
    assert not _headline({"async": {**a, "trainer_idle_ratio": 0.2}, "sync": s})["goal_met"]


def test_idle_after_first_step_counts_train_and_sync_time():
    rows = [{"step_time_s": 1.0, "sync_s": 0.5}] * 3
    assert _idle_after_first(rows, [5.0, 7.0, 9.0]) == pytest.approx(1 - 3.0 / 4.0)
    assert _idle_after_first(rows[:1], [5.0]) is None
    # With the stage's own cumulative busy clock in the rows, that clock is used.
    rows = [{"step_time_s": 1.0, "sync_s": 0.5, "trainer_busy_s": b} for b in (2.0, 3.8, 5.6)]
    assert _idle_after_first(rows, [5.0, 7.0, 9.0]) == pytest.approx(1 - 3.6 / 4.0)


@pytest.mark.slow
def test_minimal_run_of_both_modes(tmp_path):
    w = Workload(steps=2, prompts_per_step=2, group_size=2, median_s=0.3, sigma=0.5, max_s=3.0, in_flight=8)
    out = tmp_path / "avs.json"
    r = run_async_vs_sync(out, w, work_dir=tmp_path)
    assert json.loads(out.read_text())["speedup"] == r["speedup"] > 0
    assert out.with_suffix(".png").stat().st_size > 1000
    for mode in ("sync", "async"):
        m = r["modes"][mode]
        assert m["steps"] == 2 and m["trained_samples"] == 8 and 0 <= m["trainer_idle_ratio"] <= 1
        assert m["staleness_max"] <= w.max_staleness and m["episodes_finished"] >= 8
    assert r["modes"]["sync"]["staleness_max"] == 0
