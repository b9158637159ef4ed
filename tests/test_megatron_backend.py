"""Megatron TrainerBackend on CPU (gloo, world of one) against the torch backend on the same batch.

Tolerance for loss parity: both compute the same fp32 math (same weights via mapping.py, same
trajectories, same loss function); only kernels and summation order differ (THD packing vs padded
batches, chunked log-prob chunks). Measured relative difference ~1e-8; the test allows 1e-5, well
below what a wrong mask, shift, temperature or normalisation would give (>= 1e-2).
"""

from __future__ import annotations

import copy

import pytest
import torch

from agentrl.agent.trajectory import Trajectory
from agentrl.config.schema import AlgorithmConfig, TrainConfig
from agentrl.train.packing import PackShape, pack_thd, plan_packs, split_for_data_parallel


def _trajs(n: int = 4, seed: int = 0) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 12 + 3 * i
        ids = torch.randint(7, 1000, (length,), generator=g).tolist()
        out.append(Trajectory(episode_id=f"e{i}", task_id="t", group_id=f"g{i // 2}", prompt_len=6, token_ids=ids,
                              loss_mask=[0] * 6 + [1] * (length - 6),
                              rollout_logprobs=[0.0] * 6 + [-7.0] * (length - 6),
                              weight_versions=[-1] * 6 + [0] * (length - 6), outcome="scored", reward=float(i % 2)))
    return out


# ---------------------------------------------------------------- packing (no Megatron)

def test_packs_respect_the_token_budget_and_cover_every_trajectory():
    lengths = [10, 50, 20, 40, 30, 200, 5]
    packs = plan_packs(lengths, 100)
    assert sorted(i for p in packs for i in p) == list(range(7))
    assert all(len(p) == 1 or sum(lengths[i] for i in p) <= 100 for p in packs)
    assert [5] in packs  # longer than the budget: alone


def test_data_parallel_split_balances_tokens_and_is_a_partition():
    lengths = [100, 90, 10, 10, 50, 40]
    shares = split_for_data_parallel(lengths, 2)
    assert sorted(i for s in shares for i in s) == list(range(6))
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= 10


def test_thd_pack_shifts_targets_within_each_trajectory():
    trajs = _trajs(2)
    pb = pack_thd(trajs, [1.0, -1.0], [0, 1], PackShape(sp_size=4))
    n0, n1 = len(trajs[0].token_ids), len(trajs[1].token_ids)
    assert pb.cu_seqlens.tolist()[:3] == [0, n0, n0 + n1] and pb.num_tokens % 4 == 0
    assert pb.targets[: n0 - 1].tolist() == trajs[0].token_ids[1:]
    assert pb.loss_mask[n0 - 1] == 0  # last position of a trajectory has no target
    assert pb.position_ids[0, n0].item() == 0  # positions restart per trajectory
    assert pb.advantages[n0].item() == -1.0
    assert pb.loss_mask[n0 + n1:].sum() == 0  # filler is masked


# ---------------------------------------------------------------- the backend (world of one, gloo)

@pytest.fixture(scope="module")
def megatron_world():
    import torch.distributed as dist
    from megatron.core import parallel_state

    yield
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _train_cfg(**kw) -> TrainConfig:
    train = TrainConfig(logprob_chunk_tokens=32, dtype=kw.pop("dtype", "float32"))
    train.optimizer.lr = 1e-3
    train.parallel.recompute = kw.pop("recompute", "none")
    train.parallel.max_tokens_per_gpu = kw.pop("max_tokens", 4096)
    for k, v in kw.items():
        setattr(train.optimizer, k, v)
    return train


