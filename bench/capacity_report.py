"""`agentrl bench capacity`: the capacity model for a plan plus its validation.

Validation, where the model can be checked here:
- parameter counts: the analytic count of the tiny GLM against the parameters of the model
  actually built, and GLM-5.2's against its published 744 B total / 40 B active;
- the loop model (loop_sim.py): fed each mode's measured episode durations and trainer time
  from a local async-vs-sync run, its predicted wall clock, trainer idle ratio and staleness
  p95 against what that run measured;
- the 16-node plan: predicted step time against the reference's ~6.5 min per step, and the episode
  median at which the two agree.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from agentrl.config.memory import param_counts
from bench.capacity import Assumptions, plan_capacity
from bench.loop_sim import LoopShape, empirical_draw, simulate, summarize
from bench.machine import machine


def check_param_counts() -> dict:
    from agentrl.models.policy import load_policy

    model, _ = load_policy("tiny")
    built = sum(p.numel() for n, p in model.named_parameters() if "mtp" not in n)
    tiny = param_counts("tiny")["total"]
    glm = param_counts("GLM-5.2")
    return {"tiny_predicted": tiny, "tiny_built": built, "tiny_error": tiny / built - 1,
            "glm5_2_total_b": glm["total"] / 1e9, "glm5_2_total_published_b": 744.0,
            "glm5_2_active_b": glm["active"] / 1e9, "glm5_2_active_published_b": 40.0}


def validate_loop(measured: dict, seed: int = 0) -> dict:
    """Predicted vs measured for every mode of a local async-vs-sync report."""
    w = measured["workload"]
    out = {}
    for mode, m in measured["modes"].items():
        durations = m.get("episode_durations_s") or []
        if not durations or not m["steps"]:
            continue
        shape = LoopShape(w["prompts_per_step"], w["group_size"], w["max_staleness"], w["in_flight"],
                          m["trainer_busy_s"] / m["steps"], m["steps"])
        preds = [summarize(simulate(mode, shape, empirical_draw(durations, random.Random(seed + i))), m["steps"])
                 for i in range(20)]
        mean = {k: sum(p[k] for p in preds) / len(preds) for k in ("wall_s", "trainer_idle_ratio", "staleness_p95")}
        out[mode] = {"predicted": mean, "measured": {"wall_s": m["wall_s"], "trainer_idle_ratio": m["trainer_idle_ratio"],
                                                      "staleness_p95": m["staleness_p95"]},
                     "wall_error": mean["wall_s"] / m["wall_s"] - 1}
    if "sync" in out and "async" in out:
        out["speedup"] = {"predicted": out["sync"]["predicted"]["wall_s"] / out["async"]["predicted"]["wall_s"],
                          "measured": measured.get("speedup")}
        s, a = measured["modes"]["sync"], measured["modes"]["async"]
        # What-ifs: async with the episode durations measured in SYNC mode, where rollouts did not
        # share the CPU with 95 other episodes and the trainer (as on separate machines), and the
        # trainer time per step measured in either mode.
        out["async_if_episodes_uncontended"] = {
            f"trainer_step_as_in_{mode}": _what_if(measured, s["episode_durations_s"], m["trainer_busy_s"] / m["steps"],
                                                   seed)
            for mode, m in (("sync", s), ("async", a))}
    return out


def _what_if(measured: dict, durations: list[float], trainer_s: float, seed: int) -> dict:
    w, s = measured["workload"], measured["modes"]["sync"]
    shape = LoopShape(w["prompts_per_step"], w["group_size"], w["max_staleness"], w["in_flight"], trainer_s, s["steps"])
    preds = [summarize(simulate("async", shape, empirical_draw(durations, random.Random(seed + i))), s["steps"])
             for i in range(20)]
    wall = sum(p["wall_s"] for p in preds) / len(preds)
    return {"trainer_s_per_step": trainer_s, "wall_s": wall,
            "trainer_idle_ratio": sum(p["trainer_idle_ratio"] for p in preds) / len(preds),
            "speedup_vs_measured_sync": s["wall_s"] / wall,
            "staleness_p95": sum(p["staleness_p95"] for p in preds) / len(preds)}


def run_capacity(out_path: str | Path, config: str, overrides: list[str], a: Assumptions | None = None,
                 measured_path: str | Path | None = None) -> dict:
    from agentrl.config.loader import load_config
    from agentrl.config.plan import resolve_plan

    cfg = load_config(config, overrides)
    plan = resolve_plan(cfg)
    report: dict[str, Any] = {"benchmark": "capacity", "machine": machine(), "config": config, "overrides": overrides,
                              "plan_estimate": plan_capacity(cfg, plan, a or Assumptions()),
                              "params_check": check_param_counts()}
    est = report["plan_estimate"]
    report["reference_check"] = {
        "reference_step_s": est["reference_step_s"], "predicted_async_step_s": est["loop"]["async"]["step_s"],
        "predicted_trainer_step_s": est["step"]["trainer_step_s"],
        "ratio": est["loop"]["async"]["step_s"] / est["reference_step_s"],
        "episode_median_matching_reference_s": est["episode_median_matching_reference_s"]}
    if measured_path is not None:
        measured = json.loads(Path(measured_path).read_text())
        report["local_validation"] = {"source": str(measured_path), **validate_loop(measured)}
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report
