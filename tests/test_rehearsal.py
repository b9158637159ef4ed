"""Placement rehearsal: rank bookkeeping, weight-update schedule, plan checks (fast), and the plans
placed for real on a simulated local Ray cluster (slow)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.cluster.rehearsal_actors import rank_view
from agentrl.cluster.rehearsal_checks import (
    RehearsalError,
    check_gpu_exclusive,
    check_node_capacity,
    check_trainer_reports,
    precheck_plan,
)
from agentrl.cluster.simulated import group_nodes
from agentrl.cluster.rehearsal_ranks import RankLayoutError, check_groups, check_groups_in_node
from agentrl.config.layout import Layout
from agentrl.cluster.rehearsal_weights import (
    WeightScheduleError,
    build_schedule,
    check_schedule,
    model_tensors,
    tensor_stage,
)
from agentrl.config.loader import load_config
from agentrl.config.plan import resolve_plan

LAUNCHER = Path(__file__).resolve().parents[1] / "launchers" / "run_glm5_2_daytona.py"


def launcher(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LAUNCHER), *args], check=False, capture_output=True, text=True,
                          timeout=timeout)


def plan_of(recipe: str, **cluster):
    """Placement only: whether the backend or transport can run a plan is test_plan's business."""
    return resolve_plan(load_config(recipe, [], {"cluster": cluster} if cluster else {}), check_runnable=False)


def layout_of(tp: int, cp: int, dp: int, pp: int, ep: int = 1, etp: int = 1) -> Layout:
    return Layout(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp, pp_split=(1,) * pp)


@pytest.fixture(scope="module")
def ref_plan():
    return plan_of("glm5_2_tbench2")


def test_rank_coords_follow_megatron_order(ref_plan):
    lay = ref_plan.layout
    assert (lay.tp, lay.cp, lay.dp, lay.pp, lay.ep, lay.edp) == (2, 4, 1, 4, 8, 1)
    coords = lay.all_coords()
    # tp fastest, then cp, then dp, pp outermost; experts: ep fastest (etp=1) within a stage
    assert coords[1].tp == 1 and coords[2].cp == 1 and coords[8].pp == 1 and coords[31].pp == 3
    assert [c.ep for c in coords[:8]] == list(range(8)) and coords[8].ep == 0


