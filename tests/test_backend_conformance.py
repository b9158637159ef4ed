"""Every TrainerBackend holds to the seam's contracts (agentrl/train/backend.py): built from a plan by
make_backend, a step bumps the version and reports the required metrics, the export gives the HF
checkpoint's names and shapes, and a checkpoint round trip restores version and weights exactly."""

from __future__ import annotations

import pytest
import torch

from agentrl.config.loader import load_config
from agentrl.config.plan import resolve_plan
from agentrl.train.backend import TrainerBackend
from agentrl.train.factory import make_backend
from agentrl.train.megatron_parallel import DistInit

REQUIRED_METRICS = {"loss", "reward_mean", "loss_tokens", "step_time_s"}


@pytest.fixture(scope="module", autouse=True)
def _one_process_world():
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _batch():
    from test_megatron_backend import _trajs

    trajs = _trajs()
    return trajs, [t.group_id for t in trajs]


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_backend_conformance(backend, tmp_path):
    from agentrl.models.policy import load_policy

    cfg = load_config("local", [f"train.backend={backend}", "train.parallel.recompute=none",
                                "train.optimizer.lr=1e-3"])
    plan = resolve_plan(cfg)
    b = make_backend(cfg, plan, DistInit.single(), tmp_path / "run")
    assert isinstance(b, TrainerBackend)
    assert b.version == 0
    reference, _ = load_policy(cfg.model.name, seed=cfg.seed, cache_dir=tmp_path / "ref")
    want = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    before = {n: t.detach().float().clone() for n, t in b.named_weights()}
    assert {n: tuple(t.shape) for n, t in before.items()} == want  # HF names and shapes, every tensor
    trajs, gids = _batch()
    m = b.train_step(trajs, gids)
    assert REQUIRED_METRICS <= set(m) and b.version == 1
    assert m["loss_tokens"] == sum(sum(t.loss_mask[1:]) for t in trajs)
    after = {n: t.detach().float().clone() for n, t in b.named_weights()}
    assert any(not torch.equal(after[n], before[n]) for n in after)  # the step moved the weights
    b.save_checkpoint(tmp_path / "ckpt", {"step": 1, "note": "x"})
    b.train_step(trajs, gids)
    assert b.version == 2
    assert b.load_checkpoint(tmp_path / "ckpt") == {"step": 1, "note": "x"}
    assert b.version == 1
    restored = {n: t.detach().float() for n, t in b.named_weights()}
    assert all(torch.equal(restored[n], after[n]) for n in after)
