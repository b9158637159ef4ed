"""The Daytona backend's command runner and error classifier (pure helpers over the SDK).

A command runs as an async session command that we poll in short calls: field reports show idle
exec HTTP connections dropped after ~240 s, so no call here waits on the command itself. Output
is capped inside the sandbox (`head -c`, the rest drained so the command never sees SIGPIPE),
so a command printing gigabytes costs us only the cap. The timeout fires inside the sandbox
first (coreutils `timeout` signals the command's whole process group, and the output so far
survives because `head` flushes on EOF); our own deadline, a few seconds later, deletes the
session, which kills whatever escaped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import shlex
import uuid
from typing import Any

from agentrl.sandbox.base import ExecResult

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0  # ceiling of any single HTTP call we make
POLL_MIN_S, POLL_MAX_S = 0.05, 1.0  # poll fast first (most commands take milliseconds), then back off
CLIENT_GRACE_S = 3.0  # our deadline trails the in-sandbox timeout by this much (TERM, then KILL 2 s later)
TRANSIENT_POLL_ERRORS = 3  # consecutive connection errors tolerated while polling
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def wrap_command(
    command: str, cwd: str | None, env: dict[str, str], max_output_bytes: int, timeout_s: float
) -> str:
    """The shell line the session runs: `bash -c command` in `cwd` with `env`, stderr merged,
    output cut to max_output_bytes + 1 (the extra byte tells us it was cut), exit status kept."""
    bad = [k for k in env if not _ENV_NAME.match(k)]
    if bad:
        raise ValueError(f"exec env names must be shell identifiers, got {bad}")
    inner = shlex.quote(command)
    limit = sandbox_timeout(timeout_s)
    run = (
        f"if command -v timeout >/dev/null 2>&1; then exec timeout -k 2 {limit} bash -c {inner}; "
        f"else exec bash -c {inner}; fi"
    )
    steps = [f"cd {shlex.quote(cwd)}"] if cwd else []
    steps += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    left = "( " + " && ".join([*steps, run]) + " )" if steps else f"( {run} )"
    script = f"{left} </dev/null 2>&1 | {{ head -c {max_output_bytes + 1}; cat >/dev/null; }}; exit ${{PIPESTATUS[0]}}"
    return "bash -c " + shlex.quote(script)


def sandbox_timeout(timeout_s: float) -> int:
    """Whole seconds, since busybox `timeout` takes no fractions."""
    return max(1, math.ceil(timeout_s))


async def run_command(
    process: Any,
    command: str,
    *,
    cwd: str | None,
    env: dict[str, str],
    timeout_s: float,
    max_output_bytes: int,
) -> ExecResult:
    """Run `command` through the SDK's `AsyncProcess`; SDK errors propagate to the caller, which
    classifies them. A timeout is a result, not an error."""
    from daytona import DaytonaConnectionError, SessionExecuteRequest

    if timeout_s <= 0 or max_output_bytes <= 0:
        raise ValueError(
            f"timeout_s and max_output_bytes must be positive, got {timeout_s}, {max_output_bytes}"
        )
    session = f"agentrl-{uuid.uuid4().hex[:12]}"
    script = wrap_command(command, cwd, env, max_output_bytes, timeout_s)
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + sandbox_timeout(timeout_s) + CLIENT_GRACE_S
    await process.create_session(session, request_timeout=CALL_TIMEOUT_S)
    try:
        resp = await process.execute_session_command(
            session, SessionExecuteRequest(command=script, run_async=True), timeout=int(CALL_TIMEOUT_S)
        )
        exit_code: int | None = None
        interval, transient = POLL_MIN_S, 0
        while True:
            try:
                cmd = await process.get_session_command(session, resp.cmd_id, request_timeout=CALL_TIMEOUT_S)
                transient = 0
            except DaytonaConnectionError:
                transient += 1
                if transient > TRANSIENT_POLL_ERRORS:
                    raise
                cmd = None
            if cmd is not None and cmd.exit_code is not None:
                exit_code = cmd.exit_code
                break
            left = deadline - loop.time()
            if left <= 0:
                break
            await asyncio.sleep(min(interval, left))
            interval = min(interval * 1.5, POLL_MAX_S)
        logs = await process.get_session_command_logs(session, resp.cmd_id, request_timeout=CALL_TIMEOUT_S)
    finally:
        # Deleting the session kills a command still running; shielded so a cancelled exec
        # still kills it. Best effort: a dead sandbox is reported by the caller's probe.
        await asyncio.shield(_delete_session(process, session))
    raw = (logs.output or logs.stdout or "").encode("utf-8", "surrogateescape")
    truncated = len(raw) > max_output_bytes
    output = raw[:max_output_bytes].decode("utf-8", "replace")
    # coreutils `timeout` fired in the sandbox just before our own deadline
    killed_inside = exit_code in (124, 137) and loop.time() - started >= timeout_s
    if exit_code is None or killed_inside:
        return ExecResult(-1, output, timed_out=True, truncated=truncated)
    return ExecResult(exit_code, output, timed_out=False, truncated=truncated)


async def _delete_session(process: Any, session: str) -> None:
    try:
        await process.delete_session(session, request_timeout=CALL_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - the sandbox may be gone; nothing left to kill then
        log.debug("deleting exec session %s failed: %s", session, type(e).__name__)


# kill_all inside a Daytona sandbox (a container: its own pid namespace). SIGKILL every process but
# pid 1 (the container's init; its exit would end the sandbox), this script's own ancestors (the
# daemon that runs commands, the shell it started) and this script's own helpers, in rounds until
# a scan finds nothing, then print "ended N". Exit 3 with the survivors after KILL_ALL_ROUNDS
# rounds. Exit 4, killing nothing, in the host's pid namespace (kthreadd, pid 2 with parent 0
# and no command line, is visible only there): run anywhere else it would end every process.
# POSIX sh, builtins only in the loop (read, set, kill), so it works in busybox images too.
KILL_ALL_ROUNDS = 200  # x ~0.05 s: a process that outlives ~10 s of SIGKILLs is reported
KILL_ALL_EXEC_TIMEOUT_S = 60
KILL_ALL_SCRIPT = r"""
if [ -r /proc/2/stat ] && [ -z "$(tr -d '\000' < /proc/2/cmdline 2>/dev/null)" ]; then
  read -r st < /proc/2/stat
  case "$st" in "2 (kthreadd) "?" 0 "*) echo "refused: this shell runs in the host's pid namespace"; exit 4;; esac
