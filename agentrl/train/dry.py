"""A trainer backend that holds no model: for `train --rehearse`, where the real TrainerWorker
actors are placed, rendezvous-free, exactly as a run places them, and report what they would be.

It keeps the TrainerBackend contract (version, steps, weights, checkpoints) with nothing inside,
so a rehearsal exercises the actor and group code of a real run, not stand-ins.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from agentrl.config.layout import Layout, RankCoords


class DryBackend:
    def __init__(self, layout: Layout, coords: RankCoords):
        self.layout, self.coords = layout, coords
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def train_step(self, trajectories, group_ids) -> dict[str, float]:
        self._version += 1
        return {"loss": 0.0, "reward_mean": 0.0, "loss_tokens": 0, "dry": 1.0}

    def named_weights(self) -> Iterator:
        return iter(())

    def save_checkpoint(self, directory: Path, extra: dict) -> None:
        return None

    def load_checkpoint(self, directory: Path) -> dict:
        return {}
