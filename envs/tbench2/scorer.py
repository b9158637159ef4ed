"""Score a terminal-bench-2 episode with the task's own tests/test.sh.

Steps (REFERENCE section 4): remove any reward file the agent may have planted (and any /tests it
made), upload tests/ to /tests, run `bash /tests/test.sh` in the task's working directory under the
verifier timeout, then read the verdict:
- /logs/verifier/reward.json, if present: a non-empty JSON object of finite numbers. The reward is
  its "reward" key when there is one, else the mean of its values.
- else /logs/verifier/reward.txt: one finite float.
A missing, empty, malformed or non-finite verdict is `infra_error:verifier`, and a verifier that
outlives its timeout is `infra_error:verifier_timeout`: neither is ever reward 0. test.sh's exit
code does not matter once a verdict was written (tests usually exit 1 after writing 0).

Only the Sandbox protocol is used, so this works the same on the local and the Daytona backend.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from agentrl.sandbox.base import Sandbox, SandboxError
from envs.tbench2.loader import TaskSpec

VERIFIER_DIR = "/logs/verifier"
TESTS_DIR = "/tests"
SCORED = "scored"
VERIFIER_ERROR = "infra_error:verifier"
VERIFIER_TIMEOUT = "infra_error:verifier_timeout"
_MAX_REWARD_FILE_BYTES = 64 * 1024
_SETUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ScoreResult:
    status: str  # "scored" or "infra_error:<kind>"
    reward: float | None  # set only when status == "scored"
    detail: str  # why, in one line
    output: str = ""  # what test.sh printed (capped)
    elapsed_s: float = 0.0


def parse_reward_json(text: str) -> float:
    """The reward of a reward.json; ValueError says what is wrong with it."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"reward.json is not JSON: {err}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"reward.json must be a non-empty object of numbers, got {text[:200]!r}")
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"reward.json[{key!r}] = {value!r} is not a finite number")
    if "reward" in data:
        return float(data["reward"])
    return sum(float(v) for v in data.values()) / len(data)


def parse_reward_txt(text: str) -> float:
    stripped = text.strip()
    if not stripped:
        raise ValueError("reward.txt is empty")
    try:
        value = float(stripped)
    except ValueError:
        raise ValueError(f"reward.txt holds {stripped[:200]!r}, not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"reward.txt holds {stripped!r}, not a finite number")
    return value


async def upload_tree(sandbox: Sandbox, src: Path, dest: str) -> int:
    """Upload every file under `src` to `dest` in the sandbox, keeping executable bits. Symlinks
    in the task folder are skipped (never followed out of it). Returns the number of files."""
    files = sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink())
    executable = []
    for p in files:
        target = f"{dest.rstrip('/')}/{p.relative_to(src).as_posix()}"
        await sandbox.upload(p.read_bytes(), target)
        if p.stat().st_mode & 0o111:
            executable.append(target)
    if executable:
        res = await sandbox.exec("chmod +x -- " + " ".join(shlex.quote(t) for t in executable), cwd="/")
        if res.exit_code != 0:
            raise SandboxError("exec", f"chmod of uploaded tests failed: {res.output[:300]}")
    return len(files)


async def score_task(
    sandbox: Sandbox, task: TaskSpec, *, timeout_s: float | None = None, max_output_bytes: int = 64 * 1024
) -> ScoreResult:
    """Run the task's verifier in `sandbox` and read its verdict. Never raises for a sandbox or
    verifier failure: those come back as an `infra_error:<kind>` status."""
    start = time.monotonic()
    timeout = timeout_s if timeout_s is not None else task.verifier_timeout_s

    def done(status: str, reward: float | None, detail: str, output: str = "") -> ScoreResult:
        return ScoreResult(status, reward, detail, output, time.monotonic() - start)

    try:
        # rm -rf, not rm -f: the agent may have planted a directory or a symlink at these paths.
        reset = await sandbox.exec(
            f"rm -rf {VERIFIER_DIR}/reward.* {TESTS_DIR} && mkdir -p {VERIFIER_DIR} {TESTS_DIR} "
            f"{shlex.quote(task.workdir)}",
            cwd="/",
            timeout_s=_SETUP_TIMEOUT_S,
        )
        if reset.exit_code != 0:
            return done(VERIFIER_ERROR, None, f"cannot prepare {VERIFIER_DIR}: {reset.output.strip()[:300]}")
        await upload_tree(sandbox, task.tests_dir, TESTS_DIR)
        run = await sandbox.exec(
            f"bash {TESTS_DIR}/test.sh",
            cwd=task.workdir,
            env=dict(task.verifier_env),
            timeout_s=timeout,
            max_output_bytes=max_output_bytes,
        )
        if run.timed_out:
            return done(
                VERIFIER_TIMEOUT,
                None,
                f"tests/test.sh ran past the verifier timeout of {timeout:g} s",
                run.output,
            )
        verdict = await sandbox.exec(
            f"for f in reward.json reward.txt; do if [ -f {VERIFIER_DIR}/$f ]; then echo $f; "
            f"head -c {_MAX_REWARD_FILE_BYTES} {VERIFIER_DIR}/$f; exit 0; fi; done; exit 3",
            cwd="/",
            timeout_s=_SETUP_TIMEOUT_S,
            max_output_bytes=_MAX_REWARD_FILE_BYTES + 64,
        )
    except SandboxError as err:
        return done(f"infra_error:{err.kind}", None, f"sandbox failed while scoring: {err}")
    if verdict.exit_code == 3:
        return done(
            VERIFIER_ERROR,
            None,
            f"tests/test.sh (exit {run.exit_code}) wrote no {VERIFIER_DIR}/reward.json or reward.txt",
            run.output,
        )
    name, _, content = verdict.output.partition("\n")
    if verdict.exit_code != 0 or name not in ("reward.json", "reward.txt"):
        return done(
            VERIFIER_ERROR, None, f"cannot read the reward file: {verdict.output.strip()[:300]}", run.output
        )
    try:
        reward = parse_reward_json(content) if name == "reward.json" else parse_reward_txt(content)
    except ValueError as err:
        return done(VERIFIER_ERROR, None, str(err), run.output)
    return done(SCORED, reward, f"{name} -> {reward:g} (test.sh exit {run.exit_code})", run.output)
