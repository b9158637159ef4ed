"""The torch backend trains a batch in which the stale-token mask emptied a whole micro-batch (an
early finisher stale throughout): that micro-batch is skipped, the step's token mean is over the
tokens left, and the masked trajectory's reward still sets its group's advantages."""

from __future__ import annotations

import pytest

from agentrl.agent.trajectory import SCORED, Trajectory
from agentrl.config.schema import AlgorithmConfig, TrainConfig


def test_a_micro_batch_left_without_loss_tokens_is_skipped():
    from agentrl.models.tiny import build_tiny_model
    from agentrl.train.torch_backend import TorchBackend

    masked = Trajectory("g-0", "t", "g", 2, [1, 2, 3, 4], [0, 0, 0, 0], [0.0] * 4, [-1, -1, 3, 3], SCORED, 1.0)
    fresh = Trajectory("g-1", "t", "g", 2, [1, 2, 5, 6], [0, 0, 1, 1], [0.0, 0.0, -1.0, -1.0], [-1, -1, 7, 7],
                       SCORED, 0.0)
    backend = TorchBackend(build_tiny_model(0), TrainConfig(micro_batch_tokens=4, logprob_chunk_tokens=64),
                           AlgorithmConfig(group_size=2, prompts_per_step=1))
    m = backend.train_step([masked, fresh], ["g", "g"])
    assert m["micro_batches"] == 2 and m["loss_tokens"] == 2 and backend.version == 1
    assert m["advantage_abs_mean"] == pytest.approx(1.0, abs=1e-4)  # the masked reward still counts
    assert m["grad_norm"] > 0