def test_loss_parity_with_the_torch_backend(megatron_world):
    from agentrl.models.tiny import build_tiny_model
    from agentrl.train.megatron_backend import MegatronBackend
    from agentrl.train.torch_backend import TorchBackend

    model = build_tiny_model(0).float()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    train, algo = _train_cfg(max_tokens=40), AlgorithmConfig(group_size=2)
    tb = TorchBackend(copy.deepcopy(model), train, algo)
    mb = MegatronBackend(model.config, train, algo, hf_state=state)
    exported = dict(mb.named_weights())
    assert set(exported) == set(state)
    assert all(torch.equal(exported[k], state[k]) for k in state)  # HF -> Megatron -> HF is exact
    trajs = _trajs()
    gids = [t.group_id for t in trajs]
    for _ in range(2):
        a, b = tb.train_step(trajs, gids), mb.train_step(trajs, gids)
        assert b["micro_batches"] > 1  # 40-token budget: the batch was split into several THD packs
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert a["loss_tokens"] == b["loss_tokens"]
        assert b["tis_weight_mean"] == pytest.approx(a["tis_weight_mean"], rel=1e-5)
    assert mb.version == 2
    after, want = dict(mb.named_weights()), tb.model.state_dict()
    # Adam's first steps are ~lr * sign(grad): a grad near 0 may flip; 1e-3 is one lr.
    assert max(float((after[k] - want[k]).abs().max()) for k in want) < 1e-3


def test_dsa_kernel_switch_trains_like_megatrons_own_dsa(megatron_world):
    """train.dsa_kernels routes every layer's DSA through kernels/ (torch references on CPU) with the
    same loss as Megatron's unfused DSA."""
    from agentrl.models.tiny import build_tiny_model
    from agentrl.train.megatron_backend import MegatronBackend

    model = build_tiny_model(0).float()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    trajs = _trajs()
    gids = [t.group_id for t in trajs]
    losses = []
    for switch in (False, True):
        train = _train_cfg()
        train.dsa_kernels = switch
        mb = MegatronBackend(model.config, train, AlgorithmConfig(group_size=2), hf_state=state)
        assert mb.dsa_layers_switched == (model.config.num_hidden_layers if switch else 0)
        losses.append([mb.train_step(trajs, gids)["loss"] for _ in range(2)])
        if switch:
            from agentrl.models.megatron_dsa_switch import dsa_kernel_stats

            stats = dsa_kernel_stats(mb.model)
            assert stats["attention"] > 0 and stats["fallback"] == 0, stats
    for plain, switched in zip(*losses):
        assert switched == pytest.approx(plain, rel=1e-4)


