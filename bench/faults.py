"""Fault injection: each scenario breaks one real local component and checks what happens.

A scenario is a function that sets up a real component (a local or stand-in Daytona sandbox, the
embedded engine process, Ray actors of a small local run, the replay buffer on disk, the launcher
as a subprocess), injects one fault, and returns an Outcome: what it observed, whether every
expectation held, and how many accepted trajectories went missing, counted from the replay log
(`faults_base.lost_trajectories`), never assumed. This module is the suite: the SCENARIOS tuples
of the faults_* modules, collected by `scenarios()` (nothing registers itself at import). Those
modules take Scenario, Checks and Outcome from faults_base.py and never import this one.

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
from pathlib import Path
from typing import Any

from bench import faults_input, faults_integrity, faults_run, faults_sandbox, faults_security
from bench.faults_base import Outcome, Scenario


def scenarios() -> list[Scenario]:
    """Every scenario of the spoke modules, in report order (each name once)."""
    found = [*faults_sandbox.SCENARIOS, *faults_input.SCENARIOS, *faults_security.SCENARIOS, *faults_run.SCENARIOS]
    found += faults_integrity.SCENARIOS  # issue #20: forged verdicts, host escapes
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
