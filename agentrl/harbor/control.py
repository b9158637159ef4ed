"""The same "who broke it" control for Harbor's trials as agentrl's own scorer runs
(envs/tbench2/scorer.py, its module docstring): a trial whose verifier gave no verdict while its
sandbox still answered may have been broken by the agent (a deleted bash, a filled disk). agentrl
scores such an episode 0 when the task's tests run in a fresh sandbox of the task; Harbor reports
an exception, which `agentrl eval --harness harbor` counted apart as an infra error, so an agent
that broke its machine lowered agentrl's pass rate and not Harbor's. Each such trial is judged here
by one control run per task (a fresh sandbox holds nothing of any attempt, so one run answers for
every trial of the task), in the backend Harbor ran in (agentrl's local sandbox).

Only `infra_error:verifier` trials get a control: a verifier timeout gets none, as in agentrl (it
would cost the timeout again), and other Harbor exceptions are no verifier's failure.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from agentrl.config.schema import SandboxConfig
from agentrl.sandbox.base import SandboxError, SandboxProvider

JUDGED = "infra_error:verifier"  # the outcome a control may turn into a scored 0


async def judge_verifier_errors(rows: list[dict[str, Any]], tasks_dir: Path,
                                provider: SandboxProvider) -> list[dict[str, Any]]:
    """`rows` (read_job's) with each verifier error judged by its task's control: scored 0 with the
    reason in `control` where the tests run in a fresh sandbox, else unchanged but for `control`."""
    from envs.tbench2.loader import load_task
    from envs.tbench2.scorer import SCORED, ScoreResult, control_run, judged_by_control

    controls: dict[str, ScoreResult] = {}
    out = []
    for row in rows:
        if row["outcome"] != JUDGED:
            out.append(row)
            continue
        task_id = row["task_id"]
        if task_id not in controls:
            try:
                controls[task_id] = await control_run(provider, load_task(tasks_dir / task_id))
            except SandboxError as err:  # no control: the error stands, as in agentrl's scorer
                controls[task_id] = ScoreResult(f"infra_error:{err.kind}", None, f"control sandbox failed: {err}")
        failed = ScoreResult(JUDGED, None, row.get("exception_message") or row.get("exception") or "no verdict")
        judged = judged_by_control(failed, controls[task_id])
        out.append({**row, "outcome": judged.status, "reward": judged.reward if judged.status == SCORED else None,
                    "control": judged.detail})
    return out


async def judged_rows(rows: list[dict[str, Any]], tasks_dir: Path, sandbox: SandboxConfig) -> list[dict[str, Any]]:
    """judge_verifier_errors with a local sandbox provider of its own (closed after), made only
    when some row needs a control."""
    if not any(r["outcome"] == JUDGED for r in rows):
        return rows
    from agentrl.sandbox.local import LocalSandboxProvider

    provider = LocalSandboxProvider(sandbox.model_copy(update={"backend": "local"}),
                                    run_id=f"harbor-control-{uuid.uuid4().hex[:8]}")
    try:
        return await judge_verifier_errors(rows, tasks_dir, provider)
    finally:
        await provider.aclose()
