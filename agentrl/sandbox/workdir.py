"""Letting a verifier into a working directory the agent locked, on the local sandbox.

An agent's `chmod 444 /app` (or `chmod 600 .`) is its own failed attempt, but the local sandbox's
root has neither CAP_DAC_OVERRIDE nor CAP_DAC_READ_SEARCH (local_box.py drops the whole bounding
set): an exec whose cwd is that folder fails in `env -C` with 125 before its command runs, where
root on Docker enters it anyway. A verifier's test.sh, whose verdict is the tests' to give, then
never runs. ENTER_WORKDIR gives the working directory, and every folder above it, its owner's
search bit back only where the sandbox cannot enter it; a folder it can enter keeps the agent's
modes (on Daytona root enters every folder, so nothing changes there). Run it before verifying
only, never before an agent's own commands.

Used by envs/tbench2/scorer.py (inside its reset script) and agentrl/harbor/environment.py.
"""

from __future__ import annotations

import shlex

# A POSIX sh fragment; $1 is the working directory (absolute). It leaves $p, IFS and -f as it found
# them for what follows in the same script, and its exit status is 0.
ENTER_WORKDIR = (
    'p=; set -f; IFS=/; for c in $1; do [ -n "$c" ] || continue; p="$p/$c"; '
    '[ -d "$p" ] && ! (cd "$p") 2>/dev/null && chmod u+x "$p" 2>/dev/null; done; unset IFS; set +f; '
)


def enter_workdir_command(workdir: str) -> str:
    """A command (run it with cwd="/") that makes `workdir` enterable as described above."""
    return f"sh -c {shlex.quote(ENTER_WORKDIR)} sh {shlex.quote(workdir)}"
