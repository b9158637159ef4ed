"""A run's transcripts as a Harbor job folder of ATIF trajectories, which `harbor view OUT` opens.

    agentrl harbor atif RUN_DIR --out OUT      # then: harbor view OUT

Layout (what Harbor's viewer reads): OUT/<job>/config.json (a JobConfig), OUT/<job>/result.json
(a JobResult), and per episode OUT/<job>/<task>__<episode>/ with config.json (TrialConfig),
lock.json (TrialLock), result.json (TrialResult: the episode's reward as the verifier's, its
timings, an infra error as the exception) and agent/trajectory.json (the ATIF trajectory,
validated by Harbor's own Trajectory model). Every file is built with Harbor's models, so a
schema change in Harbor fails here, not in the viewer. Needs the optional `harbor` extra.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from agentrl.harbor.atif import AGENT_NAME, TurnCutter, transcript_to_atif

# Trial names are Harbor's "<task>__<id>"; ids longer than this are shortened with a digest.
_MAX_ID = 40
LOCAL_SANDBOX = "agentrl.harbor.environment:LocalSandboxEnvironment"  # where agentrl's episodes ran, as Harbor names it


def _run_config(run_dir: Path):
    from agentrl.config.schema import RunConfig

    path = run_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass an agentrl run dir (logging.run_dir of the run)")
    return RunConfig.model_validate(json.loads(path.read_text()))


def _tasks_dir(cfg) -> Path | None:
    from agentrl.harbor.eval import tasks_dir_of

    try:
        return tasks_dir_of(cfg)
    except (ValueError, FileNotFoundError):
        return None


def _digest(task_dir: Path | None, task_id: str) -> str:
    h = hashlib.sha256(task_id.encode())
    if task_dir is not None and task_dir.is_dir():
        for p in sorted(q for q in task_dir.rglob("*") if q.is_file() and not q.is_symlink()):
            h.update(p.relative_to(task_dir).as_posix().encode() + b"\0" + p.read_bytes())
    return f"sha256:{h.hexdigest()}"


def _trial_name(task_id: str, episode_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in episode_id)
    if len(safe) > _MAX_ID:
        safe = safe[: _MAX_ID - 9] + "-" + hashlib.sha1(safe.encode()).hexdigest()[:8]
    return f"{task_id}__{safe}"


def _times(row: dict[str, Any]) -> tuple[datetime | None, datetime | None]:
    end = row.get("time")
    if not isinstance(end, (int, float)):
        return None, None
    finished = datetime.fromtimestamp(end, UTC)
    return finished - timedelta(seconds=float(row.get("duration_s") or 0.0)), finished


def trial_files(row: dict[str, Any], atif: dict[str, Any], *, job_dir: Path, job_id: uuid.UUID, tasks_dir: Path | None,
                model_name: str) -> dict[str, str]:
    """{relative path: JSON text} of one episode's trial folder, built with Harbor's models."""
    from harbor.models.agent.context import AgentContext
    from harbor.models.job.lock import TaskLock, TrialLock, VerifierLock
    from harbor.models.trajectories import Trajectory
    from harbor.models.trial.config import AgentConfig, TrialConfig
    from harbor.models.trial.config import TaskConfig as TrialTaskConfig
    from harbor.models.trial.result import AgentInfo, ExceptionInfo, ModelInfo, TimingInfo, TrialResult
    from harbor.models.verifier.result import VerifierResult

    task_id, episode = str(row["task_id"]), str(row.get("episode_id") or uuid.uuid4().hex)
    name = _trial_name(task_id, episode)
    task_dir = tasks_dir / task_id if tasks_dir is not None else Path(task_id)
    trajectory = Trajectory.model_validate(atif)  # Harbor's own schema check
    agent = AgentConfig(name=AGENT_NAME, model_name=model_name)
    config = TrialConfig(task=TrialTaskConfig(path=task_dir), trial_name=name, trials_dir=job_dir, agent=agent,
                         job_id=job_id)
    lock = TrialLock(task=TaskLock(name=task_id, type="local", digest=_digest(task_dir, task_id), path=task_dir),
                     agent=agent, environment=config.environment, verifier=VerifierLock())
    started, finished = _times(row)
    outcome, reward = str(row.get("outcome")), row.get("reward")
    exception = None
    if outcome.startswith("infra_error") or outcome == "agent_timeout":
        kind = "AgentTimeoutError" if outcome == "agent_timeout" else outcome.split(":", 1)[-1]
        exception = ExceptionInfo(exception_type=kind, exception_message=str((row.get("info") or {}).get("error", outcome)),
                                  exception_traceback="", occurred_at=finished or datetime.now(UTC))
    result = TrialResult(
        id=uuid.uuid5(uuid.NAMESPACE_URL, f"agentrl:{episode}"), task_name=task_id, trial_name=name,
        trial_uri=(job_dir / name).as_uri(), task_id=config.task.get_task_id(), source=None,
        task_checksum=lock.task.digest.split(":", 1)[1], config=config,
        agent_info=AgentInfo(name=AGENT_NAME, version=atif["agent"]["version"],
                             model_info=ModelInfo(name=model_name, provider="agentrl")),
        agent_result=AgentContext(n_output_tokens=row.get("generated")),
        verifier_result=VerifierResult(rewards={"reward": reward}) if reward is not None else None,
        exception_info=exception, started_at=started, finished_at=finished,
        agent_execution=TimingInfo(started_at=started, finished_at=finished))
    return {
        f"{name}/agent/trajectory.json": json.dumps(trajectory.to_json_dict(), indent=1),
        f"{name}/config.json": config.model_dump_json(indent=1),
        f"{name}/lock.json": lock.model_dump_json(indent=1),
        f"{name}/result.json": result.model_dump_json(indent=1),
    }


def export_run(run_dir: Path, out_dir: Path, *, job_name: str | None = None) -> tuple[Path, int]:
    """Write RUN_DIR's transcripts as one Harbor job under OUT; returns (job folder, episodes)."""
    from harbor.models.job.config import JobConfig
    from harbor.models.job.result import JobResult, JobStats
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig

    from agentrl.agent.actions import make_action_format
    from agentrl.models.tokenizer import load_tokenizer
    from agentrl.view.load import iter_jsonl
    from envs.tbench2.loader import TaskFormatError, load_task

    run_dir = Path(run_dir)
    cfg = _run_config(run_dir)
    files = sorted((run_dir / "transcripts").glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{run_dir}/transcripts has no *.jsonl (logging.transcripts was off, or no episode ended)")
    model_name = cfg.model.name
    cutter = TurnCutter.for_tokenizer(load_tokenizer(cfg.model.path or cfg.model.name))
    system_prompt = make_action_format(cfg.agent.action_format, cfg.agent.command_timeout_s).system_prompt
    tasks_dir = _tasks_dir(cfg)
    job = job_name or f"agentrl-{run_dir.resolve().name}"
    job_dir = Path(out_dir) / job
    job_id = uuid.uuid5(uuid.NAMESPACE_URL, f"agentrl-job:{run_dir.resolve()}")
    instructions: dict[str, str | None] = {}
    n = errored = 0
    skipped: dict[str, int] = {}
    for path in files:
        for row in iter_jsonl(path, skipped):
            task_id = str(row.get("task_id"))
            if task_id not in instructions:
                try:
                    instructions[task_id] = load_task(tasks_dir / task_id).instruction if tasks_dir else None
                except (TaskFormatError, FileNotFoundError):
                    instructions[task_id] = None
            atif = transcript_to_atif(row, cutter=cutter, model_name=model_name, system_prompt=system_prompt,
                                      instruction=instructions[task_id])
            for rel, text in trial_files(row, atif, job_dir=job_dir, job_id=job_id, tasks_dir=tasks_dir,
                                         model_name=model_name).items():
                target = job_dir / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text + "\n")
            n += 1
            errored += str(row.get("outcome", "")).startswith("infra_error")
    now = datetime.now(UTC)
    job_config = JobConfig(job_name=job, jobs_dir=Path(out_dir), agents=[AgentConfig(name=AGENT_NAME, model_name=model_name)],
                           environment=EnvironmentConfig(import_path=LOCAL_SANDBOX))
    (job_dir / "config.json").write_text(job_config.model_dump_json(indent=1))
    stats = JobStats(n_completed_trials=n, n_errored_trials=errored)
    (job_dir / "result.json").write_text(JobResult(id=job_id, started_at=now, finished_at=now, n_total_trials=n,
                                                   stats=stats).model_dump_json(indent=1))
    return job_dir, n
