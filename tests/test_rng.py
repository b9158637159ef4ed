"""Trainer RNG state survives a checkpoint that loads with weights_only=True (no pickled objects)."""

import random

import numpy as np
import torch

from agentrl.train import rng


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    torch.save({"rng": rng.capture()}, tmp_path / "s.pt")
    want = (torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)])
    torch.rand(10), np.random.rand(10), random.random()  # move every generator on
    rng.restore(torch.load(tmp_path / "s.pt", weights_only=True)["rng"])
    assert (torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)]) == want
