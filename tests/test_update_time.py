"""The weight-update time model (agentrl.sync.update_time) and its place in --dry-run."""

from __future__ import annotations

import io
import json

import pytest

from agentrl.config.model_shapes import shapes_of
from agentrl.sync.update_time import GOAL_S, PAUSE_S, hf_specs, predict_update, update_estimate


def _reference():
    from agentrl.config.front import resolve_run

    return resolve_run(num_nodes=16, check_runnable=False)


def _same_as_meta_model(name: str) -> None:
    from agentrl.cluster.rehearsal_weights import model_tensors

    assert [(t.name, t.dtype, t.shape) for t in hf_specs(shapes_of(name))] == \
        [(t.name, t.dtype, t.shape) for t in model_tensors(name)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "GLM-5.2"])
def test_analytic_tensor_list_is_the_meta_models(name):
    _same_as_meta_model(name)  # GLM-5.2: 59585 tensors, the MTP layer included; ~20 s to build its meta model


def test_reference_update_is_predicted_stage_by_stage():
    _, plan = _reference()
    fp8 = predict_update(plan, fp8=True, bucket_bytes=2 << 30)
    bf16 = predict_update(plan, fp8=False, bucket_bytes=2 << 30)
    assert [s["stage"] for s in fp8["stages"]] == [0, 1, 2, 3]
    assert [s["layers"] for s in fp8["stages"]] == list(plan.layout.pp_split)
    assert fp8["seconds"] == pytest.approx(sum(s["seconds"] for s in fp8["stages"]) + PAUSE_S)
    assert 740 < fp8["gb_per_engine_gpu"] < 780 and 1490 < bf16["gb_per_engine_gpu"] < 1520  # 753 B params
    assert fp8["link"] == "inter-node NIC" and 70 < fp8["broadcast_gbps"] < 80  # GB300: 100 GB/s NICs
    for s in fp8["stages"]:  # every engine GPU receives the stage: the broadcast is the slowest pipe
        assert s["dominant"] == "broadcast" and s["broadcast_s"] == pytest.approx(s["gb"] / fp8["broadcast_gbps"])
        assert s["gather_nic_s"] < s["broadcast_s"]
    assert fp8["seconds"] < bf16["seconds"] and fp8["goal_s"] == GOAL_S
    assert 9 < fp8["seconds"] < 15, fp8["seconds"]  # ~10 s of broadcast at 75 GB/s, plus bucket overheads
    small = predict_update(plan, fp8=True, bucket_bytes=256 << 20)
    assert small["seconds"] > fp8["seconds"]  # 8x the buckets, each with its round trip


def test_dry_run_json_and_tables_carry_the_estimate():
    from rich.console import Console

    from agentrl.config.loader import load_config
    from agentrl.config.plan import resolve_plan
    from agentrl.config.show import plan_json, print_plan

    cfg, plan = _reference()
    est = json.loads(plan_json(cfg, plan))["weight_update_estimate"]
    assert est["configured"]["fp8"] is cfg.rollout.weight_sync_fp8 and est["other"]["fp8"] is not cfg.rollout.weight_sync_fp8
    assert len(est["configured"]["stages"]) == 4
    out = io.StringIO()
    print_plan(cfg, plan, Console(file=out, width=100))
    text = out.getvalue()
    assert "one full weight update, predicted" in text and f"goal {GOAL_S:g} s" in text
    local = load_config("local")
    assert "unavailable" in update_estimate(local, resolve_plan(local))
