"""Run `harbor run` on agentrl's local sandbox and read a Harbor job folder back.

Harbor is driven through its own CLI in a subprocess, exactly as a user runs it: its trial
runner, agents and verifier are what is measured, not a re-implementation. Reading the job back
uses only the files Harbor writes (each trial's result.json).

A trial's outcome, in agentrl's words (agentrl/agent/trajectory.py):
- `scored`: the verifier gave a reward; an agent timeout or a non-zero agent exit still counts,
  as Harbor's error policy says (`has_valid_reward`), and as agentrl scores a timed-out episode;
- `infra_error:verifier_timeout` / `infra_error:verifier`: Harbor's VerifierTimeoutError, and its
  missing / empty / unparsable reward errors: never a reward, as in agentrl;
- `infra_error:harbor_<ExceptionType>`: anything else (the environment, the model API, ...): an
  infrastructure failure, counted apart and never as a failed attempt.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from agentrl.harbor.environment import IMPORT_PATH

VERIFIER_ERRORS = {
    "VerifierTimeoutError": "infra_error:verifier_timeout",
    "RewardFileNotFoundError": "infra_error:verifier",
    "RewardFileEmptyError": "infra_error:verifier",
    "VerifierOutputParseError": "infra_error:verifier",
}
# Harbor exceptions after which the verifier's reward still stands (harbor.models.trial.error_policy).
REWARD_STANDS = {"AgentTimeoutError", "NonZeroAgentExitCodeError"}
JOB_TIMEOUT_S = 3600.0
_TAIL_CHARS = 3000


def harbor_executable() -> str:
    """The `harbor` CLI of this interpreter's environment (the venv agentrl runs in)."""
    beside = Path(sys.executable).with_name("harbor")
    found = str(beside) if beside.is_file() else shutil.which("harbor")
    if not found:
        raise FileNotFoundError("the harbor CLI is not installed: pip install 'agentrl[harbor]' "
                                "(or pip install harbor==0.26.0)")
    return found


def run_job(tasks_dir: Path, agent: str, jobs_dir: Path, job_name: str, *, tasks: list[str] | None = None,
            model: str | None = None, agent_kwargs: dict[str, Any] | None = None, n_concurrent: int = 2,
            n_attempts: int = 1, agent_max_timeout_s: float | None = None, timeout_s: float = JOB_TIMEOUT_S,
            env: dict[str, str] | None = None) -> Path:
    """`harbor run` of `agent` on the tasks of `tasks_dir` (all, or the named folders) in agentrl's
    local sandbox; returns the job folder. `agent_max_timeout_s` caps each task's agent timeout
    (Harbor's agent max_timeout_sec, which has no CLI flag: the job config is resolved with
    --print-config, set, and run with -c). Raises RuntimeError with Harbor's last output lines
    when it exits non-zero."""
    argv = [harbor_executable(), "run", "-p", str(tasks_dir), "-a", agent, "--env", IMPORT_PATH,
            "-o", str(jobs_dir), "--job-name", job_name, "-n", str(n_concurrent), "-k", str(n_attempts), "-y", "-q"]
    for t in tasks or []:
        argv += ["-i", t]
    if model:
        argv += ["-m", model]
    for key, value in (agent_kwargs or {}).items():
        argv += ["--ak", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    # LiteLLM fetches a price list from the internet at import unless told to use its own copy.
    child_env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **(env or {})}
    if agent_max_timeout_s is not None:
        argv = _with_agent_max_timeout(argv, agent_max_timeout_s, jobs_dir / f"{job_name}.job.json", child_env)
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout_s, env=child_env)
    job_dir = jobs_dir / job_name
    if proc.returncode != 0 or not (job_dir / "result.json").is_file():
        tail = (proc.stdout + proc.stderr)[-_TAIL_CHARS:]
        raise RuntimeError(f"harbor run exited {proc.returncode} ({' '.join(argv[1:6])} ...): {tail}")
    return job_dir


def _with_agent_max_timeout(argv: list[str], max_timeout_s: float, config_path: Path, env: dict[str, str]) -> list[str]:
    printed = subprocess.run([*argv, "--print-config"], check=False, capture_output=True, text=True, timeout=120,
                             env=env)
    text = printed.stdout[printed.stdout.find("{"):]
    try:
        config = json.loads(text)
    except ValueError:
        raise RuntimeError(f"harbor run --print-config gave no job config: {(printed.stdout + printed.stderr)[-_TAIL_CHARS:]}") from None
    for agent in config["agents"]:
        agent["max_timeout_sec"] = max_timeout_s
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(config, indent=1))
    return [argv[0], "run", "-c", str(config_path), "-y", "-q"]


def trial_outcome(result: dict[str, Any]) -> tuple[str, float | None]:
    """(outcome, reward) of one trial's result.json (see the module docstring)."""
    exc = (result.get("exception_info") or {}).get("exception_type")
    rewards = (result.get("verifier_result") or {}).get("rewards") or {}
    reward = rewards.get("reward")
    if reward is None and rewards:
        reward = sum(rewards.values()) / len(rewards)  # agentrl's reading of a reward.json without "reward"
    if exc in VERIFIER_ERRORS:
        return VERIFIER_ERRORS[exc], None
    if reward is not None and (exc is None or exc in REWARD_STANDS):
        return "scored", float(reward)
    return f"infra_error:harbor_{exc or 'no_reward'}", None


def short_task_name(name: str) -> str:
    """Harbor names tasks "org/name"; agentrl's ids are the folder names."""
    return name.split("/", 1)[-1]


def read_job(job_dir: Path) -> list[dict[str, Any]]:
    """One row per trial of a finished job: task, trial, outcome, reward, exception, seconds."""
    rows = []
    for path in sorted(job_dir.glob("*/result.json")):
        r = json.loads(path.read_text())
        outcome, reward = trial_outcome(r)
        exc = r.get("exception_info") or {}
        rows.append({
            "task_id": short_task_name(r["task_name"]), "trial": r["trial_name"], "outcome": outcome,
            "reward": reward, "exception": exc.get("exception_type"),
            "exception_message": (exc.get("exception_message") or "")[:300] or None,
            "agent_s": _seconds(r.get("agent_execution")), "verifier_s": _seconds(r.get("verifier")),
        })
    return rows


def _seconds(timing: dict | None) -> float | None:
    from datetime import datetime

    if not timing or not timing.get("started_at") or not timing.get("finished_at"):
        return None
    start, end = (datetime.fromisoformat(timing[k]) for k in ("started_at", "finished_at"))
    return round((end - start).total_seconds(), 2)
