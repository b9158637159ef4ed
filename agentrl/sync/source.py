"""Where a stage's weights come from: one rank's view of them for a weight update.

`WeightSource` is what every transport consumes: `specs()` (HF name, dtype, shape of each tensor
of the stage, known before any data moves: the bucket planner plans from it) and `run(emit, fp8)`
(called on every participating rank; on the stage's sender, `emit(wire_name, tensor)` receives the
wire tensors in spec order, FP8 weights as e4m3 + `_scale_inv`).

- Megatron: agentrl.train.megatron_export.StageExport (TP gathered to the sender, experts sent by
  their owners, global layer names);
- one rank holding everything (the torch backend, a checkpoint): `LocalSource` over its named
  tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from agentrl.sync.buckets import TensorSpec
from agentrl.sync.fp8 import to_wire


@runtime_checkable
class WeightSource(Protocol):
    stage: int
    sender: int  # global trainer rank that sends this stage
    participates: bool  # whether this rank has any part in the stage's export

    def specs(self) -> list[TensorSpec]: ...

    def run(self, emit: Callable[[str, torch.Tensor], None], fp8: frozenset[str] = frozenset()) -> None: ...


class LocalSource:
    """All tensors on one rank: stage 0, sent by rank 0."""

    stage = 0
    sender = 0
    participates = True

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]):
        self.named = [(n, t.detach()) for n, t in named]

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec.of(n, t) for n, t in self.named]

    def run(self, emit: Callable[[str, torch.Tensor], None], fp8: frozenset[str] = frozenset()) -> None:
        for name, t in self.named:
            for wire_name, w in to_wire(name, t, name in fp8):
                emit(wire_name, w)


def source_for(backend: Any, rank: int) -> WeightSource:
    """This rank's source of `backend`'s weights: the Megatron backend exports per stage; any other
    backend (one rank holding the model) hands its named_weights over as they are."""
    if all(hasattr(backend, a) for a in ("model", "hf_config", "layout")) and hasattr(backend, "named_grads"):
        from agentrl.train.megatron_export import StageExport

        return StageExport(backend.model, backend.hf_config, backend.layout, rank)
    return LocalSource(backend.named_weights())