fi
self=$$
keep=" 1 $self "
p=$self
while [ "$p" -gt 1 ]; do
  read -r st 2>/dev/null < "/proc/$p/stat" || break
  set -- ${st##*) }
  p=$2
  keep="$keep$p "
done
ended=0
killed=" "
round=0
while :; do
  victims=""
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    case "$keep" in *" $pid "*) continue;; esac
    read -r st 2>/dev/null < "$d/stat" || continue
    set -- ${st##*) }
    [ "$1" = Z ] && continue
    [ "$2" = "$self" ] && continue
    victims="$victims $pid"
  done
  [ -z "$victims" ] && break
  round=$((round + 1))
  if [ "$round" -gt @ROUNDS@ ]; then echo "survivors:$victims"; exit 3; fi
  for pid in $victims; do
    if kill -9 "$pid" 2>/dev/null; then
      case "$killed" in *" $pid "*) ;; *) killed="$killed$pid "; ended=$((ended + 1));; esac
    fi
  done
  sleep 0.05 2>/dev/null || sleep 1
done
echo "ended $ended"
""".replace("@ROUNDS@", str(KILL_ALL_ROUNDS))


def kill_all_result(exit_code: int | None, output: str, sandbox_id: str) -> int:
    """How many processes KILL_ALL_SCRIPT ended; SandboxError(kill) when it could not finish."""
    from agentrl.sandbox.base import SandboxError

    text = (output or "").strip()
    last = text.splitlines()[-1] if text else ""
    if exit_code == 0 and last.startswith("ended "):
        return int(last.split()[1])
    if exit_code == 3:
        raise SandboxError("kill", f"sandbox {sandbox_id}: processes outlived SIGKILL ({last[:200]})")
    raise SandboxError("kill", f"kill_all in sandbox {sandbox_id} failed (exit {exit_code}): {text[-300:]}")


def classify_create_error(exc: BaseException) -> str:
    """create error -> kind: throttled and capacity are retried; the rest are not."""
    from daytona import (
        DaytonaAuthenticationError,
        DaytonaForbiddenError,
        DaytonaRateLimitError,
        DaytonaServiceUnavailableError,
    )

    msg = str(exc).lower()
    status = getattr(exc, "status_code", None)
    if (
        isinstance(exc, DaytonaRateLimitError)
        or status == 429
        or "rate limit" in msg
        or "too many requests" in msg
    ):
        return "throttled"
    if isinstance(exc, (DaytonaAuthenticationError, DaytonaForbiddenError)):
        return "auth"
    if "build_failed" in msg or "build failed" in msg or "failed to build" in msg:
        return "image_build"
    capacity_words = (
        "no available runner",
        "no runners available",
        "insufficient capacity",
        "out of capacity",
    )
    if (
        isinstance(exc, DaytonaServiceUnavailableError)
        or status == 503
        or any(w in msg for w in capacity_words)
    ):
        return "capacity"
    return "create"


def retry_after_s(exc: BaseException) -> float | None:
    """The Retry-After header of a throttling answer, in seconds, when it has a usable one."""
    headers = getattr(exc, "headers", None) or {}
    value = next((v for k, v in headers.items() if str(k).lower() == "retry-after"), None)
    try:
        return max(0.0, float(value)) if value is not None else None
    except (TypeError, ValueError):
        return None  # an HTTP date: rare enough to fall back on our own backoff
