"""What every fault-scenario module shares: the Scenario record, the Checks that collect a
scenario's expectations, its Outcome, and the replay-log accounting of lost trajectories.

The scenario modules (faults_sandbox, faults_input, faults_security, faults_run) import this one;
the suite (faults.py) imports them. Nothing here knows a scenario.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A buffer reopened with this group size holds every group as incomplete, and a bound this wide
# admits any lag: what the reopen restored is then visible through public methods and the log.
_HOLD_ALL = 1 << 30


@dataclass
class Outcome:
    observed: str
    passed: bool
    trajectories_lost: int = 0
    details: dict[str, Any] = field(default_factory=dict)


class Checks:
    """Collects facts a scenario observed; each fact is an expectation that held or did not."""

    def __init__(self) -> None:
        self.facts: list[str] = []
        self.ok = True
        self.details: dict[str, Any] = {}

    def __call__(self, cond: Any, fact: str) -> bool:
        self.facts.append(fact if cond else f"NOT: {fact}")
        self.ok = self.ok and bool(cond)
        return bool(cond)

    def outcome(self, trajectories_lost: int = 0) -> Outcome:
        passed = self.ok and trajectories_lost == 0
        return Outcome("; ".join(self.facts), passed, trajectories_lost, self.details)


@dataclass(frozen=True)
class Scenario:
    name: str
    area: str  # sandbox | engine | worker | input | security
    expected: str
    run: Callable[[Path], Any]  # (scratch folder) -> Outcome, sync or async
    slow: bool = False  # needs a full local training run (minutes)


def lost_trajectories(run_dir: Path, resume_step: int | None = None) -> tuple[int, dict[str, int]]:
    """Acknowledged trajectories the buffer can no longer account for. The log's audit
    (agentrl.buffer.audit) names the groups left untrained at `resume_step` (default: the last
    trained step); a buffer reopened there must restore every one of them. Lost = untrained by the
    log but not restored by the reopen. Returns (lost, counts)."""
    from agentrl.buffer.audit import audit_log

    audit = audit_log(run_dir, resume_step)
    restored = _restored_on_reopen(Path(run_dir), audit.resume_step, audit.untrained_groups)
    lost = 0
    for g in audit.untrained_groups:
        lost += max(len(audit.trajectories_in(frozenset({g}))) - restored[g], 0)
    c = audit.counts()
    return lost, {"accepted": c["accepted"], "in_trained_groups": c["in_trained_groups"],
                  "in_retired_groups": c["in_retired_groups"], "back_in_buffer": sum(restored.values()),
                  "lost": lost}


def _restored_on_reopen(run_dir: Path, step: int, groups: frozenset[str]) -> dict[str, int]:
    """How many trajectories of each of `groups` a buffer reopened at `step` restored. Opened on a
    copy of the log (reopening truncates a torn tail and may write records; the evidence must stay
    as it was), with every group incomplete. A group the reopen itself retires (an incomplete group
    at a resume can never complete) shows as a `retired` record in the copy: restored whole. One it
    holds is counted by `retire_incomplete`. A group it silently dropped is neither."""
    from agentrl.buffer.audit import audit_log
    from agentrl.buffer.replay import LOG_NAME, ReplayBuffer

    with tempfile.TemporaryDirectory(prefix="flt-log-") as tmp:
        shutil.copy(run_dir / LOG_NAME, Path(tmp) / LOG_NAME)
        buf = ReplayBuffer(tmp, group_size=_HOLD_ALL, max_staleness=_HOLD_ALL, fsync=False, resume_step=step)
        try:
            after = audit_log(tmp, step)
            out = {}
            for g in groups:
                whole = len(after.trajectories_in(frozenset({g})))
                out[g] = whole if g in after.retired_groups else buf.retire_incomplete(g, "audit")
            return out
        finally:
            buf.close()
