"""Retry: which failed groups run again, classified before they cross an actor boundary.

Two kinds of failure (NeMo-RL's split):
- infrastructure: the sandbox, the engine, the network, the verifier or the episode worker failed
  (`infra_error:<kind>` outcomes, a lost worker). Nothing is wrong with the task; the group runs
  again, up to INFRA_RETRIES times per group lineage, then is dropped and counted.
- data: the task itself cannot be played (its env refused it: a malformed task, a missing file).
  Retrying gives the same result: DATA_RETRIES times at most, reported loudly.
A group's lineage is the chain of groups re-run for one admission; the budget is per lineage, not
per task for the whole run (a task that failed twice in hour 1 still gets its retries in hour 9).
A task dropped for a data error is unplayable for the rest of the run (UnplayableTasks): the sampler's
draws skip it, and when every training task is unplayable the run stops (NoPlayableTasks) instead of
admitting groups that fail forever.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

INFRA_RETRIES = 2  # re-runs of one group after infrastructure failures; a third failure drops it
DATA_RETRIES = 0  # a task the env cannot play fails the same way again
DATA_ERROR_KINDS = ("task",)  # infra_error kinds that mean the task is broken, not the machinery


def failure_kind(outcome: str) -> str | None:
    """"infra" or "data" for a failed outcome, None for a trainable one."""
    if not outcome.startswith("infra_error"):
        return None
    kind = outcome.partition(":")[2]
    return "data" if kind in DATA_ERROR_KINDS else "infra"


@dataclass
class Decision:
    retry: bool
    reason: str  # e.g. "infra_error:sandbox (retry 1 of 2)" or "dropped after 2 infra retries"
    kind: str = "infra"  # "infra" or "data": which budget decided


@dataclass
class RetryPolicy:
    infra_retries: int = INFRA_RETRIES
    data_retries: int = DATA_RETRIES
    _attempts: dict[str, int] = field(default_factory=dict)  # lineage -> re-runs so far
    counters: dict[str, int] = field(default_factory=lambda: {"infra_retried": 0, "infra_dropped": 0,
                                                                "data_retried": 0, "data_dropped": 0})

    def decide(self, lineage: str, outcomes: list[str]) -> Decision:
        """A retired group of `lineage` whose episodes ended with `outcomes`: run it again?"""
        kinds = {failure_kind(o) for o in outcomes} - {None}
        kind = "data" if "data" in kinds else "infra"
        budget = self.data_retries if kind == "data" else self.infra_retries
        done = self._attempts.get(lineage, 0)
        first = next((o for o in outcomes if failure_kind(o)), f"infra_error:{kind}")
        if done < budget:
            self._attempts[lineage] = done + 1
            self.counters[f"{kind}_retried"] += 1
            return Decision(True, f"{first} (retry {done + 1} of {budget})", kind)
        self._attempts.pop(lineage, None)
        self.counters[f"{kind}_dropped"] += 1
        return Decision(False, f"{first}: dropped after {done} {kind} retr{'y' if done == 1 else 'ies'}", kind)

    def on_trained(self, lineage: str) -> None:
        self._attempts.pop(lineage, None)


# Draws from the sampler per admission, per training task, before giving up on this admission
# round: a round-robin sampler visits every task in len(pool) draws; a random one (the curriculum)
# needs a few times that to find the last playable tasks of a mostly unplayable pool.
DRAWS_PER_TASK = 4


class NoPlayableTasks(RuntimeError):
    """Every training task failed as a data error: no step can be made; the message says why."""


@dataclass
class UnplayableTasks:
    """Training tasks dropped for a data error, left out of sampling for the rest of the run.

    Not persisted: a resumed run finds them again at the cost of one failed group each.
    """

    reasons: dict[str, str] = field(default_factory=dict)  # task id -> why it was left out
    errors: dict[str, str] = field(default_factory=dict)  # task id -> its first data error's message

    def mark(self, task_id: str, reason: str) -> None:
        self.reasons.setdefault(task_id, reason)

    def note_error(self, task_id: str, error: str) -> None:
        """An episode's data error message; it may arrive before or after its group is dropped."""
        self.errors.setdefault(task_id, error)

    def draw(self, next_task: Callable[[], str], pool: Sequence[str]) -> str | None:
        """A playable task from `next_task`, or None when this round's draws found none (some
        remain playable); raises NoPlayableTasks when none of `pool` is playable."""
        if pool and all(t in self.reasons for t in pool):
            # the first task whose episode said why (its message can trail its group's drop)
            task = next((t for t in self.reasons if t in self.errors), next(iter(self.reasons)))
            why = self.errors.get(task) or self.reasons[task]
            raise NoPlayableTasks(f"every training task ({len(pool)}) failed as a data error and was left out; "
                                  f"the first, {task}: {why}")
        for _ in range(DRAWS_PER_TASK * max(len(pool), 1)):
            task = next_task()
            if task not in self.reasons:
                return task
        return None
