"""Fault injection: each scenario breaks one real local component and checks what happens.

A scenario is a function that sets up a real component (a local or stand-in Daytona sandbox, the
embedded engine process, Ray actors of a small local run, the replay buffer on disk, the launcher
as a subprocess), injects one fault, and returns an Outcome: what it observed, whether every
expectation held, and how many accepted trajectories went missing, counted from the replay log
(`lost_trajectories`), never assumed. The registry is the SCENARIOS tuples of the faults_*
modules, collected by `scenarios()` (nothing registers itself at import).

`run_faults` runs them one by one and writes one JSON report: machine, versions, and per scenario
{"scenario", "expected", "observed", "passed", "trajectories_lost"} plus its area and duration.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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


def scenarios() -> list[Scenario]:
    from bench import faults_input, faults_run, faults_sandbox, faults_security

    found = [*faults_sandbox.SCENARIOS, *faults_input.SCENARIOS, *faults_security.SCENARIOS, *faults_run.SCENARIOS]
    names = [s.name for s in found]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise RuntimeError(f"fault scenarios registered twice: {sorted(dup)}")
    return found


def select(only: list[str] | None = None, include_slow: bool = True) -> list[Scenario]:
    """The named scenarios (all if none named); unknown names are an error listing the known."""
    every = scenarios()
    if only:
        known = {s.name: s for s in every}
        unknown = [n for n in only if n not in known]
        if unknown:
            raise ValueError(f"unknown fault scenario(s) {unknown}; known: {', '.join(known)}")
        return [known[n] for n in only]
    return [s for s in every if include_slow or not s.slow]


def run_scenario(s: Scenario, scratch: Path | None = None) -> dict[str, Any]:
    """Run one scenario in its own scratch folder; an exception is a failed scenario, reported."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"flt-{s.name[:20]}-", dir=scratch) as tmp:
        try:
            result = s.run(Path(tmp))
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
            outcome: Outcome = result
        except Exception as e:  # noqa: BLE001 - the report says what broke, the suite goes on
            tb = traceback.format_exc(limit=4)
            outcome = Outcome(f"scenario raised {type(e).__name__}: {e}", False, 0, {"traceback": tb[-2000:]})
    return {"scenario": s.name, "area": s.area, "expected": s.expected, "observed": outcome.observed,
            "passed": outcome.passed, "trajectories_lost": outcome.trajectories_lost,
            "seconds": round(time.monotonic() - t0, 1), "slow": s.slow, "details": outcome.details}


async def _awaited(aw):
    return await aw


def run_faults(out: Path | None, only: list[str] | None = None, include_slow: bool = True,
               echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the selected scenarios with a progress line each; write the report to `out`."""
    from bench.machine import machine

    chosen = select(only, include_slow)
    entries = []
    started = time.time()
    for i, s in enumerate(chosen, 1):
        echo(f"[{i}/{len(chosen)}] {s.area:8s} {s.name} ...")
        e = run_scenario(s)
        entries.append(e)
        mark = "pass" if e["passed"] else "FAIL"
        echo(f"[{i}/{len(chosen)}] {mark} {s.name} ({e['seconds']} s, trajectories_lost={e['trajectories_lost']})"
             + ("" if e["passed"] else f"\n    observed: {e['observed']}"))
    report = {"benchmark": "faults", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
              "wall_s": round(time.time() - started, 1), "machine": machine(),
              "passed": sum(e["passed"] for e in entries), "failed": sum(not e["passed"] for e in entries),
              "trajectories_lost": sum(e["trajectories_lost"] for e in entries), "scenarios": entries}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def lost_trajectories(run_dir: Path, resume_step: int | None = None) -> tuple[int, dict[str, int]]:
    """Accepted trajectories (traj records of the replay log) that the buffer can no longer account
    for: not in a trained group, not in a retired group, and not back in the buffer when it is
    reopened at `resume_step` (default: the last trained step). Returns (lost, counts)."""
    from agentrl.buffer.log import DurableLog
    from agentrl.buffer.replay import LOG_NAME

    log = Path(run_dir) / LOG_NAME
    accepted: dict[str, str] = {}  # episode id -> group id
    trained: set[str] = set()
    retired: set[str] = set()
    last_step = 0
    for rec in DurableLog.read(log):
        if rec["type"] == "traj":
            accepted[rec["episode_id"]] = rec["group_id"]
        elif rec["type"] == "trained":
            trained |= set(rec["groups"])
            last_step = max(last_step, rec["step"])
        elif rec["type"] == "retired":
            retired.add(rec["group"])
    step = last_step if resume_step is None else resume_step
    back = _episodes_back_in_buffer(run_dir, step)
    lost = [e for e, g in accepted.items() if g not in trained and g not in retired and e not in back]
    return len(lost), {"accepted": len(accepted), "in_trained_groups": sum(g in trained for g in accepted.values()),
                       "in_retired_groups": sum(g in retired for g in accepted.values()),
                       "back_in_buffer": len(back), "lost": len(lost)}


def _episodes_back_in_buffer(run_dir: Path, step: int) -> set[str]:
    """Episode ids a buffer reopened on the log at `step` holds (ready or pending). Opened on a copy
    of the log: reopening truncates a torn tail, and the evidence must stay as it was."""
    import shutil

    from agentrl.buffer.replay import LOG_NAME, ReplayBuffer

    with tempfile.TemporaryDirectory(prefix="flt-log-") as tmp:
        shutil.copy(Path(run_dir) / LOG_NAME, Path(tmp) / LOG_NAME)
        buf = ReplayBuffer(tmp, group_size=1 << 30, max_staleness=1 << 30, fsync=False, resume_step=step)
        try:
            groups = list(buf._ready.values()) + list(buf._pending.values())
            return {e for g in groups for e in g.trajectories}
        finally:
            buf.close()


def trained_groups_by_step(run_dir: Path) -> dict[int, list[str]]:
    """The groups of each optimizer step as the run finally stands: a step trained again after a
    resume (its first update was lost with the crash) counts once, with its last record."""
    from agentrl.buffer.log import DurableLog
    from agentrl.buffer.replay import LOG_NAME

    steps: dict[int, list[str]] = {}
    for rec in DurableLog.read(Path(run_dir) / LOG_NAME):
        if rec["type"] == "trained":
            steps[rec["step"]] = list(rec["groups"])
    return steps
