"""Episode seeds: the k-th group a run draws plays the same env randomness in every run of that seed.

Every group the task sampler draws gets a draw number, 0, 1, 2, ... in admission order; a group run
again under the same lineage (re-admitted after it left stale or failed) keeps its draw number with
the next attempt. Episode i of (draw, attempt) is reset with

    seed = sha256(f"{run seed}:{draw}:{attempt}:{i}")[:8] & (2**63 - 1),

so two runs of one seed (say partial rollout off and on, bench/partial.py) give their k-th groups
the same task (the sampler is seeded) and the same seeds, whatever their timing; an env that draws
its randomness from `reset(seed=...)` then plays the same workload. A re-admission is a new attempt
with new seeds: run again with the old ones, a group stale for its length would be stale again.

Never reused across restarts: every admission is logged (the replay log's `admitted` record, written
before the group starts) and a resumed run draws on from past the largest logged draw number; a
group continued after a crash (buffer.resume_in_flight) gets its logged seeds back.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

SEED_MASK = (1 << 63) - 1  # seeds fit a signed 64-bit integer (numpy, torch and most envs take that)


def episode_seeds(run_seed: int, draw: int, attempt: int, n: int) -> list[int]:
    """The reset seeds of the n episodes of attempt `attempt` of draw `draw`."""
    out = []
    for i in range(n):
        digest = hashlib.sha256(f"{run_seed}:{draw}:{attempt}:{i}".encode()).digest()
        out.append(int.from_bytes(digest[:8], "big") & SEED_MASK)
    return out


@dataclass(frozen=True)
class GroupSeeds:
    draw: int
    attempt: int
    seeds: tuple[int, ...]


@dataclass
class SeedSchedule:
    """Hands out (draw, attempt, seeds) per admitted group; `lineage` is the group id of a lineage's
    first admission (the run loop's retry key)."""

    run_seed: int
    group_size: int
    next_draw: int = 0
    _by_lineage: dict[str, GroupSeeds] = field(default_factory=dict)

    def assign(self, lineage: str | None) -> GroupSeeds:
        """Seeds of a group about to start: a new draw, or the next attempt of `lineage` (a lineage
        this run never saw, e.g. one from before a restart, gets a new draw)."""
        prev = self._by_lineage.get(lineage) if lineage is not None else None
        if prev is None:
            draw, attempt = self.next_draw, 0
            self.next_draw += 1
        else:
            draw, attempt = prev.draw, prev.attempt + 1
        return GroupSeeds(draw, attempt, tuple(episode_seeds(self.run_seed, draw, attempt, self.group_size)))

    def started(self, lineage: str, seeds: GroupSeeds) -> None:
        """`seeds` are the latest attempt of `lineage` (what the next re-admission continues from)."""
        self._by_lineage[lineage] = seeds

    def forget(self, lineage: str) -> None:
        """The lineage ended (trained, or not run again)."""
        self._by_lineage.pop(lineage, None)

    def on_resume(self, logged_next_draw: int) -> None:
        """After a restart: draw on from past every draw the replay log holds."""
        self.next_draw = max(self.next_draw, logged_next_draw)
