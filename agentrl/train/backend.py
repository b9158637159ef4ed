"""The TrainerBackend seam: the torch backend (CPU, one process) and the Megatron backend (GPUs)
implement it; the orchestrator and weight sync speak only this."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from agentrl.agent.trajectory import Trajectory


@runtime_checkable
class TrainerBackend(Protocol):
    @property
    def version(self) -> int:
        """Weight version of the current parameters (0 at start, +1 per optimizer step)."""
        ...

    def train_step(self, trajectories: list[Trajectory], group_ids: list[str]) -> dict[str, float]:
        """One optimizer step on complete groups; returns metrics. Bumps `version`."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Current weights with HF names, for weight sync."""
        ...

    def save_checkpoint(self, directory: Path, extra: dict) -> None: ...

    def load_checkpoint(self, directory: Path) -> dict: ...
