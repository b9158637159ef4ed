"""When the embedded engine's scheduler admits waiting requests: at once, or a few together.

Why: on a GPU a prefill forward costs about the same whatever its rows: the engine is host-bound
(H200, SmolLM2-135M, session 7: ~37 ms of Python and launches per forward). Under a closed loop of
clients some request ends at almost every decode step, so admitting at once means nearly one
prefill forward per decode step, however fast decode is made (graphs.py). Letting the waiting
requests gather for a few steps merges their prefills into one forward (prefill_groups.py), at the
price of up to `max_wait_steps` decode steps of queueing for the first of them.

Off by default (max_wait_steps 0): on a CPU a forward's cost grows with its tokens, so merging
saves little there, and a request that waits costs latency. With nothing running, a request is
always admitted at once: there is no batch to protect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# With max_wait_steps on, a gathering ends early once this fraction of the batch is waiting (or
# every free row can be filled): a quarter of 64 rows is 16 requests per prefill forward.
GATHER_BATCH_FRACTION = 0.25


@dataclass(frozen=True)
class AdmissionGate:
    max_wait_steps: int = 0
    gather_fraction: float = GATHER_BATCH_FRACTION

    def __post_init__(self) -> None:
        if self.max_wait_steps < 0 or not 0 < self.gather_fraction <= 1:
            raise ValueError(f"AdmissionGate: max_wait_steps={self.max_wait_steps} must be >= 0 and "
                             f"gather_fraction={self.gather_fraction} in (0, 1]")

    def admit_now(self, waiting: int, running: int, max_batch: int, oldest_waited_steps: int) -> bool:
        """Admit this step? `oldest_waited_steps`: decode steps the longest-waiting request has waited."""
        room = max_batch - running
        if waiting == 0 or room <= 0:
            return False
        if self.max_wait_steps == 0 or running == 0:
            return True
        enough = min(room, max(1, math.ceil(self.gather_fraction * max_batch)))
        return waiting >= enough or oldest_waited_steps >= self.max_wait_steps
