"""The planner and the Megatron backend accept exactly the same layouts: every recipe in configs/
and the README's layout variants resolve to a layout that capabilities.backend_refusal accepts, and
the backend's own checks (the Megatron config at that layout, the DSA stage starts Megatron
validates, the sharding's layout checks) accept it too; the layouts capabilities refuses, the
backend refuses as well, and the planner's error is capabilities' sentence."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentrl.config.loader import load_config
from agentrl.config.plan import PlanError, check_plan_runnable, resolve_plan
from agentrl.train.capabilities import backend_refusal

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
README_VARIANTS = [  # README "Layouts"
    ("glm5_2_tbench2", ("train.parallel.pp=8", "train.parallel.pp_first_stage_layers=14",
                        "train.parallel.pp_last_stage_layers=16")),
    ("glm5_2_tbench2", ("cluster.gpus_per_node=8", "cluster.hardware=H200")),
    ("local", ("train.backend=megatron", "cluster.cpu_trainer_ranks=2", "train.parallel.ep=2")),
]
REFUSED = [  # what capabilities refuses, and the field its sentence names
    (("train.parallel.sequence_parallel=false",), "train.parallel.sequence_parallel"),
    (("train.parallel.etp=2", "train.parallel.ep=4"), "train.parallel.etp"),
    (("train.parallel.pp_layer_split=[18,20,16,24]",), "train.parallel.pp_layer_split"),  # starts 1, 19, 39, 55
]


def _backend_accepts(plan) -> str | None:
    """The Megatron backend's own checks that need no process group: None, or its error."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as eav

    from agentrl.models.hf_config import hf_config_for
    from agentrl.models.megatron_builder import transformer_config_from_hf
    from agentrl.models.sharding import check_layout
    from agentrl.train.grouped_experts import GroupedExperts

    hf = hf_config_for(plan.model)
    layout = plan.layout
    try:
        check_layout(hf, layout)
        config = transformer_config_from_hf(hf, layout, recompute="full", use_te=False, bf16=True)
        groups = SimpleNamespace(expt_tp=SimpleNamespace(size=lambda: layout.etp), ep=None, expt_dp=None)
        GroupedExperts(0, replace(config, use_cpu_initialization=True), groups)  # its expert-TP check
        for stage in layout.stages():
            eav._validate_dsa_index_share_pipeline_split(config, stage)
    except (ValueError, AssertionError) as e:
        return str(e)
    return None


def _plans():
    for recipe in RECIPES:
        yield recipe, ()
    yield from README_VARIANTS


@pytest.mark.parametrize(("recipe", "sets"), list(_plans()))
def test_recipe_layouts_are_accepted_by_planner_and_backend(recipe, sets):
    plan = resolve_plan(load_config(recipe, list(sets)), check_runnable=False)
    device = "cuda" if plan.gpus_per_rank else "cpu"
    assert backend_refusal(plan.backend, plan.layout, device) is None, plan.layout.describe()
    if plan.backend == "megatron" and plan.model != "smollm2-135m":
        assert _backend_accepts(plan) is None, plan.layout.describe()


@pytest.mark.parametrize(("sets", "field"), REFUSED)
def test_refused_layouts_are_refused_by_both_with_the_field_named(sets, field):
    cfg = load_config("glm5_2_tbench2", list(sets))
    plan = resolve_plan(cfg, check_runnable=False)
    why = backend_refusal(plan.backend, plan.layout, "cuda")
    assert why is not None and field in why
    with pytest.raises(PlanError, match=field.replace(".", r"\.")):
        check_plan_runnable(plan)
    assert _backend_accepts(plan) is not None
