"""The sandbox contract: one isolated machine per episode.

Two real backends implement it: local (bubblewrap namespaces) and Daytona (cloud). Errors are
classified before they leave the backend: `SandboxError.kind` becomes the `infra_error:<kind>`
outcome of the episode, never a reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class ExecResult:
    exit_code: int  # -1 when the command was killed (timeout) or never ran
    output: str  # stdout and stderr interleaved, cut to the output cap
    timed_out: bool = False
    truncated: bool = False


# A NUL byte cannot reach a shell (argv and environment strings end at it), and model output can
# decode to one: such a command is the command's failure, scored like any other, never an infra error.
NUL_EXIT_CODE = 126  # the shell's "found but cannot be executed"


def nul_refusal(command: str, env: dict[str, str] | None = None) -> ExecResult | None:
    """The ExecResult of a command (or env entry) holding a NUL byte, None when there is none."""
    where = "command" if "\x00" in command else next(
        (f"env {k!r}" for k, v in (env or {}).items() if "\x00" in k or "\x00" in v), None)
    if where is None:
        return None
    return ExecResult(NUL_EXIT_CODE, f"agentrl: the {where} contains a NUL byte (\\x00), which no shell can "
                                     "receive; it was not run\n")


@dataclass(frozen=True)
class SandboxSpec:
    """What to create. `image` is the task's docker image (Daytona); `files_dir` is the task's
    environment/ folder whose Dockerfile the local backend interprets."""

    image: str | None = None
    files_dir: str | None = None
    workdir: str = "/app"
    env: dict[str, str] = field(default_factory=dict)
    cpus: float = 1.0
    memory_mb: int = 2048
    disk_mb: int = 10240
    allow_network: bool = False
    labels: dict[str, str] = field(default_factory=dict)


class SandboxError(Exception):
    """An infrastructure failure. `kind` names it (create, throttled, image_build, exec, lost, ...)."""

    def __init__(self, kind: str, message: str, *, retryable: bool = False):
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable

    def __reduce__(self):
        # Pickled across Ray actors: Exception's default rebuilds from self.args (the message
        # alone), which this __init__ refuses, and Ray then reports UnserializableException.
        return _rebuild_sandbox_error, (type(self), self.kind, str(self), self.retryable)


def _rebuild_sandbox_error(cls: type[SandboxError], kind: str, message: str, retryable: bool) -> SandboxError:
    return cls(kind, message, retryable=retryable)


@runtime_checkable
class Sandbox(Protocol):
    id: str

    async def exec(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 60.0,
        max_output_bytes: int = 1 << 20,
    ) -> ExecResult:
        """Run `bash -c command`. A timeout kills the command and returns timed_out=True; it does
        not raise. A command or env holding a NUL byte is not run: `nul_refusal`'s result (exit
        126, the reason as output). Raises SandboxError only when the sandbox itself failed."""
        ...

    async def upload(self, data: bytes, path: str) -> None: ...

    async def download(self, path: str) -> bytes: ...

    async def kill_all(self) -> int:
        """End every process in the sandbox except its init (what keeps the sandbox itself up):
        processes of earlier execs, daemons that left their session (`setsid`, `nohup`, double
        forks) and tmux servers included, and wait until none is left. Files stay; later execs
        work as before. Returns how many processes were ended. Raises SandboxError(kind="kill")
        when a process outlives the kill (the caller must not go on as if it were gone) and
        SandboxError(closed|lost) when the sandbox itself is gone; never raises otherwise.
        The verifier calls it before it runs the tests, so nothing the agent started can forge
        or change the verdict."""
        ...

    async def close(self) -> None:
        """Destroy the sandbox and every process in it. Idempotent; never raises."""
        ...


@runtime_checkable
class SandboxProvider(Protocol):
    """Creates sandboxes; owns rate limits, retries and sweeping of orphans."""

    async def create(self, spec: SandboxSpec) -> Sandbox: ...

    async def sweep(self) -> int:
        """Delete sandboxes this run left behind; returns how many."""
        ...

    async def sweep_stale(self) -> int:
        """At run start: delete sandboxes whose owning run (or process) is dead, by the backend's
        stated rule, never one a live run still uses; returns how many."""
        ...

    async def aclose(self) -> None: ...
