"""GRPO + TIS loss pieces: advantages, clipping, TIS weights, token-level normalisation."""

import pytest
import torch

from agentrl.train.batching import plan_micro_batches
from agentrl.train.loss import LossConfig, LossInputs, group_advantages, grpo_tis_loss


def test_group_advantages_normalise_within_groups():
    r = group_advantages([1.0, 0.0, 1.0, 0.0, 0.5, 0.5], ["a", "a", "b", "b", "c", "c"])
    assert r.groups == 3 and r.zero_variance_groups == 1
    assert r.advantages[0] == pytest.approx(1.0, abs=1e-4) and r.advantages[1] == pytest.approx(-1.0, abs=1e-4)
    assert r.advantages[4:] == [0.0, 0.0]


def _inputs(logp, old, rollout, adv):
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    return LossInputs(logp=t(logp).requires_grad_(True), old_logp=t(old), rollout_logp=t(rollout),
                      advantages=t(adv), mask=torch.ones(len(logp)))


def test_gradient_raises_positive_advantage_tokens():
    x = _inputs([-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [1.0, -1.0])
    loss, _ = grpo_tis_loss(x, LossConfig(), num_loss_tokens=2)
    loss.backward()
    assert x.logp.grad[0] < 0 < x.logp.grad[1]  # descent raises token 0, lowers token 1


def test_asymmetric_clip_stops_gradient_outside_the_range():
    cfg = LossConfig(use_tis=False)
    # ratio e^0.3 > 1 + 0.28 with positive advantage: clipped, no gradient
    x = _inputs([0.3], [0.0], [0.0], [1.0])
    loss, m = grpo_tis_loss(x, cfg, 1)
    loss.backward()
    assert x.logp.grad.abs().item() == 0.0 and m["pg_clip_frac_sum"] == 1.0
    # ratio e^0.2 < 1.28: inside, gradient flows
    x = _inputs([0.2], [0.0], [0.0], [1.0])
    loss, _ = grpo_tis_loss(x, cfg, 1)
    loss.backward()
    assert x.logp.grad.abs().item() > 0


def test_tis_weight_is_clamped_and_counted():
    cfg = LossConfig(tis_clip_low=0.5, tis_clip=2.0)
    # old - rollout = log 4 -> raw weight 4, clamped to 2
    x = _inputs([0.0], [0.0], [-1.3862944], [1.0])
    loss, m = grpo_tis_loss(x, cfg, 1)
    assert loss.item() == pytest.approx(-2.0, rel=1e-5)
    assert m["tis_clip_frac_sum"] == 1.0 and m["tis_weight_sum"] == pytest.approx(2.0)


def test_token_level_normalisation_over_the_step():
    cfg = LossConfig(use_tis=False)
    x = _inputs([0.0, 0.0, 0.0], [0.0] * 3, [0.0] * 3, [1.0, 1.0, 1.0])
    loss, _ = grpo_tis_loss(x, cfg, num_loss_tokens=6)
    assert loss.item() == pytest.approx(-0.5)


def test_micro_batches_respect_budget():
    lengths = [10, 50, 20, 40, 30, 200]
    batches = plan_micro_batches(lengths, 100)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 100


def test_torch_backend_with_disk_offloaded_adam_matches_in_memory(tmp_path):
    """The torch backend trains identically with optimizer state on disk, and checkpoints it."""
    from agentrl.agent.trajectory import Trajectory
    from agentrl.config.schema import AlgorithmConfig, TrainConfig
    from agentrl.models.tiny import build_tiny_model
    from agentrl.train.torch_backend import TorchBackend

    def trajs():
        return [Trajectory(episode_id=f"e{i}", task_id="t", group_id="g", prompt_len=3, token_ids=[5, 6, 7, 8 + i, 9],
                           loss_mask=[0, 0, 0, 1, 1], rollout_logprobs=[0, 0, 0, -1.0, -1.0],
                           weight_versions=[-1, -1, -1, 0, 0], outcome="scored", reward=float(i % 2))
                for i in range(4)]

    results = []
    for offload in ("none", "disk"):
        train = TrainConfig(logprob_chunk_tokens=64)
        train.optimizer.offload = offload
        train.optimizer.offload_dir = tmp_path / "optim"
        train.optimizer.lr = 1e-3
        b = TorchBackend(build_tiny_model(0), train, AlgorithmConfig(group_size=4), run_dir=tmp_path / "run")
        for _ in range(2):
            b.train_step(trajs(), ["g"] * 4)
        b.save_checkpoint(tmp_path / f"ck_{offload}", {"step": 2})
        results.append({k: v.clone() for k, v in b.model.state_dict().items()})
        b2 = TorchBackend(build_tiny_model(1), train, AlgorithmConfig(group_size=4), run_dir=tmp_path / "run2")
        assert b2.load_checkpoint(tmp_path / f"ck_{offload}") == {"step": 2}
        assert all(torch.equal(v, b2.model.state_dict()[k]) for k, v in b.model.state_dict().items())
    for k in results[0]:
        assert torch.allclose(results[0][k], results[1][k], rtol=1e-5, atol=1e-6), k


# -- Dr. GRPO: advantages without std normalisation ---------------------------------------------------


def test_advantages_without_std_are_centred_rewards():
    rewards, groups = [1.0, 0.0, 0.0, 0.0, 0.7, 0.7], ["a"] * 4 + ["b"] * 2
    r = group_advantages(rewards, groups, normalize_std=False)
    assert r.advantages == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.0, 0.0])
    assert r.zero_variance_groups == 1
    # One success in four: std normalisation inflates it to sqrt(3); Dr. GRPO keeps 0.75.
    assert group_advantages(rewards, groups).advantages[0] == pytest.approx(3 ** 0.5, abs=1e-4)


def test_step_advantages_honours_advantage_norm():
    from agentrl.agent.trajectory import Trajectory
    from agentrl.train.loss import step_advantages

    trajs = [Trajectory(f"e{i}", "t", "g", 1, [1, 2], [0, 1], [0.0, -1.0], [-1, 0], "scored", float(i == 0))
             for i in range(4)]
    _, std, mean = step_advantages(trajs, ["g"] * 4)
    _, centred, _ = step_advantages(trajs, ["g"] * 4, advantage_norm="none")
    assert mean == 0.25 and std[0] == pytest.approx(3 ** 0.5, abs=1e-4)
    assert centred == pytest.approx([0.75, -0.25, -0.25, -0.25])
    with pytest.raises(ValueError, match="algorithm.advantage_norm 'max'"):
        step_advantages(trajs, ["g"] * 4, advantage_norm="max")


def test_torch_backend_passes_the_configured_advantage_norm():
    from agentrl.agent.trajectory import Trajectory
    from agentrl.config.schema import AlgorithmConfig, TrainConfig
    from agentrl.models.tiny import build_tiny_model
    from agentrl.train.torch_backend import TorchBackend

    trajs = [Trajectory(f"e{i}", "t", "g", 3, [5, 6, 7, 8 + i, 9], [0, 0, 0, 1, 1], [0, 0, 0, -1.0, -1.0],
                        [-1, -1, -1, 0, 0], "scored", float(i == 0)) for i in range(4)]
    seen = {}
    for norm in ("std", "none"):
        b = TorchBackend(build_tiny_model(0), TrainConfig(logprob_chunk_tokens=64),
                         AlgorithmConfig(group_size=4, advantage_norm=norm))
        seen[norm] = b.train_step(trajs, ["g"] * 4)["advantage_abs_mean"]
    assert seen["std"] == pytest.approx(0.866, abs=1e-3) and seen["none"] == pytest.approx(0.375)
