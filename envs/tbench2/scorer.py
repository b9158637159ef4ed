"""Score a terminal-bench-2 episode with the task's own tests/test.sh.

The policy is an adversary: whatever lets it forge a pass, it will find. So, in order:
1. every process of the agent is ended (`Sandbox.kill_all`: setsid daemons, tmux servers, loops
   waiting for /tests to appear), so nothing it left running can write a verdict or swap a test;
2. /tests and /logs/verifier are removed whatever the agent made of them (a planted verdict, a
   symlink elsewhere, a directory where the file goes, chmod/chattr locks, a mount on top) and
   made again, owned by the verifier (root); the task's working directory is made again if the
   agent removed it, and made enterable if it took its owner's search permission (see
   agentrl/sandbox/workdir.py);
3. only now tests/ is uploaded to /tests, and `bash /tests/test.sh` runs in the task's working
   directory under the verifier timeout, with the image's environment plus `[verifier.env]`
   (nothing the agent exported reaches it) and /bin/bash itself rather than the first `bash` on
   PATH;
4. the verdict is read once, right after test.sh exits:
   - /logs/verifier/reward.json, if present: a non-empty JSON object of finite numbers. The reward
     is its "reward" key when there is one, else the mean of its values.
   - else /logs/verifier/reward.txt: one finite float.
A missing, empty, malformed or non-finite verdict is `infra_error:verifier`, and a verifier that
outlives its timeout is `infra_error:verifier_timeout`: neither is ever reward 0. test.sh's exit
code does not matter once a verdict was written (tests usually exit 1 after writing 0).

Who broke it: a verifier that fails in the agent's own sandbox while the backend still answers (no
SandboxError) may have been broken by the agent itself (a deleted bash or coreutils, a filled
disk): as an infra error such an episode is retried and then dropped, so the policy never learns
that breaking its machine fails the task. So steps 2-4 run once more, as a control, in a fresh
sandbox of the task's environment with nothing of the attempt in it: if the tests run there (any
verdict), the machinery works and the agent's changes are what stopped them, and the episode is
scored 0 (its detail says so); if they fail there too, the task or the infrastructure is at fault
and the infra error stands. Timeouts get no control (it would cost the timeout again).

What the same sandbox cannot defend against: files the agent changed that the tests then trust,
e.g. a replaced python or pytest in a folder on the image's PATH, a .pth file in a site-packages
folder, /etc/ld.so.preload (locally /usr and /etc are read-only, so these need a writable folder
the task's own image puts on PATH). For those, `[verifier] sandbox = "fresh"` (or
`verifier_sandbox="fresh"` here) runs steps 2-4 in a fresh sandbox of the task's environment
into which only the task's declared outputs are carried (carry.py).

Only the Sandbox protocol is used, so this works the same on the local and the Daytona backend.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import dataclass, replace
from pathlib import Path

from agentrl.sandbox.base import Sandbox, SandboxError, SandboxProvider
from agentrl.sandbox.workdir import ENTER_WORKDIR as _ENTER_WORKDIR  # the verifier's way into a locked workdir
from envs.tbench2.carry import pack_outputs, unpack_outputs
from envs.tbench2.loader import VERIFIER_SANDBOXES, TaskSpec

VERIFIER_DIR = "/logs/verifier"
TESTS_DIR = "/tests"
SCORED = "scored"
VERIFIER_ERROR = "infra_error:verifier"
VERIFIER_TIMEOUT = "infra_error:verifier_timeout"
_MAX_REWARD_FILE_BYTES = 64 * 1024
_SETUP_TIMEOUT_S = 60.0
# Step 2: undo a mount on top (lazily, a few times: mounts stack), a link or a file where a folder
# goes (removed first, so nothing below follows it elsewhere), an immutable flag, modes that keep
# even their owner out (for a root without CAP_DAC_OVERRIDE: not Docker's, Daytona's or the local
# sandbox's); then fresh folders owned by the verifier, and a working directory the verifier can
# enter (_ENTER_WORKDIR). $1 is the task's working directory.
_RESET_SCRIPT = (
    "for d in /tests /logs/verifier /logs; do i=0; "
    "while [ $i -lt 8 ] && grep -q \" $d \" /proc/self/mountinfo 2>/dev/null; do umount -l \"$d\" 2>/dev/null || break; "
    "i=$((i+1)); done; done; "
    "for d in /tests /logs /logs/verifier; do "
    "if [ -L \"$d\" ] || { [ -e \"$d\" ] && [ ! -d \"$d\" ]; }; then rm -f \"$d\" 2>/dev/null; fi; done; "
    "chattr -R -i /tests /logs 2>/dev/null; chmod u+rwx /logs 2>/dev/null; chmod -R u+rwX /tests /logs/verifier 2>/dev/null; "
    + _ENTER_WORKDIR
    + f"rm -rf {TESTS_DIR} {VERIFIER_DIR} && mkdir -p -m 755 {VERIFIER_DIR} {TESTS_DIR} \"$1\" && "
    f"chmod 755 {VERIFIER_DIR} {TESTS_DIR}"
)
# Step 3: /bin/bash when the image has one (a `bash` planted earlier on PATH is not it). The marker tells a
# test.sh that wrote no verdict from one that never started (the exec could not enter the workdir, say): the
# message then says which, where both once read "test.sh (exit 125) wrote no reward" (the verdict is the same).
_STARTED = f"{VERIFIER_DIR}/.agentrl-test-sh-started"
_RUN_TESTS = (f": > {_STARTED}; if [ -x /bin/bash ]; then exec /bin/bash {TESTS_DIR}/test.sh; fi; "
              f"exec bash {TESTS_DIR}/test.sh")


@dataclass
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
    sandbox: Sandbox,
    task: TaskSpec,
    *,
    timeout_s: float | None = None,
    max_output_bytes: int = 64 * 1024,
    provider: SandboxProvider | None = None,
    verifier_sandbox: str | None = None,
) -> ScoreResult:
    """Run the task's verifier for the episode in `sandbox` and read its verdict. Never raises for
    a sandbox or verifier failure: those come back as an `infra_error:<kind>` status.

    `verifier_sandbox` ("same" or "fresh", default: the task's `[verifier] sandbox`) picks where
    the tests run; "fresh" needs the `provider` that made `sandbox`."""
    start = time.monotonic()
    timeout = timeout_s if timeout_s is not None else task.verifier_timeout_s
    mode = verifier_sandbox or task.verifier_sandbox
    if mode not in VERIFIER_SANDBOXES:
        raise ValueError(f"verifier_sandbox={mode!r}: use one of {', '.join(VERIFIER_SANDBOXES)}")
    if mode == "fresh" and provider is None:
        raise ValueError("verifier_sandbox='fresh' needs provider= (the fresh sandbox is created with it)")
    try:
        await sandbox.kill_all()
        if mode == "same":
            result = await _verify(sandbox, task, timeout, max_output_bytes)
            if result.status == VERIFIER_ERROR and provider is not None:
                result = await _with_control(provider, task, timeout, max_output_bytes, result)
        else:
            archive, carried = await pack_outputs(
                sandbox, task.verifier_outputs, int(task.verifier_outputs_max_mb * (1 << 20))
            )
            fresh = await provider.create(task.sandbox_spec(labels={"purpose": "verifier"}))
            try:
                await unpack_outputs(fresh, archive)
                result = await _verify(fresh, task, timeout, max_output_bytes)
            finally:
                await fresh.close()
            result.detail += f" [fresh verifier sandbox: {carried.summary()}]"
    except SandboxError as err:
        result = ScoreResult(f"infra_error:{err.kind}", None, f"sandbox failed while scoring: {err}")
    result.elapsed_s = time.monotonic() - start
    return result


async def _with_control(provider: SandboxProvider, task: TaskSpec, timeout: float, max_output_bytes: int,
                        failed: ScoreResult) -> ScoreResult:
    """`failed` (the verifier broken in the agent's sandbox) judged by a control run in a fresh sandbox of the
    task (the module docstring's "Who broke it")."""
    return judged_by_control(failed, await control_run(provider, task, timeout, max_output_bytes))


async def control_run(provider: SandboxProvider, task: TaskSpec, timeout_s: float | None = None,
                      max_output_bytes: int = 64 * 1024) -> ScoreResult:
    """Steps 2-4 in a fresh sandbox of the task with nothing of any attempt in it: whether the task's
    tests can give a verdict at all. Raises SandboxError where the sandbox itself fails."""
    timeout = timeout_s if timeout_s is not None else task.verifier_timeout_s
    fresh = await provider.create(task.sandbox_spec(labels={"purpose": "verifier-control"}))
    try:
        return await _verify(fresh, task, timeout, max_output_bytes)
    finally:
        await fresh.close()


def judged_by_control(failed: ScoreResult, control: ScoreResult) -> ScoreResult:
    """A verifier error of an attempt, given the control run: scored 0 where the control ran the tests
    (the attempt's changes stopped them), else the error stands (the task or the machinery is at fault)."""
    if control.status != SCORED:
        return replace(failed, detail=f"{failed.detail} [a fresh sandbox of the task fails too: {control.detail}]")
    return replace(failed, status=SCORED, reward=0.0, detail=f"the agent's changes broke the verifier: "
                   f"{failed.detail} [in a fresh sandbox of the task it runs: {control.detail}]")


async def _verify(sandbox: Sandbox, task: TaskSpec, timeout: float, max_output_bytes: int) -> ScoreResult:
    """Steps 2-4 of the module docstring in `sandbox`, whose agent processes are gone."""
    reset = await sandbox.exec(
        f"sh -c {shlex.quote(_RESET_SCRIPT)} sh {shlex.quote(task.workdir)}", cwd="/", timeout_s=_SETUP_TIMEOUT_S
    )
    if reset.exit_code != 0:
        return ScoreResult(VERIFIER_ERROR, None, f"cannot prepare {VERIFIER_DIR}: {reset.output.strip()[:300]}")
    await upload_tree(sandbox, task.tests_dir, TESTS_DIR)
    run = await sandbox.exec(
        _RUN_TESTS,
        cwd=task.workdir,
        env=dict(task.verifier_env),
        timeout_s=timeout,
        max_output_bytes=max_output_bytes,
    )
    if run.timed_out:
        return ScoreResult(
            VERIFIER_TIMEOUT, None, f"tests/test.sh ran past the verifier timeout of {timeout:g} s", run.output
        )
    verdict = await sandbox.exec(
        f"for f in reward.json reward.txt; do if [ -f {VERIFIER_DIR}/$f ]; then echo $f; "
        f"head -c {_MAX_REWARD_FILE_BYTES} {VERIFIER_DIR}/$f; exit 0; fi; done; [ -e {_STARTED} ] && exit 3; exit 4",
        cwd="/",
        timeout_s=_SETUP_TIMEOUT_S,
        max_output_bytes=_MAX_REWARD_FILE_BYTES + 64,
    )
    if verdict.exit_code == 4:
        return ScoreResult(
            VERIFIER_ERROR,
            None,
            f"tests/test.sh never started (the command running it exited {run.exit_code}): "
            f"{run.output.strip()[-300:]}",
            run.output,
        )
    if verdict.exit_code == 3:
        return ScoreResult(
            VERIFIER_ERROR,
            None,
            f"tests/test.sh (exit {run.exit_code}) wrote no {VERIFIER_DIR}/reward.json or reward.txt",
            run.output,
        )
    name, _, content = verdict.output.partition("\n")
    if verdict.exit_code != 0 or name not in ("reward.json", "reward.txt"):
        return ScoreResult(
            VERIFIER_ERROR, None, f"cannot read the reward file: {verdict.output.strip()[:300]}", run.output
        )
    try:
        reward = parse_reward_json(content) if name == "reward.json" else parse_reward_txt(content)
    except ValueError as err:
        return ScoreResult(VERIFIER_ERROR, None, str(err), run.output)
    return ScoreResult(SCORED, reward, f"{name} -> {reward:g} (test.sh exit {run.exit_code})", run.output)
