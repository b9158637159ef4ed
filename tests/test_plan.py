"""The layout planner on every recipe shape of REFERENCE section 1 and the invalid cases."""

import pytest

from agentrl.config.loader import load_config
from agentrl.config.pipeline import auto_split, check_split, PipelineSplitError
from agentrl.config.plan import PlanError, resolve_plan
from agentrl.models.arch import GLM_5_2, GLM_5_2_5LAYER, TINY


def plan(recipe, *sets, runnable=False):
    """Layout arithmetic only (runnable=False): whether the backend trains it is test_capabilities'."""
    return resolve_plan(load_config(recipe, list(sets)), check_runnable=runnable)


def dims(p):
    return (p.layout.tp, p.layout.pp, p.layout.cp, p.layout.ep, p.layout.dp)


def command(cfg_recipe, *sets, engine=0):
    from agentrl.config.show import engine_command_preview

    cfg = load_config(cfg_recipe, list(sets))
    return engine_command_preview(cfg, resolve_plan(cfg, check_runnable=False).engines[engine]).split()


def test_glm52_computing_layers():
    layers = GLM_5_2.computing_layers()
    assert layers[:5] == [1, 2, 3, 7, 11] and layers[-1] == 75
    assert len(layers) == 21  # 21 full, 57 shared


def test_reference_agentic_recipe():
    p = plan("glm5_2_tbench2")
    assert (p.train_nodes, p.inference_nodes) == (8, 8)
    assert dims(p) == (2, 4, 4, 8, 1)
    assert p.layout.pp_split == (18, 20, 20, 20)
    assert p.layout.stage_first_layers == [1, 19, 39, 59]
    assert len(p.engines) == 8
    assert all(e.gpus == 4 and len(e.nodes) == 1 for e in p.engines)
    assert [p.rank_node(r) for r in (0, 3, 4, 31)] == [0, 0, 1, 7]
    assert sorted(e.nodes[0] for e in p.engines) == list(range(8, 16))
    assert p.backend == "megatron" and p.engine_kind == "sglang"


def test_reference_auto_split_matches_recipe_without_hints():
    p = plan("glm5_2_tbench2", "train.parallel.pp_first_stage_layers=null", "train.parallel.pp_last_stage_layers=null")
    assert p.layout.stage_first_layers == [1, 19, 39, 59]


def test_eight_gpu_variant():
    p = plan("glm5_2_8gpu")
    assert dims(p) == (4, 8, 8, 32, 1)
    assert p.layout.stage_first_layers == [1, 15, 23, 31, 39, 47, 55, 63]
    assert p.layout.pp_split == (14, 8, 8, 8, 8, 8, 8, 16)
    assert len(p.engines) == 64  # 32 inference nodes x two 4-GPU engines


def test_pp8_split_through_overrides():
    p = plan("glm5_2_tbench2", "train.parallel.pp=8", "train.parallel.pp_first_stage_layers=14",
             "train.parallel.pp_last_stage_layers=16")
    assert p.layout.stage_first_layers == [1, 15, 23, 31, 39, 47, 55, 63]
    assert p.layout.world == 32


def test_sixteen_h200_nodes_of_eight():
    p = plan("glm5_2_tbench2", "cluster.gpus_per_node=8", "cluster.hardware=H200")
    assert p.train_gpus == 64
    assert dims(p) == (4, 4, 4, 16, 1)
    assert p.layout.stage_first_layers == [1, 19, 39, 59]
    assert len(p.engines) == 16  # two 4-GPU engines per inference node


def test_one_node_five_layer_smoke():
    p = plan("glm5_2_5layer_1node")
    assert (p.train_nodes, p.inference_nodes, p.train_gpus) == (1, 1, 4)
    assert dims(p)[:4] == (4, 1, 1, 4)
    assert p.layout.stage_first_layers == [1]
    cmd = command("glm5_2_5layer_1node")
    assert len(p.engines) == 1 and cmd[cmd.index("--mem-fraction-static") + 1] == "0.7"


