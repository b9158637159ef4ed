"""The partial-rollout benchmark and the GPU async-vs-sync script, their CPU parts: each variant's
workload maps onto a valid run config (off: defaults; mask / tis: partial rollout, pause abort),
the headline compares trained tokens per second, the turns env plays a replayable episode, and the
GPU script resolves an H200 plan and says what a CPU machine lacks without running anything."""

from __future__ import annotations

import pytest

from agentrl.config.loader import load_config
from agentrl.config.plan import resolve_plan
from agentrl.envs.base import Action
from bench.async_sync import _headline
from bench.partial import PartialWorkload, headline, overrides, run_partial_bench
from bench.turns_env import ENV_NAME, TurnsEnv


@pytest.mark.parametrize(("variant", "partial", "pause", "stale"),
                         [("off", False, "retract", "mask"), ("mask", True, "abort", "mask"),
                          ("tis", True, "abort", "tis")])
def test_each_variant_is_a_valid_run_config(tmp_path, variant, partial, pause, stale):
    w = PartialWorkload(steps=3, max_staleness=2)
    cfg = load_config("local", overrides(w, variant, tmp_path / variant))
    resolve_plan(cfg)
    assert cfg.env.name == ENV_NAME and cfg.mode == "async" and cfg.buffer.max_staleness == 2
    assert (cfg.rollout.partial, cfg.rollout.pause_mode, cfg.algorithm.stale_tokens) == (partial, pause, stale)
    assert cfg.agent.max_turns == w.max_turns and cfg.rollout.max_new_tokens == w.tokens_per_turn


def test_only_the_lead_variants_admit_ahead_and_only_partial_rollout_may(tmp_path):
    w = PartialWorkload(steps=3, partial_lead_steps=3)
    leads = {v: load_config("local", overrides(w, v, tmp_path / v)).rollout.partial_lead_steps
             for v in ("off", "mask", "tis", "mask_lead", "tis_lead")}
    assert leads == {"off": 0, "mask": 0, "tis": 0, "mask_lead": 3, "tis_lead": 3}
    with pytest.raises(ValueError, match="rollout.partial_lead_steps=2 admits groups beyond"):
        load_config("local", ["rollout.partial_lead_steps=2"])


def test_bad_workloads_and_variants_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="in_flight"):
        run_partial_bench(tmp_path / "x.json", PartialWorkload(in_flight=2))
    with pytest.raises(ValueError, match="variants"):
        run_partial_bench(tmp_path / "x.json", variants=("on",))


def test_headline_is_the_gain_in_trained_tokens_per_second():
    h = headline({"off": {"trained_tokens_per_s": 100.0}, "mask": {"trained_tokens_per_s": 125.0},
                  "tis": {"trained_tokens_per_s": 110.0}})
    assert h["throughput_gain_mask"] == pytest.approx(0.25) and h["goal_met"]
    assert h["throughput_gain_tis"] == pytest.approx(0.10) and h["goal_met_by"] == ["mask"]
    lead = headline({"off": {"trained_tokens_per_s": 100.0}, "tis": {"trained_tokens_per_s": 105.0},
                     "tis_lead": {"trained_tokens_per_s": 130.0}})
    assert lead["goal_met"] and lead["goal_met_by"] == ["tis_lead"]
    assert not headline({"off": {"trained_tokens_per_s": 100.0}, "mask": {"trained_tokens_per_s": 110.0}})["goal_met"]


async def test_turns_env_plays_the_same_episode_twice():
    env = TurnsEnv(median_turns=4, sigma=0.5, max_turns=9)
    turns = env.draw_turns("g-0")
    assert 1 <= turns <= 9 and turns == TurnsEnv(median_turns=4, sigma=0.5, max_turns=9).draw_turns("g-0")
    replies = ["apple", "kiwi"] * 8
    texts = []
    for _ in range(2):
        obs, seen = await env.reset("turns-1", episode_id="g-0"), []
        for reply in replies:
            obs = await env.step(Action(text=reply))
            seen.append(obs.text)
            if obs.done:
                break
        texts.append(seen)
    assert texts[0] == texts[1] and len(texts[0]) == turns
    score = await env.score()
    assert score.reward == pytest.approx(sum(r == "apple" for r in replies[:turns]) / turns)
    with pytest.raises(ValueError, match="sandbox provider"):
        await TurnsEnv(sandbox=True).reset("turns-0", episode_id="g-0")