@pytest.mark.parametrize("tp,cp,dp,pp,ep,etp", [(2, 4, 1, 4, 8, 1), (4, 8, 1, 8, 32, 1), (2, 2, 2, 2, 4, 2)])
def test_groups_match_megatron_rank_generator(tp, cp, dp, pp, ep, etp):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    world = tp * cp * dp * pp
    lay = layout_of(tp, cp, dp, pp, ep, etp)
    assert lay.edp == world // pp // (ep * etp)
    ours = lay.groups()
    check_groups(ours, lay)
    dense = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expert = parallel_state.RankGenerator(tp=etp, ep=ep, dp=lay.edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for kind in ("tp", "cp", "dp", "pp"):
        assert ours[kind] == dense.get_ranks(kind), kind
    assert ours["ep"] == expert.get_ranks("ep")
    assert ours["etp"] == expert.get_ranks("tp")
    assert ours["edp"] == expert.get_ranks("dp")


def test_tp_group_across_nodes_is_refused():
    lay = layout_of(2, 1, 4, 1)
    groups = lay.groups()
    check_groups_in_node(groups["tp"], {r: r // 4 for r in range(8)}, "tensor-parallel")
    # 3 GPUs per node: ranks 2 and 3 form a TP group split over nodes 0 and 1
    with pytest.raises(RankLayoutError, match=r"tensor-parallel group of ranks \[2, 3\] spans nodes \[0, 1\]"):
        check_groups_in_node(groups["tp"], {r: r // 3 for r in range(8)}, "tensor-parallel")


def test_inconsistent_rank_view_is_refused(ref_plan):
    lay = ref_plan.layout
    layout_json = lay.to_json()
    reports = [rank_view(r, layout_json) for r in range(lay.world)]
    coords, groups = lay.all_coords(), lay.groups()
    nodes = {r: r // 4 for r in range(lay.world)}
    check_trainer_reports(reports, coords, lay, groups, nodes)
    # rank 5 started with CP2 x DP2 instead of CP4: its cp group differs from its peers'
    reports[5] = rank_view(5, {**layout_json, "cp": 2, "dp": 2})
    with pytest.raises(RehearsalError, match="trainer rank 5 computed coordinates"):
        check_trainer_reports(reports, coords, lay, groups, nodes)


def test_gpu_sharing_and_node_capacity_are_refused():
    a = {"name": "trainer rank 0", "node_id": "n1", "node": 0, "gpu_ids": [0], "gpus": 1}
    b = {"name": "engine 0", "node_id": "n1", "node": 0, "gpu_ids": [1, 2], "gpus": 2}
    check_gpu_exclusive([a, b])
    with pytest.raises(RehearsalError, match="engine 0 and engine 1 share GPU 2 of node 0"):
        check_gpu_exclusive([a, b, {**b, "name": "engine 1", "gpu_ids": [2, 3]}])
    with pytest.raises(RehearsalError, match="was given GPUs \\[\\] but needs 1"):
        check_gpu_exclusive([{**a, "gpu_ids": []}])
    with pytest.raises(RehearsalError, match="node 0 was given actors holding 5 GPUs; it has 4"):
        check_node_capacity([a, {**b, "gpus": 4}], 4)


def test_weight_schedule_sends_every_tensor_once_per_engine(ref_plan):
    lay = ref_plan.layout
    coords, groups = lay.all_coords(), lay.groups()
    tensors = model_tensors("GLM-5.2")
    names = [t.name for t in tensors]
    assert len(names) == len(set(names))
    # 78 layers + the MTP layer, per-expert names, fp32 router bias; MTP embed/head aliases not sent
    assert "model.layers.78.mlp.experts.255.down_proj.weight" in names
    assert "model.layers.78.embed_tokens.weight" not in names
    assert 1.3e12 < sum(t.nbytes for t in tensors) < 1.6e12  # ~753 B params in BF16
    ugroups, buckets = build_schedule(tensors, ref_plan, coords, lay, groups, bucket_bytes=1 << 30)
    check_schedule(tensors, ref_plan, ugroups, buckets, coords)
    assert [g.sender for g in ugroups] == [0, 8, 16, 24]  # tp = cp = dp = 0 rank of every stage
    assert all(g.world_size == 1 + 8 * 4 for g in ugroups)
    assert all(b.nbytes <= 1 << 30 or len(b.tensors) == 1 for b in buckets)
    first = buckets[0]
    assert first.tensors[0] == "model.embed_tokens.weight" and first.sources == [0, 1]  # its TP group
    assert tensor_stage("model.layers.18.input_layernorm.weight", ref_plan.layout.stage_first_layers, 78) == 1
    # a bucket sent by two stages reaches every engine twice
    dup = copy.deepcopy(buckets)
    dup.append(copy.deepcopy(dup[0]))
    dup[-1].stage, dup[-1].sender = 0, 0
    with pytest.raises(WeightScheduleError, match="twice"):
        check_schedule(tensors, ref_plan, ugroups, dup, coords)
    with pytest.raises(WeightScheduleError, match="miss"):
        check_schedule(tensors, ref_plan, ugroups, buckets[1:], coords)


def test_precheck_passes_the_recipes():
    for plan in (plan_of("glm5_2_tbench2"), plan_of("glm5_2_8gpu"), plan_of("glm5_2_tbench2", num_nodes=32,
                                                                            train_nodes=16)):
        assert precheck_plan(plan).world == plan.train_gpus


def _too_few_inference_nodes(plan):
    bad = copy.deepcopy(plan)
    bad.node_roles = bad.node_roles[:12]  # 4 inference nodes left for 8 engines
    bad.num_nodes, bad.inference_nodes = 12, 4
    return bad


def _engine_wider_than_node(plan):
    import dataclasses

    bad = copy.deepcopy(plan)
    bad.engines[0] = dataclasses.replace(bad.engines[0], gpus_per_node=8.0)  # one node of 4 GPUs
    return bad


def test_wrong_plans_fail_with_clear_messages(ref_plan):
    with pytest.raises(RehearsalError, match=r"engine 4 is placed on node\(s\) \[12\], which are not inference "
                                             r"nodes.*too few inference nodes for 8 engines"):
        precheck_plan(_too_few_inference_nodes(ref_plan))
    with pytest.raises(RehearsalError, match="engine 0 needs 8 GPUs on node 8, wider than a node of 4 GPUs"):
        precheck_plan(_engine_wider_than_node(ref_plan))
    cpu = plan_of("local")
    with pytest.raises(RehearsalError, match="gpus_per_node=0"):
        precheck_plan(cpu)


def test_raylets_group_nodes_of_one_role(ref_plan):
    raylets = group_nodes(ref_plan, 8)
    assert [(r.role, r.nodes, r.gpus) for r in raylets] == [("train", list(range(8)), 32),
                                                            ("inference", list(range(8, 16)), 32)]
    assert len(group_nodes(ref_plan, 3)) == 6 and len(group_nodes(ref_plan, 1)) == 16


# -- on a simulated Ray cluster ----------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_root():
    # A short root (Ray's socket paths must stay under 107 characters) owned by this module: a
    # later ray.init in the same process can recreate an earlier run's empty session folder.
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="arh-", dir="/tmp")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def rehearse_in(ray_root):
    from agentrl.cluster.rehearsal import rehearse

    return lambda plan, **kw: rehearse(plan, temp_root=ray_root, **kw)


def _assert_passed(rep, plan):
    trainers = [p for p in rep["placements"] if p["kind"] == "trainer"]
    engines = [p for p in rep["placements"] if p["kind"] == "engine"]
    assert len(trainers) == plan.train_gpus and len(engines) == len(plan.engines)
    engine_parts = [p for p in rep["placements"] if p["kind"] in ("engine", "engine-node")]
    gpus = [(p["raylet"], g) for p in trainers + engine_parts for g in p["gpu_ids"]]
    assert len(gpus) == len(set(gpus)) == plan.train_gpus + sum(e.gpus for e in plan.engines)
    assert all(p["role"] == "train" for p in trainers) and all(p["role"] == "inference" for p in engine_parts)
    placed = {p["engine"]: p["node"] for p in engines}
    if rep["cluster"]["nodes_per_raylet"] > 1:  # pinned: exactly the plan's nodes
        assert placed == {e.index: e.nodes[0] for e in plan.engines} and not rep["notes"]
    else:  # Ray's PACK chose: some inference node each, mismatches noted
        assert sorted(placed.values()) == sorted(e.nodes[0] for e in plan.engines)
        assert len(rep["notes"]) == sum(placed[e.index] != e.nodes[0] for e in plan.engines)
    assert len(rep["weights"]["update_groups"]) == plan.layout.pp


def test_launcher_rehearse_refuses_a_cpu_plan():
    r = launcher("train", "--num-nodes", "1", "--model-name", "tiny", "--rehearse")
    assert r.returncode == 1
    assert "rehearsal FAILED" in r.stdout and "gpus_per_node=0" in r.stdout


@pytest.mark.slow
def test_reference_recipe_rehearses_with_one_actor_per_gpu(ref_plan):
    r = launcher("train", "--num-nodes", "16", "--rehearse", "--json", "--set", "cluster.episode_workers=2",
                 timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rep = json.loads(r.stdout)
    _assert_passed(rep, ref_plan)
    assert rep["cluster"]["probe"] == "actors"
    assert len([p for p in rep["placements"] if p["kind"] == "episode-worker"]) == 2
    tp_nodes = {}
    for p in rep["placements"]:
        if p["kind"] == "trainer":
            tp_nodes.setdefault((p["coords"]["pp"], p["coords"]["cp"], p["coords"]["dp"]), set()).add(p["node"])
    assert len(tp_nodes) == 16 and all(len(n) == 1 for n in tp_nodes.values())
    assert set(rep["timings"]["shutdown"]) == {"workers_s", "engines_s", "trainers_s", "buffer_s", "cluster_s"}


def test_report_table():
    from agentrl.cluster.rehearsal_report import format_report

    rep = {"plan": {"model": "GLM-5.2", "num_nodes": 2, "gpus_per_node": 2, "train_nodes": 1, "inference_nodes": 1,
                    "train_gpus": 2, "engines": 1, "rank_order": "tp-cp-ep-dp-pp",
                    "parallel": {"tp": 2, "cp": 1, "dp": 1, "pp": 1, "ep": 2, "etp": 1, "edp": 1}},
           "cluster": {"nodes_per_raylet": 1, "raylets": [{}, {}], "probe": "actors"},
           "placements": [{"name": f"trainer rank {r}", "kind": "trainer", "node": 0, "role": "train", "rank": r,
                           "gpu_ids": [r], "coords": {"pp": 0, "cp": 0, "dp": 0}} for r in range(2)]
           + [{"name": "engine 0", "kind": "engine", "node": 1, "role": "inference", "gpu_ids": [0, 1]},
              {"name": "replay buffer", "kind": "buffer", "raylet": "head", "gpu_ids": []}],
           "weights": {"tensors": 3, "bytes": 2**30, "bucket_bytes": 256 << 20,
                       "update_groups": [{"name": "agentrl-weights-pp0", "stage": 0, "sender": 0, "world_size": 3}],
                       "buckets": [{"stage": 0, "sources": [0, 1], "bytes": 2**30, "first": "a", "last": "c"}]},
           "timings": {"startup": {"cluster_start_s": 1.0}, "shutdown": {"cluster_s": 0.5}}, "checks": ["x"]}
    out = format_report(rep)
    assert "PASSED" in out and "trainer ranks 0-1 on GPUs 0-1" in out and "engine 0 on GPUs 0-1" in out
    assert "trainer rank 0 (gathering from ranks 0-1) -> 2 engine ranks; 1 buckets" in out
    assert "head  cpu        replay buffer" in out


@pytest.mark.slow
def test_unpinned_placement_one_raylet_per_node(rehearse_in):
    # Ray's PACK chooses the nodes (no agentrl_node_<i> pins), as on a real cluster.
    plan = resolve_plan(load_config("glm5_2_5layer_1node", ["train.parallel.tp=2", "rollout.sglang.gpus_per_engine=2"],
                                    {"cluster": {"num_nodes": 4, "train_nodes": 2, "gpus_per_node": 2}}),
                        check_runnable=False)
    rep = rehearse_in(plan, nodes_per_raylet=1)
    _assert_passed(rep, plan)
    assert len(rep["cluster"]["raylets"]) == 4


@pytest.mark.slow
@pytest.mark.parametrize("recipe,cluster", [("glm5_2_8gpu", {}), ("glm5_2_tbench2", {"num_nodes": 32, "train_nodes": 16})])
def test_variants_rehearse(recipe, cluster, rehearse_in):
    plan = plan_of(recipe, **cluster)
    rep = rehearse_in(plan)
    _assert_passed(rep, plan)
    assert rep["cluster"]["probe"] == "tasks"


@pytest.mark.slow
def test_ray_refuses_an_engine_wider_than_a_node(ref_plan, rehearse_in):
    bad = _engine_wider_than_node(ref_plan)
    bad.engines = bad.engines[:1]
    with pytest.raises(RehearsalError, match="could not place engine 0.* lack the capacity"):
        rehearse_in(bad, precheck=False, placement_timeout_s=5)


@pytest.mark.slow
def test_engine_spanning_two_nodes(rehearse_in):
    # one 4-GPU engine over two 2-GPU inference nodes: its first bundle holds the EngineActor, the
    # second a process for SGLang node_rank 1, each with its node's GPUs
    plan = resolve_plan(load_config("glm5_2_5layer_1node", ["train.parallel.tp=2", "rollout.sglang.gpus_per_engine=4"],
                                    {"cluster": {"num_nodes": 4, "train_nodes": 2, "gpus_per_node": 2}}),
                        check_runnable=False)
    assert [e.nodes for e in plan.engines] == [[2, 3]]
    rep = rehearse_in(plan)
    _assert_passed(rep, plan)
    parts = [(p["kind"], p["node"], len(p["gpu_ids"])) for p in rep["placements"] if p.get("engine") == 0]
    assert sorted(parts) == [("engine", 2, 2), ("engine-node", 3, 2)]
    assert rep["weights"]["update_groups"][0]["world_size"] == 1 + 4
