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
