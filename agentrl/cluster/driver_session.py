"""The run's driver in a session of its own, behind a parent that forwards the stop signals.

Why: a local run starts Ray's head (GCS, raylet, workers) as the driver's children, in the
launcher's process group. Ray blocks only SIGINT in them, so a SIGTERM to the whole group (GNU
`timeout` without --foreground, `kill -TERM -- -PGID`, a supervisor stopping a job by its group)
kills Ray under the driver, and the run stops as after a crash, from its last periodic checkpoint,
instead of finishing the step in flight and checkpointing it (seen on the GPU machine in session 12).

How: `shield_driver()` forks once, before anything starts a thread or a process. The child leads a
new session (so Ray's processes, its children, are out of reach of the launcher's group), asks the
kernel to send it SIGTERM if the parent dies, and returns to run the command. The parent keeps the
launcher's pid, group and terminal: it forwards SIGTERM, SIGINT and SIGHUP to the child, waits, and
exits with the child's exit code (128 + N if a signal N ended it). The same signal arriving twice
within SIGNAL_DEBOUNCE_S is forwarded once: `timeout` sends its SIGTERM to the command's pid and
then to its group, which would otherwise read as the "second signal: stop at once" of the clean stop.

What it does not cover: a stop that signals every process of a job regardless of groups (Slurm's
scancel, systemd's KillMode=control-group) still reaches Ray's processes.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

# The same signal again within this many seconds is the same stop (GNU timeout: pid, then group:
# microseconds apart), not a second one. A person's second Ctrl-C comes later than this.
SIGNAL_DEBOUNCE_S = 1.0
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
ENV_DISABLE = "AGENTRL_DRIVER_SESSION"  # "0": run in the launcher's own process (no fork)


def shield_driver() -> bool:
    """Fork the driver into a session of its own (Linux). Returns True in the child, which goes on
    with the command; the parent never returns (it exits with the child's code). Returns False
    without forking where that is off (ENV_DISABLE=0) or impossible (no os.fork / no prctl)."""
    if os.environ.get(ENV_DISABLE) == "0" or not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return False
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect: nobody would stop us
            os._exit(128 + int(signal.SIGTERM))
        os.environ[ENV_DISABLE] = "0"  # a nested launch from this process does not fork again
        return True
    os._exit(forward_until_exit(pid))


def forward_until_exit(pid: int, debounce_s: float = SIGNAL_DEBOUNCE_S) -> int:
    """Forward FORWARDED signals to pid (each once per debounce_s) until it exits; its exit code."""
    last: dict[int, float] = {}

    def forward(sig: int, _frame) -> None:
        now = time.monotonic()
        if now - last.get(sig, float("-inf")) < debounce_s:
            return
        last[sig] = now
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            _, status = os.waitpid(pid, 0)  # PEP 475: retried after each handled signal
            break
        except ChildProcessError:  # reaped elsewhere: no code to pass on
            return 1
    sys.stdout.flush()
    sys.stderr.flush()
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code
