"""Local sandboxes: bubblewrap namespaces, as root, without Docker.

Shape: one long-lived bubblewrap "init" per sandbox, and every exec enters its namespaces.
- `bwrap --unshare-all --die-with-parent` starts a tiny init (bwrap's own pid 1 plus
  `sleep infinity`) in fresh user/mount/pid/net/ipc/uts/cgroup namespaces. The sandbox root is a
  host directory the provider owns, bound at `/`; /usr, /etc (and /bin, /lib*, /sbin when they are
  real directories) are bound read-only from the host; /proc and /dev are private; /tmp is the
  root's own tmp/ (private and persistent across execs, which a tmux socket needs).
- `exec` runs `nsenter` into the init's namespaces and root, then drops every capability
  (`setpriv`), applies limits (`prlimit`), starts a new session (`setsid`) and runs `bash -c`.
  Why not one bwrap per exec over a shared root: each exec would get its own pid/net/ipc
  namespaces, so a tmux server (or any server on 127.0.0.1) would not be reachable from the next
  exec, and nothing would own the processes left behind.
- close() SIGKILLs the init: the kernel then kills every process of the pid namespace, including
  daemons that escaped their exec, so nothing outlives the sandbox. If this Python process dies,
  --die-with-parent does the same.

Limits are rlimits (prlimit), per process: address space (memory), CPU seconds, file size (disk),
no core dumps. cgroup v2 would give aggregate memory/cpu/pids limits and an exact kill, but the
machines this backend targets (CI containers, dev boxes) mostly run hybrid cgroup v1 without
delegated v2 controllers (here: only `hugetlb` in the unified tree), so rlimits are what works
everywhere. `spec.cpus` is not enforced locally, and there is no process-count limit: RLIMIT_NPROC
does not apply to processes that map to the host's root (measured: 80 forks pass `--nproc=50`), so a
fork bomb in a local sandbox reaches the host; a pids cgroup is the fix where one is delegated.

Network: none (a private net namespace with only loopback) unless the task allows it and
`sandbox.local_allow_network` is true. The host's /etc/shadow and /etc/gshadow are masked.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

from agentrl.config.schema import SandboxConfig
from agentrl.sandbox.base import SandboxError, SandboxSpec
from agentrl.sandbox.dockerfile import (
    DockerfileError,
    DockerfilePlan,
    apply_copies,
    host_path,
    parse_dockerfile,
)
from agentrl.sandbox.local_box import LocalLimits, LocalSandbox, kill_pid

__all__ = ["LocalLimits", "LocalSandbox", "LocalSandboxProvider"]

_TOOLS = ("bwrap", "nsenter", "setpriv", "prlimit", "setsid", "env", "bash")
# Bound from the host (read-only) or private mounts: a COPY into them cannot be honoured.
_READ_ONLY = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/dev")
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _tool(name: str) -> str:
    # Tools run inside the sandbox too, so they must live under the read-only /usr we bind.
    for d in ("/usr/bin", "/usr/sbin", "/bin", "/sbin"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    pkg = {"bwrap": "bubblewrap", "nsenter": "util-linux", "setpriv": "util-linux", "prlimit": "util-linux"}
    raise SandboxError(
        "create",
        f"local sandbox needs `{name}`; install it (apt-get install -y {pkg.get(name, 'coreutils')})",
    )


class LocalSandboxProvider:
    """Creates LocalSandboxes under `<root_dir>/agentrl-sandboxes/<run_id>/<sandbox id>/`."""

    def __init__(
        self,
        config: SandboxConfig | None = None,
        run_id: str | None = None,
        *,
        root_dir: str | Path | None = None,
    ):
        self.config = config or SandboxConfig()
        self.run_id = run_id or uuid.uuid4().hex[:12]
        if not _SAFE_ID.match(self.run_id):
            raise ValueError(f"run_id {self.run_id!r}: use 1-64 letters, digits, '_', '.', '-'")
        self.base_dir = Path(root_dir or tempfile.gettempdir()) / "agentrl-sandboxes" / self.run_id
        self._live: dict[str, LocalSandbox] = {}
        self._create_slots = asyncio.Semaphore(self.config.max_concurrent_creates)

    def limits_for(self, spec: SandboxSpec) -> LocalLimits:
        """The task's memory, at least `local_memory_mb`; `local_cpu_seconds` of CPU per process;
        the task's disk size as the largest file one process may write."""
        mem_mb = max(spec.memory_mb, self.config.local_memory_mb)
        return LocalLimits(mem_mb << 20, self.config.local_cpu_seconds, max(spec.disk_mb, 1) << 20)

    async def create(self, spec: SandboxSpec) -> LocalSandbox:
        tools = {name: _tool(name) for name in _TOOLS}
        plan = None
        dockerfile = Path(spec.files_dir) / "Dockerfile" if spec.files_dir else None
        if dockerfile is not None and dockerfile.is_file():
            try:
                plan = parse_dockerfile(dockerfile.read_text(), source=str(dockerfile))
            except DockerfileError as err:
                raise SandboxError("image_build", str(err)) from err
        sid = f"sbx-{uuid.uuid4().hex[:12]}"
        host_dir = self.base_dir / sid
        allow_net = spec.allow_network and self.config.local_allow_network
        box = LocalSandbox(sid, host_dir, spec, plan, self.limits_for(spec), tools, allow_net)
        async with self._create_slots:
            try:
                await asyncio.to_thread(self._build_root, box, plan, spec)
                self._live[sid] = box
                box._on_close = lambda b: self._live.pop(b.id, None)
                await box._start()
            except BaseException as err:
                await box.close()
                if isinstance(err, DockerfileError):
                    raise SandboxError("image_build", str(err)) from err
                if isinstance(err, OSError):
                    raise SandboxError("create", f"cannot prepare sandbox root {host_dir}: {err}") from err
                raise
        return box

    @staticmethod
    def _build_root(box: LocalSandbox, plan: DockerfilePlan | None, spec: SandboxSpec) -> None:
        root = box.root
        root.mkdir(parents=True)
        for d in ("tmp", "var/tmp", "root", "home", "run", "opt", "proc", "dev", "usr", "etc"):
            (root / d).mkdir(parents=True, exist_ok=True)
        for d in ("tmp", "var/tmp"):
            (root / d).chmod(0o1777)
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / name
            if host.is_symlink():  # merged-/usr hosts: mirror the link, the target is bound
                (root / name).symlink_to(os.readlink(host))
            elif host.is_dir():
                (root / name).mkdir()
        host_path(root, box.workdir).mkdir(parents=True, exist_ok=True)
        if plan is not None and spec.files_dir:
            box.unsupported += apply_copies(
                plan,
                Path(spec.files_dir),
                root,
                read_only=_READ_ONLY,
                source=str(Path(spec.files_dir) / "Dockerfile"),
            )

    async def sweep(self) -> int:
        """Remove sandbox folders of this run that this provider does not own, killing their
        bwrap if it still runs: what a crashed process left behind. Like the Daytona sweep, call
        it at run start and end: it also removes sandboxes other workers of the run still use.
        Returns how many were removed."""
        if not self.base_dir.is_dir():
            return 0
        removed = 0
        for d in sorted(self.base_dir.iterdir()):
            if d.name in self._live or not d.is_dir():
                continue
            try:
                for pid in (d / "init.pid").read_text().split():
                    if _cmdline_mentions(int(pid), str(d)):
                        kill_pid(int(pid))
            except (OSError, ValueError):
                pass
            await asyncio.to_thread(shutil.rmtree, d, True)
            removed += 1
        return removed

    async def aclose(self) -> None:
        """Close this provider's sandboxes. Other providers of the same run (other workers) are
        left alone; sweep() at run start and end removes what crashed processes left."""
        await asyncio.gather(*(box.close() for box in list(self._live.values())))
        try:
            self.base_dir.rmdir()
        except OSError:
            pass


def _cmdline_mentions(pid: int, text: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return text.encode() in f.read()
    except OSError:
        return False
