"""Which task the next group plays. The run loop asks a TaskSampler; a curriculum is another one.

RoundRobinSampler: every training task in a seeded random order, again and again (each task equally
often, no task starved). Its position is part of the checkpoint, so a resumed run continues the
order instead of starting it over.
"""

from __future__ import annotations

import random
from typing import Protocol, runtime_checkable


@runtime_checkable
class TaskSampler(Protocol):
    def next_task(self) -> str: ...

    def observe(self, task_id: str, rewards: list[float]) -> None:
        """The rewards of a finished group of `task_id` (trainable episodes only)."""
        ...

    def metrics(self) -> dict[str, float]:
        """What the metrics row reports of the sampler (e.g. a curriculum's band sizes)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class RoundRobinSampler:
    def __init__(self, tasks: list[str], seed: int = 0):
        if not tasks:
            raise ValueError("no training task to sample from")
        self.order = list(tasks)
        random.Random(seed).shuffle(self.order)
        self.position = 0

    def next_task(self) -> str:
        task = self.order[self.position % len(self.order)]
        self.position += 1
        return task

    def observe(self, task_id: str, rewards: list[float]) -> None:
        return None  # the order does not depend on results

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {"kind": "round_robin", "order": list(self.order), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "round_robin" or sorted(state.get("order", [])) != sorted(self.order):
            return  # another sampler or another task set: start this order afresh
        self.order, self.position = list(state["order"]), int(state["position"])
