"""Harbor's oracle and nop agents on agentrl's tasks, in agentrl's sandbox, against what agentrl
expects of each task (`agentrl tasks check`'s expectations: the oracle scores 1.0 unless the
fixture says otherwise in [metadata], an empty attempt scores 0.0 or the same verifier error).

    agentrl harbor parity --out bench/results/harbor_oracle.json

Folders agentrl refuses to load (deliberately invalid fixtures) must be absent from Harbor's job:
Harbor refuses them too.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from agentrl.harbor.jobs import read_job, run_job
from envs.tbench2.loader import TaskFormatError, list_task_dirs, load_task

AGENTS = {"oracle": "oracle", "nop": "empty"}  # Harbor agent -> which expectation of the task applies


def expectations(tasks_dir: Path) -> tuple[dict[str, dict[str, tuple[str, float | None]]], list[str]]:
    """{agent: {task: (outcome, reward)}} for the loadable tasks, and the refused folder names."""
    expected: dict[str, dict[str, tuple[str, float | None]]] = {a: {} for a in AGENTS}
    refused = []
    for d in list_task_dirs(tasks_dir):
        try:
            t = load_task(d)
        except TaskFormatError:
            refused.append(d.name)
            continue
        expected["oracle"][t.name] = (t.expected_status, t.expected_reward)
        empty = t.expected_empty_status
        expected["nop"][t.name] = (empty, 0.0 if empty == "scored" else None)
    return expected, refused


def machine() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "harbor": version("harbor"), "agentrl_commit": commit}


def oracle_and_nop(tasks_dir: Path, jobs_dir: Path, *, n_concurrent: int = 2) -> dict[str, Any]:
    """Run both agents through Harbor and compare every trial with agentrl's expectation."""
    expected, refused = expectations(tasks_dir)
    report: dict[str, Any] = {"tasks_dir": str(tasks_dir), "machine": machine(), "refused_by_agentrl": refused,
                              "mismatches": []}
    for agent in AGENTS:
        start = time.perf_counter()
        job = run_job(tasks_dir, agent, jobs_dir, f"{agent}-{int(time.time())}", n_concurrent=n_concurrent)
        rows = {r["task_id"]: r for r in read_job(job)}
        section = {"wall_s": round(time.perf_counter() - start, 1), "job_dir": str(job), "trials": rows}
        for name in sorted(set(expected[agent]) | set(rows) | set(refused)):
            want = expected[agent].get(name)
            row = rows.get(name)
            got = (row["outcome"], row["reward"]) if row else None
            if want != got:
                report["mismatches"].append({"agent": agent, "task": name, "expected": want, "harbor": got})
        section["mean_reward"] = _mean([r["reward"] for r in rows.values() if r["outcome"] == "scored"])
        report[agent] = section
    report["ok"] = not report["mismatches"]
    return report


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None
