"""What a replay log says became of every acknowledged trajectory, read from the durable log alone.

Nothing is opened for writing and no buffer is built: an audit of a crashed run leaves its evidence
as it was (a torn last line is skipped, as every reader of the log does; a complete line that is
not a record is skipped and listed in `malformed`, as the buffer's recovery does). The accounting follows
the buffer's recovery rule (agentrl/buffer/replay.py): resuming from the checkpoint of step
`resume_step`, a group is
  trained    when a `trained` record of a step <= resume_step names it,
  retired    when a `retired` record names it (stale, or an infra error in the group),
  untrained  otherwise: acknowledged, and what a buffer reopened at `resume_step` must hold.
Every acknowledged trajectory is in exactly one of the three. A `rollback` record (written by a
resume from the checkpoint of `to_step`) voids the `trained` records before it of later steps:
their updates were lost with the crash. A step with more than one `trained` record was trained
again after such a resume; the surviving history keeps each step's last record, and a group in
two steps of that history was trained twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from agentrl.buffer.log import DurableLog
from agentrl.buffer.replay import LOG_NAME


@dataclass(frozen=True)
class LogAudit:
    resume_step: int  # trained steps up to this one count as trained (default: the last in the log)
    accepted: dict[str, str]  # every acknowledged trajectory: episode id -> group id
    trained_groups: frozenset[str]
    retired_groups: frozenset[str]
    untrained_groups: frozenset[str]
    groups_by_step: dict[int, tuple[str, ...]]  # the final history: each step's last trained record
    steps_trained_more_than_once: tuple[int, ...]
    groups_in_two_steps: tuple[str, ...]  # of the final history: trained twice
    malformed: tuple[str, ...] = ()  # skipped lines: file, line number, why

    def trajectories_in(self, groups: frozenset[str]) -> list[str]:
        """Episode ids of the acknowledged trajectories of `groups`, in log order."""
        return [e for e, g in self.accepted.items() if g in groups]

    @property
    def untrained_trajectories(self) -> list[str]:
        return self.trajectories_in(self.untrained_groups)

    def counts(self) -> dict[str, int]:
        """Trajectories and groups in each state, for reports."""
        return {"accepted": len(self.accepted), "groups": len(set(self.accepted.values())),
                "in_trained_groups": len(self.trajectories_in(self.trained_groups)),
                "in_retired_groups": len(self.trajectories_in(self.retired_groups)),
                "untrained": len(self.untrained_trajectories), "trained_groups": len(self.trained_groups),
                "retired_groups": len(self.retired_groups), "untrained_groups": len(self.untrained_groups),
                "steps_trained_more_than_once": len(self.steps_trained_more_than_once),
                "groups_in_two_steps": len(self.groups_in_two_steps), "malformed_lines": len(self.malformed)}


def audit_log(directory: str | Path, resume_step: int | None = None) -> LogAudit:
    """Audit the replay log in `directory` (the folder a ReplayBuffer was opened on) as a resume
    from `resume_step` would see it (default: the last trained step in the log)."""
    accepted: dict[str, str] = {}
    retired: set[str] = set()
    trained_records: list[tuple[int, list[str]]] = []
    all_steps: list[int] = []  # every trained record's step, rolled back or not
    malformed: list[str] = []
    for rec in DurableLog.read(Path(directory) / LOG_NAME, lambda _line, why: malformed.append(why)):
        kind = rec["type"]
        if kind == "traj":
            accepted.setdefault(rec["episode_id"], rec["group_id"])
        elif kind == "retired":
            retired.add(rec["group"])
        elif kind == "trained":
            trained_records.append((int(rec["step"]), list(rec["groups"])))
            all_steps.append(int(rec["step"]))
        elif kind == "rollback":
            trained_records = [(s, gs) for s, gs in trained_records if s <= int(rec["to_step"])]
        elif kind == "admitted":
            pass  # a group's start and seeds: no trajectory's state depends on it
        else:
            raise ValueError(f"replay log {Path(directory) / LOG_NAME}: unknown record type {kind!r}")
    step = max((s for s, _ in trained_records), default=0) if resume_step is None else resume_step
    trained = {g for s, gs in trained_records if s <= step for g in gs}
    history: dict[int, tuple[str, ...]] = {}
    for s, gs in trained_records:
        if s <= step:
            history[s] = tuple(gs)
    per_step = Counter(all_steps)
    in_history = Counter(g for gs in history.values() for g in set(gs))
    groups = set(accepted.values())
    return LogAudit(
        resume_step=step, accepted=accepted, trained_groups=frozenset(groups & trained),
        retired_groups=frozenset((groups & retired) - trained),
        untrained_groups=frozenset(groups - trained - retired),
        groups_by_step=dict(sorted(history.items())),
        steps_trained_more_than_once=tuple(sorted(s for s, n in per_step.items() if n > 1)),
        groups_in_two_steps=tuple(sorted(g for g, n in in_history.items() if n > 1)), malformed=tuple(malformed))
