"""Letting a verifier into a working directory the agent locked, on a sandbox whose root cannot.

An agent's `chmod 444 /app` (or `chmod 600 .`) is its own failed attempt, but where the sandbox's
root has neither CAP_DAC_OVERRIDE nor CAP_DAC_READ_SEARCH (the local sandbox until session 29, which
dropped the whole bounding set; it now keeps local_isolation.ROOT_CAPS) an exec whose cwd is that
folder fails in `env -C` with 125 before its command runs, where root on Docker enters it anyway. A
verifier's test.sh, whose verdict is the tests' to give, then never runs. ENTER_WORKDIR gives the
working directory, and every folder above it, its owner's search bit back only where the sandbox
cannot enter it (and makes the path again where the agent put a file in its way); a folder it can
enter keeps the agent's modes (on Daytona and the local sandbox root enters every folder, so nothing
changes there). Run it before verifying only, never before an agent's own commands.

Used by envs/tbench2/scorer.py (inside its reset script) and agentrl/harbor/environment.py.
"""

from __future__ import annotations

import shlex

# A POSIX sh fragment; $1 is the working directory (absolute). Along the path: a folder the sandbox
# cannot enter gets u+x; a file or a link to no folder where a folder goes is removed (the agent's
# `rm -rf /app; echo x > /app` was an infra error too: the reset's mkdir failed); then the path is made.
# It unsets $p, IFS and -f (set +f) for what follows in the same script.
ENTER_WORKDIR = (
    'p=; set -f; IFS=/; for c in $1; do [ -n "$c" ] || continue; p="$p/$c"; '
    'if [ -d "$p" ]; then (cd "$p") 2>/dev/null || chmod u+x "$p" 2>/dev/null; '
    'elif [ -e "$p" ] || [ -L "$p" ]; then rm -f "$p" 2>/dev/null; fi; done; unset IFS; set +f; '
    'mkdir -p "$1" 2>/dev/null; '
)


def enter_workdir_command(workdir: str) -> str:
    """A command (run it with cwd="/") that makes `workdir` an enterable folder as described above."""
    return f"sh -c {shlex.quote(ENTER_WORKDIR)} sh {shlex.quote(workdir)}"