def test_gpu_script_resolves_an_h200_plan_and_says_what_is_missing(capsys):
    import json

    import torch

    from bench.gpu.async_vs_sync_gpu import main

    rc = main(["--check"])
    report = json.loads(capsys.readouterr().out)
    for mode, plan in report["plans"].items():
        assert plan["hardware"] == "H200" and plan["colocated"] and plan["backend"] == "megatron", mode
        assert plan["engine"] == "embedded" and plan["env"].endswith("LognormalEnv")
    if not torch.cuda.is_available():
        assert rc == 1 and any("CUDA" in m or "bwrap" in m for m in report["missing"])
    assert rc == (1 if report["missing"] else 0)


def test_bottleneck_idle_is_the_busier_stage():
    a = {"wall_s": 10.0, "trainer_idle_ratio": 0.4, "engine_idle_ratio": 0.05, "staleness_p95": 2,
         "reward_final": 0.5, "trainer_idle_ratio_after_first_step": 0.3, "episodes_in_flight_mean": 40.0}
    h = _headline({"async": a, "sync": {"wall_s": 30.0, "trainer_idle_ratio": 0.9, "reward_final": 0.5}})
    assert h["bottleneck_idle_ratio_async"] == 0.05 and h["goal_met_bottleneck"] and not h["goal_met"]
    assert h["episodes_in_flight_mean_async"] == 40.0


def test_a_variant_is_the_mean_of_its_rounds():
    from bench.partial import MEANS, mean_of_rounds

    base = {k: 1.0 for k in MEANS}
    rounds = [{**base, "variant": "mask", "partial": True, "stale_policy": "mask", "trained_tokens_per_s": 100.0,
               "trained_token_lag_max": 1, "version_spans_max": 2},
              {**base, "variant": "mask", "partial": True, "stale_policy": "mask", "trained_tokens_per_s": 140.0,
               "trained_token_lag_max": 0, "version_spans_max": 3}]
    m = mean_of_rounds(rounds)
    assert m["trained_tokens_per_s"] == 120.0 and m["trained_tokens_per_s_rounds"] == [100.0, 140.0]
    assert m["trained_token_lag_max"] == 1 and m["version_spans_max"] == 3 and len(m["rounds"]) == 2
    with pytest.raises(ValueError, match="repeats"):
        run_partial_bench("x.json", repeats=0)


def test_gpu_partial_script_resolves_h200_plans_for_its_variants(capsys):
    import json

    import torch

    from bench.gpu.partial_gpu import DEFAULT_VARIANTS, main

    rc = main(["--check", "--lead-steps", "3"])
    report = json.loads(capsys.readouterr().out)
    assert tuple(report["plans"]) == DEFAULT_VARIANTS
    for name, plan in report["plans"].items():
        assert plan["hardware"] == "H200" and plan["colocated"] and plan["backend"] == "megatron", name
        assert plan["partial"] == (name != "off") and plan["lead_steps"] == (3 if name.endswith("_lead") else 0)
    if not torch.cuda.is_available():
        assert rc == 1 and report["missing"]
    assert rc == (1 if report["missing"] else 0)


def test_a_goal_met_on_the_mean_is_told_apart_from_one_met_in_every_round():
    # the session-15 shape: +41%, +21%, +13% round by round clears +20% on the mean only
    off = {"trained_tokens_per_s": 118.1, "trained_tokens_per_s_rounds": [109.1, 129.1, 116.0]}
    tis = {"trained_tokens_per_s": 147.0, "trained_tokens_per_s_rounds": [154.3, 155.8, 131.0]}
    steady = {"trained_tokens_per_s": 150.0, "trained_tokens_per_s_rounds": [140.0, 160.0, 145.0]}
    h = headline({"off": off, "tis": tis, "mask": steady})
    assert h["goal_met_by"] == ["mask", "tis"] and h["goal_met_every_round_by"] == ["mask"]
