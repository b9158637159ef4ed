"""The TrainerBackend seam: the torch backend (one process, CPU or GPU), the Megatron backend (any
layout, gloo or NCCL) and the rehearsal's DryBackend implement it; agentrl.train.factory.make_backend
builds one from the plan; TrainerWorker, weight sync and `agentrl eval` speak only this.
tests/test_backend_conformance.py holds every implementation to the contracts below.

Every rank of a multi-rank backend is called with the same arguments in the same order (the
TrainerGroup fans calls out), since steps, exports and checkpoints are collective."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from agentrl.agent.trajectory import Trajectory

if TYPE_CHECKING:  # the rehearsal's dry ranks import this seam without torch
    import torch


@runtime_checkable
class TrainerBackend(Protocol):
    @property
    def version(self) -> int:
        """Weight version of the current parameters (0 at start, +1 per optimizer step)."""
        ...

    def train_step(self, trajectories: list[Trajectory], group_ids: list[str]) -> dict[str, float]:
        """One optimizer step on complete groups (group_ids[i] is trajectories[i]'s group). Bumps
        `version` by one. Returns at least `loss`, `reward_mean`, `loss_tokens` and `step_time_s`,
        the same dict on every rank."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The current weights, one tensor at a time, with the HF checkpoint's names and shapes (what
        engines load). Every rank must iterate to the end (exports are collective)."""
        ...

    def save_checkpoint(self, directory: Path, extra: dict) -> None:
        """Write weights, optimizer state, version and `extra` to `directory`, atomically: a crash
        leaves the previous checkpoint whole."""
        ...

    def load_checkpoint(self, directory: Path) -> dict:
        """Restore what save_checkpoint wrote (weights, optimizer, version); returns its `extra`.
        A checkpoint of another model is refused with an error naming the file."""
        ...
