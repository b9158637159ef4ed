"""The capacity model: parameter counts, per-GPU memory of the reference plan, the loop simulation's
scheduling rules, and the launcher's --dry-run memory table."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.config.loader import load_config
from agentrl.config.memory import engine_memory, param_counts, trainer_memory
from agentrl.config.plan import resolve_plan
from bench.capacity import Assumptions, plan_capacity
from bench.loop_sim import LoopShape, empirical_draw, lognormal_draw, simulate, summarize

ROOT = Path(__file__).resolve().parents[1]


def test_glm5_2_parameter_count_matches_the_published_size():
    pc = param_counts("GLM-5.2")
    assert pc["total"] / 1e9 == pytest.approx(744, rel=0.01)
    assert pc["active"] / 1e9 == pytest.approx(40, rel=0.1)


def test_tiny_parameter_count_matches_the_built_model():
    from agentrl.models.policy import load_policy

    model, _ = load_policy("tiny")
    built = sum(p.numel() for n, p in model.named_parameters() if "mtp" not in n)
    # norms and biases are left out of the analytic count: within 2%
    assert param_counts("tiny")["total"] == pytest.approx(built, rel=0.02)


def test_reference_plan_memory_fits_and_splits_by_role():
    cfg = load_config("glm5_2_tbench2")
    plan = resolve_plan(cfg)
    t = trainer_memory(cfg, plan)
    e = engine_memory(cfg, plan)
    assert t["optimizer_gb"] == 0 and t["optimizer_on_disk_gb_per_gpu"] > 100  # optimizer on node-local disk
    # fp32 grads of the trainable bf16 weights; the frozen DSA indexer and MTP layer (~5%) have none
    assert t["grads_gb"] == pytest.approx(2 * t["weights_gb"], rel=0.1) and t["grads_gb"] < 2 * t["weights_gb"]
    assert 100 < t["total_gb"] < 288 and e["weights_gb"] + e["kv_pool_gb"] == pytest.approx(0.85 * 288)
    # optimizer in HBM instead would not fit the busiest stage
    cfg.train.optimizer.offload = "none"
    assert trainer_memory(cfg, plan)["total_gb"] > 288


def test_plan_estimate_has_every_term():
    cfg = load_config("glm5_2_tbench2")
    r = plan_capacity(cfg, resolve_plan(cfg), Assumptions(steps_simulated=10))
    s = r["step"]
    assert s["trainer_step_s"] == pytest.approx(s["compute_s"] + s["optimizer_disk_s"] + s["weight_sync_s"])
    assert r["loop"]["async"]["staleness_max"] <= cfg.buffer.max_staleness
    assert r["loop"]["speedup"] > 1
    assert r["episode_median_matching_reference_s"] is None or r["episode_median_matching_reference_s"] > 0


def test_sync_waits_for_the_slowest_episode_and_async_overlaps():
    shape = LoopShape(groups_per_step=2, group_size=2, max_staleness=2, in_flight=16, step_s=1.0, steps=5)
    durations = iter([1.0, 9.0, 1.0, 1.0] * 100)
    sync = simulate("sync", shape, lambda: next(durations))
    assert sync["wall_s"] == pytest.approx(5 * (9.0 + 1.0))  # each step: slowest of 4, then train
    a = summarize(simulate("async", shape, lognormal_draw(3.0, 1.0, 30.0, rng=random.Random(1))), 5)
    s = summarize(simulate("sync", shape, lognormal_draw(3.0, 1.0, 30.0, rng=random.Random(1))), 5)
    assert a["wall_s"] < s["wall_s"] and a["staleness_max"] <= 2 and s["staleness_max"] == 0


def test_async_staleness_never_exceeds_the_bound_and_stale_groups_are_regenerated():
    shape = LoopShape(groups_per_step=4, group_size=4, max_staleness=1, in_flight=64, step_s=0.5, steps=30)
    r = simulate("async", shape, lognormal_draw(2.0, 1.5, 60.0, rng=random.Random(0)))
    assert max(r["staleness"]) <= 1 and r["regenerated_groups"] > 0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="mode"):
        simulate("both", LoopShape(1, 1, 0, 1, 1.0, 1), lambda: 1.0)
    with pytest.raises(ValueError, match="in_flight"):
        simulate("async", LoopShape(1, 4, 0, 2, 1.0, 1), lambda: 1.0)
    with pytest.raises(ValueError, match="measured"):
        empirical_draw([])


def test_dry_run_shows_the_memory_table_and_json_has_it():
    launcher = [sys.executable, str(ROOT / "launchers" / "run_glm5_2_daytona.py"), "train", "--num-nodes", "16"]
    text = subprocess.run(launcher + ["--dry-run"], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "memory estimate per GPU" in text and "on disk" in text and "KV pool" in text
    js = json.loads(subprocess.run(launcher + ["--dry-run", "--json"], capture_output=True, text=True, check=True,
                                   cwd=ROOT).stdout)
    mem = js["memory_estimate_gb_per_gpu"]
    assert mem["trainer"]["total_gb"] > 0 and mem["engine"]["kv_pool_gb"] > 0
