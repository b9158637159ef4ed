"""The layout planner on every recipe shape of REFERENCE section 1 and the invalid cases."""

import pytest

from agentrl.config.loader import load_config
from agentrl.config.pipeline import auto_split, check_split, PipelineSplitError
from agentrl.config.plan import PlanError, resolve_plan
from agentrl.models.arch import GLM_5_2, GLM_5_2_5LAYER, TINY


def plan(recipe, *sets):
    return resolve_plan(load_config(recipe, list(sets)))


def dims(p):
    return (p.parallel.tp, p.parallel.pp, p.parallel.cp, p.parallel.ep, p.parallel.dp)


def test_glm52_computing_layers():
    layers = GLM_5_2.computing_layers()
    assert layers[:5] == [1, 2, 3, 7, 11] and layers[-1] == 75
    assert len(layers) == 21  # 21 full, 57 shared


def test_reference_agentic_recipe():
    p = plan("glm5_2_tbench2")
    assert (p.train_nodes, p.inference_nodes) == (8, 8)
    assert dims(p) == (2, 4, 4, 8, 1)
    assert p.pp_layer_split == [18, 20, 20, 20]
    assert p.pp_stage_first_layers == [1, 19, 39, 59]
    assert len(p.engines) == 8
    assert all(e.gpus == 4 and len(e.nodes) == 1 for e in p.engines)
    assert sorted(e.nodes[0] for e in p.engines) == list(range(8, 16))
    assert p.backend == "megatron" and p.engine_kind == "sglang"


def test_reference_auto_split_matches_recipe_without_hints():
    p = plan("glm5_2_tbench2", "train.parallel.pp_first_stage_layers=null", "train.parallel.pp_last_stage_layers=null")
    assert p.pp_stage_first_layers == [1, 19, 39, 59]


def test_eight_gpu_variant():
    p = plan("glm5_2_8gpu")
    assert dims(p) == (4, 8, 8, 32, 1)
    assert p.pp_stage_first_layers == [1, 15, 23, 31, 39, 47, 55, 63]
    assert p.pp_layer_split == [14, 8, 8, 8, 8, 8, 8, 16]
    assert len(p.engines) == 64  # 32 inference nodes x two 4-GPU engines


def test_pp8_split_through_overrides():
    p = plan("glm5_2_tbench2", "train.parallel.pp=8", "train.parallel.pp_first_stage_layers=14",
             "train.parallel.pp_last_stage_layers=16")
    assert p.pp_stage_first_layers == [1, 15, 23, 31, 39, 47, 55, 63]
    assert p.parallel.tp * p.parallel.pp * p.parallel.cp * p.parallel.dp == 32


def test_sixteen_h200_nodes_of_eight():
    p = plan("glm5_2_tbench2", "cluster.gpus_per_node=8", "cluster.hardware=H200")
    assert p.train_gpus == 64
    assert dims(p) == (4, 4, 4, 16, 1)
    assert p.pp_stage_first_layers == [1, 19, 39, 59]
    assert len(p.engines) == 16  # two 4-GPU engines per inference node


def test_one_node_five_layer_smoke():
    p = plan("glm5_2_5layer_1node")
    assert (p.train_nodes, p.inference_nodes, p.train_gpus) == (1, 1, 4)
    assert dims(p)[:4] == (4, 1, 1, 4)
    assert p.pp_stage_first_layers == [1]
    assert len(p.engines) == 1 and "--mem-fraction-static" in p.engines[0].command
    assert p.engines[0].command[p.engines[0].command.index("--mem-fraction-static") + 1] == "0.7"


def test_local_cpu():
    p = plan("local")
    assert p.backend == "torch" and p.engine_kind == "embedded"
    assert dims(p) == (1, 1, 1, 1, 1)
    assert p.engines[0].command[:3] == ["agentrl", "engine", "serve"]


def test_split_on_shared_layer_is_rejected_with_valid_starts():
    with pytest.raises(PlanError) as e:
        plan("glm5_2_tbench2", "train.parallel.pp_first_stage_layers=19", "train.parallel.pp_last_stage_layers=19")
    msg = str(e.value)
    assert "layer 20" in msg and "[1, 2, 3, 7, 11, 15, 19, 23" in msg


def test_explicit_split_on_shared_layer():
    with pytest.raises(PipelineSplitError, match="layer 4"):
        check_split(GLM_5_2_5LAYER, [3, 2])


def test_world_not_divisible():
    with pytest.raises(PlanError, match="not divisible"):
        plan("glm5_2_tbench2", "train.parallel.cp=3")


def test_ep_not_dividing_experts():
    with pytest.raises(PlanError, match="256 experts"):
        plan("glm5_2_tbench2", "train.parallel.ep=6")


def test_tp_larger_than_node():
    with pytest.raises(PlanError, match="inside a node"):
        plan("glm5_2_tbench2", "train.parallel.tp=8")


def test_too_few_nodes_for_split():
    with pytest.raises(PlanError, match="no inference node"):
        plan("glm5_2_tbench2", "cluster.train_nodes=16")


def test_stage_sizes_must_sum():
    with pytest.raises(PlanError, match="divide evenly"):
        plan("glm5_2_tbench2", "train.parallel.pp_first_stage_layers=17", "train.parallel.pp_last_stage_layers=20")


def test_engine_wider_than_node_spans_nodes():
    p = plan("glm5_2_tbench2", "rollout.sglang.gpus_per_engine=8")
    assert len(p.engines) == 4 and all(len(e.nodes) == 2 for e in p.engines)
    assert "--nnodes" in p.engines[0].command


def test_engine_not_fitting_nodes():
    with pytest.raises(PlanError, match="gpus_per_engine"):
        plan("glm5_2_tbench2", "rollout.sglang.gpus_per_engine=3")


def test_auto_split_always_valid():
    for pp in (2, 3, 4, 6, 8):
        sizes = auto_split(GLM_5_2, pp)
        assert sum(sizes) == 78 and len(sizes) == pp
        check_split(GLM_5_2, sizes)
    assert auto_split(TINY, 1) == [5]


def test_megatron_on_cpu_is_refused():
    with pytest.raises(PlanError, match="needs GPUs"):
        plan("local", "train.backend=megatron")


def test_sglang_flags_are_0_5_23_names():
    cmd = plan("glm5_2_tbench2").engines[0].command
    assert "--attention-backend" in cmd and cmd[cmd.index("--attention-backend") + 1] == "dsa"
    assert "--dsa-prefill-backend" in cmd and "--dsa-decode-backend" in cmd
    assert not any(a.startswith("--nsa") for a in cmd)
    for flag in ("--enable-dp-attention", "--kv-cache-dtype", "--page-size", "--watchdog-timeout", "--ep-size"):
        assert flag in cmd
