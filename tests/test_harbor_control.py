"""Harbor's verifier errors get agentrl's "who broke it" control (agentrl/harbor/control.py), run for
real in local sandboxes of the fixture tasks. Harbor itself is not needed: the rows are read_job's."""

from __future__ import annotations

import uuid

from agentrl.config.schema import SandboxConfig
from agentrl.harbor.control import judge_verifier_errors, judged_rows
from agentrl.sandbox.local import LocalSandboxProvider
from envs.tbench2.loader import DEFAULT_TASKS_DIR
from tests.test_sandbox_fd_ownership import needs_bwrap

pytestmark = needs_bwrap


def _row(task: str, outcome: str, reward: float | None = None, trial: str = "t") -> dict:
    return {"task_id": task, "trial": trial, "outcome": outcome, "reward": reward,
            "exception": "RewardFileNotFoundError" if outcome == "infra_error:verifier" else None,
            "exception_message": "no reward file" if outcome == "infra_error:verifier" else None}


class CountingProvider:
    """The real local provider, counting the sandboxes made through it."""

    def __init__(self, inner):
        self.inner, self.created = inner, 0

    async def create(self, spec):
        self.created += 1
        return await self.inner.create(spec)


async def test_a_verifier_error_is_a_failure_where_the_tests_run_in_a_fresh_sandbox(tmp_path):
    inner = LocalSandboxProvider(SandboxConfig(), run_id=f"c{uuid.uuid4().hex[:8]}", root_dir=tmp_path / "boxes")
    provider = CountingProvider(inner)
    rows = [_row("write-name", "infra_error:verifier", trial="a"),  # the agent broke its sandbox
            _row("write-name", "infra_error:verifier", trial="b"),
            _row("write-name", "scored", 1.0, trial="c"),
            _row("missing-reward", "infra_error:verifier"),  # the task's own verifier is broken
            _row("verifier-hangs", "infra_error:verifier_timeout")]
    try:
        judged = await judge_verifier_errors(rows, DEFAULT_TASKS_DIR, provider)
    finally:
        await inner.aclose()
    assert [(r["outcome"], r["reward"]) for r in judged] == [
        ("scored", 0.0), ("scored", 0.0), ("scored", 1.0), ("infra_error:verifier", None),
        ("infra_error:verifier_timeout", None)]
    assert "in a fresh sandbox of the task it runs" in judged[0]["control"] and "no reward file" in judged[0]["control"]
    assert "a fresh sandbox of the task fails too" in judged[3]["control"]
    assert "control" not in judged[2] and "control" not in judged[4]
    assert provider.created == 2  # one control per task, none for a timeout or a verdict


async def test_rows_without_a_verifier_error_need_no_sandbox(monkeypatch):
    import agentrl.sandbox.local as local

    def refuse(*_a, **_k):
        raise AssertionError("no control was needed")

    monkeypatch.setattr(local, "LocalSandboxProvider", refuse)
    rows = [_row("write-name", "scored", 1.0), _row("verifier-hangs", "infra_error:verifier_timeout")]
    assert await judged_rows(rows, DEFAULT_TASKS_DIR, SandboxConfig()) == rows