def test_local_cpu():
    p = plan("local")
    assert p.backend == "torch" and p.engine_kind == "embedded"
    assert dims(p) == (1, 1, 1, 1, 1)
    assert command("local")[1:5] == ["-m", "agentrl.cli", "engine", "serve"]
    assert p.layout.world == 1 and p.weight_transport == "http_tensors"


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
    with pytest.raises(PlanError, match="256 routed experts"):
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
    cmd = command("glm5_2_tbench2", "rollout.sglang.gpus_per_engine=8")
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--node-rank") + 1] == "0"


def test_engine_not_fitting_nodes():
    with pytest.raises(PlanError, match="gpus_per_engine"):
        plan("glm5_2_tbench2", "rollout.sglang.gpus_per_engine=3")


def test_auto_split_always_valid():
    for pp in (2, 3, 4, 6, 8):
        sizes = auto_split(GLM_5_2, pp)
        assert sum(sizes) == 78 and len(sizes) == pp
        check_split(GLM_5_2, sizes)
    assert auto_split(TINY, 1) == [5]


def test_megatron_on_cpu_takes_the_cpu_trainer_ranks():
    p = plan("local", "train.backend=megatron", "cluster.cpu_trainer_ranks=2", "train.parallel.ep=2")
    assert p.layout.world == 2 and (p.layout.ep, p.layout.dp, p.layout.edp) == (2, 2, 1) and p.gpus_per_rank == 0


def test_torch_backend_refuses_several_ranks_before_anything_starts():
    with pytest.raises(PlanError, match="torch backend trains on one rank"):
        plan("local", "cluster.cpu_trainer_ranks=2", runnable=True)


def test_one_gpu_colocated_smoke():
    p = plan("local", "cluster.gpus_per_node=1", "cluster.hardware=H200", "cluster.colocate=true",
             "train.backend=megatron", "rollout.engine=embedded")
    assert p.layout.world == 1 and p.gpus_per_rank == 0.5 and p.engines[0].gpus_per_node == 0.5
    assert p.train_gpus == 1 and p.colocated


def test_plan_round_trips_through_json():
    from agentrl.config.plan import RunPlan

    p = plan("glm5_2_tbench2")
    assert RunPlan.from_json(p.to_json()) == p


def test_sglang_flags_are_0_5_23_names():
    cmd = command("glm5_2_tbench2")
    assert "--attention-backend" in cmd and cmd[cmd.index("--attention-backend") + 1] == "dsa"
    assert "--dsa-prefill-backend" in cmd and "--dsa-decode-backend" in cmd
    assert not any(a.startswith("--nsa") for a in cmd)
    for flag in ("--attn-dp-size", "--kv-cache-dtype", "--page-size", "--watchdog-timeout", "--ep-size"):
        assert flag in cmd


# -- weight-update precision: the plan carries it and the transport's own table refuses mismatches --
def test_the_reference_recipe_serves_and_sends_fp8():
    plan = resolve_plan(load_config("glm5_2_tbench2"))
    assert plan.serves_fp8 and plan.weight_sync_fp8 and plan.weight_transport == "nccl"
    assert resolve_plan(load_config("local")).serves_fp8 is False  # the embedded engine serves bf16


@pytest.mark.parametrize("sets,field", [
    (["rollout.weight_sync_fp8=false"], "rollout.sglang.quantization=fp8 with bf16 weight updates"),
    (["rollout.sglang.quantization=none"], "rollout.weight_sync_fp8=true sends FP8"),
])
def test_fp8_serving_and_fp8_updates_must_agree(sets, field):
    with pytest.raises(PlanError, match=field.replace(".", r"\.").replace("(", r"\(")):
        resolve_plan(load_config("glm5_2_tbench2", sets))
    resolve_plan(load_config("glm5_2_tbench2", sets), check_runnable=False)  # the arithmetic alone still resolves


def test_cuda_ipc_is_refused_for_a_trainer_of_several_ranks():
    sets = ["cluster.colocate=true", "rollout.weight_transport=cuda_ipc", "rollout.sglang.gpus_per_engine=8"]
    with pytest.raises(PlanError, match="this plan has 8 trainer ranks: use nccl"):
        resolve_plan(load_config("glm5_2_5layer_1node", sets))