def test_bf16_disk_adam_recompute_and_a_resumed_step_equals_the_uninterrupted_one(megatron_world, tmp_path):
    """bf16 params + fp32 main_grad on the device, fp32 masters and moments on disk; a checkpoint
    taken after step 1 and loaded back gives step 2 bit for bit."""
    from agentrl.models.tiny import build_tiny_model
    from agentrl.train.megatron_backend import MegatronBackend
    from agentrl.train.offload_adam import DiskOffloadAdamW

    model = build_tiny_model(0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    train = _train_cfg(dtype="bfloat16", recompute="full", offload="disk",
                       offload_dir=tmp_path / "optim")
    algo = AlgorithmConfig(group_size=2)
    mb = MegatronBackend(model.config, train, algo, hf_state=state, run_dir=tmp_path / "run")
    assert isinstance(mb.optimizer, DiskOffloadAdamW) and mb.masters == []
    assert all(p.dtype == torch.bfloat16 and p.main_grad.dtype == torch.float32 for _, p in mb.named_params)
    trajs = _trajs(2)
    m1 = mb.train_step(trajs, [t.group_id for t in trajs])
    assert torch.isfinite(torch.tensor(m1["loss"])) and m1["grad_norm"] > 0
    # The bf16 weights follow the fp32 masters on disk (not a bf16 update of bf16 weights).
    masters = mb.optimizer.state_dict()["state"]
    assert all(torch.equal(p.detach(), masters[i]["master"].to(p.dtype)) for i, (_, p) in enumerate(mb.named_params))
    mb.save_checkpoint(tmp_path / "ck", {"step": 1})
    after_1 = {k: v.clone() for k, v in mb.named_weights()}
    mb.train_step(trajs, [t.group_id for t in trajs])
    after_2 = {k: v.clone() for k, v in mb.named_weights()}
    assert any(not torch.equal(after_2[k], after_1[k]) for k in after_1)
    assert mb.load_checkpoint(tmp_path / "ck") == {"step": 1}
    assert mb.version == 1
    assert all(torch.equal(v, after_1[k]) for k, v in mb.named_weights())
    mb.train_step(trajs, [t.group_id for t in trajs])
    assert all(torch.equal(v, after_2[k]) for k, v in mb.named_weights())


def test_unsupported_layouts_are_refused_with_the_field_named(megatron_world):
    from agentrl.config.layout import Layout
    from agentrl.models.hf_config import hf_config_for
    from agentrl.train.megatron_backend import MegatronBackend

    layout = Layout.resolve(world=2, tp=2, num_layers=5, num_heads=4, n_experts=8, sequence_parallel=False)
    with pytest.raises(ValueError, match="train.parallel.sequence_parallel=false"):
        MegatronBackend(hf_config_for("tiny"), _train_cfg(), AlgorithmConfig(), layout=layout)


def test_make_backend_builds_the_megatron_backend_from_the_plan(megatron_world, tmp_path):
    from agentrl.config.loader import load_config
    from agentrl.config.plan import resolve_plan
    from agentrl.train.factory import make_backend
    from agentrl.train.megatron_backend import MegatronBackend
    from agentrl.train.megatron_parallel import DistInit

    cfg = load_config("local", ["train.backend=megatron", "train.parallel.recompute=none"])
    plan = resolve_plan(cfg)
    backend = make_backend(cfg, plan, DistInit.single(), tmp_path)
    assert isinstance(backend, MegatronBackend) and backend.layout == plan.layout
    names = [n for n, _ in backend.named_weights()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names


@pytest.mark.slow  # ~14 s: builds and steps the backend
def test_memory_report_matches_the_accounting_after_a_step(megatron_world):
    """agentrl.config.memory (what --dry-run prints) accounts exactly the bytes the backend holds:
    bf16 weights (frozen indexer and MTP included), fp32 main_grads, fp32 masters, Adam moments."""
    from agentrl.config.model_shapes import shapes_of, stage_gpu_params
    from agentrl.models.tiny import build_tiny_model
    from agentrl.train.megatron_backend import MegatronBackend

    model = build_tiny_model(0)
    mb = MegatronBackend(model.config, _train_cfg(dtype="bfloat16"), AlgorithmConfig(group_size=2),
                         hf_state=model.state_dict())
    counts = stage_gpu_params(shapes_of(model.config), mb.layout.stages(), 1, 1)[0]
    assert counts.trainable == sum(p.numel() for _, p in mb.named_params)
    assert counts.frozen == sum(p.numel() for p in mb.model.parameters() if not p.requires_grad) > 0
    trajs = _trajs(2)
    mb.train_step(trajs, [t.group_id for t in trajs])
    report = mb.memory_report()
    assert report["measured"] == report["accounted"]
    assert report["accounted"]["weights"] == 2 * counts.total and report["accounted"]["moments"] == 8 * counts.trainable


@pytest.mark.slow  # ~23 s: two backends
def test_grouped_gemm_experts_train_like_megatrons_sequential_mlp(megatron_world):
    """The default grouped-GEMM experts and megatron's SequentialMLP loop: same loss, same
    gradients of every HF tensor, same export."""
    from agentrl.models.tiny import build_tiny_model
    from agentrl.train.megatron_backend import MegatronBackend

    model = build_tiny_model(0).float()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    trajs = _trajs()
    runs = []
    for grouped in (True, False):
        mb = MegatronBackend(model.config, _train_cfg(max_tokens=40), AlgorithmConfig(group_size=2), hf_state=state,
                             grouped_experts=grouped)
        loss = mb.train_step(trajs, [t.group_id for t in trajs])["loss"]
        runs.append((loss, dict(mb.named_grads())))
    (loss_g, grads_g), (loss_s, grads_s) = runs
    assert abs(loss_g - loss_s) <= 1e-6 * abs(loss_s)
    assert set(grads_g) == set(grads_s) == set(state)
    assert max(float((grads_g[k] - grads_s[k]).abs().max()) for k in grads_s) <= 1e-6
