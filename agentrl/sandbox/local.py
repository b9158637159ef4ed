"""Local sandboxes: bubblewrap namespaces, started by the host's root, without Docker.

Shape: one long-lived bubblewrap "init" per sandbox, and every exec enters its namespaces.
- bwrap starts a tiny init (bwrap's own pid 1 plus `sleep infinity`) in fresh mount/pid/net/ipc/
  uts/cgroup namespaces, inside a user namespace whose root is an unprivileged host uid
  (local_isolation.py: the user namespace, the disk quota, read-only kernel knobs, masked
  credentials, the network). The sandbox's / is its own disk (an ext4 image of `disk_mb`, or a
  tmpfs), filled from a stage folder the provider builds; /usr, /etc (and /bin, /lib*, /sbin when
  they are real directories) are bound read-only from the host; /proc and /dev are private; /tmp
  is on the sandbox's own disk (private and persistent across execs, which a tmux socket needs).
- `exec` runs `nsenter` into the init's namespaces and root (named through an fd of the init's /proc
  directory, never its pid number, which a host process may hold once the init is gone; every
  signal to bwrap, the init or nsenter goes through a pidfd for the same reason), then drops every
  capability but a container root's file and user ones (`setpriv`; local_isolation.ROOT_CAPS), applies
  limits (`prlimit`), starts a new session (`setsid`) and runs `bash -c`.
  Why not one bwrap per exec over a shared root: each exec would get its own pid/net/ipc
  namespaces, so a tmux server (or any server on 127.0.0.1) would not be reachable from the next
  exec, and nothing would own the processes left behind.
- `kill_all` ends every process but the init (the verifier runs after it); close() SIGKILLs the
  init: the kernel then kills every process of the pid namespace, including daemons that escaped
  their exec, so nothing outlives the sandbox. If this Python process dies, --die-with-parent does
  the same, the private mount namespace (and with it the disk's loop device) goes away, and the
  folder is left for `sweep_stale` of the next run.

Limits are rlimits (prlimit), per process: address space (memory), CPU seconds, file size, no core
dumps; the disk's size bounds all files together. cgroup v2 would give aggregate memory/cpu/pids
limits and an exact kill, but the machines this backend targets (CI containers, dev boxes) mostly
run hybrid cgroup v1 without delegated v2 controllers (here: only `hugetlb` in the unified tree),
so rlimits are what works everywhere. `spec.cpus` is not enforced locally; a pids watchdog
(local_box.MAX_PIDS) stops fork bombs.

Network: none (a private net namespace with only loopback) unless the task allows it and
`sandbox.local_allow_network` is true; then slirp4netns, without a route to the host's loopback.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
import traceback
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
from agentrl.sandbox.local_box import LocalLimits, LocalSandbox
from agentrl.sandbox.local_isolation import chown_tree, disk_backend, make_disk_image, new_user_namespace
from agentrl.sandbox.local_procs import kill_if_started_at, run_to_end

__all__ = ["LocalLimits", "LocalSandbox", "LocalSandboxProvider"]

_TOOLS = ("bwrap", "nsenter", "setpriv", "prlimit", "setsid", "env", "bash", "unshare", "cat", "sh")
OWNER_LOCK = "owner.lock"  # flock()ed by the owning process for the sandbox's whole life
# A folder without a lock file is being created (or was left by a crash mid-create): sweep_stale
# leaves it alone this long. Creating one takes ~50 ms.
STALE_GRACE_S = 60.0
# Bound from the host (read-only) or private mounts: a COPY into them cannot be honoured.
_READ_ONLY = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/dev")
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


# Run on the host, never inside the sandbox: these may also come from PATH (e.g. a bubblewrap
# .deb unpacked with `dpkg -x` on a machine without root or a package registry). The others run
# after nsenter, inside the sandbox, so they must live under the read-only /usr it binds.
_HOST_SIDE = frozenset({"bwrap", "slirp4netns", "unshare", "nsenter", "cat", "sh"})


def _tool(name: str) -> str:
    for d in ("/usr/bin", "/usr/sbin", "/bin", "/sbin"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    found = shutil.which(name) if name in _HOST_SIDE else None
    if found:
        return os.path.abspath(found)
    pkg = {"bwrap": "bubblewrap", "nsenter": "util-linux", "setpriv": "util-linux", "prlimit": "util-linux",
           "unshare": "util-linux", "slirp4netns": "slirp4netns"}
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
        disk: str | None = None,
    ):
        """`disk` forces the writable root's kind ("ext4" image or "tmpfs"); None picks ext4 where
        the host has loop devices."""
        self.config = config or SandboxConfig()
        self.run_id = run_id or uuid.uuid4().hex[:12]
        if not _SAFE_ID.match(self.run_id):
            raise ValueError(f"run_id {self.run_id!r}: use 1-64 letters, digits, '_', '.', '-'")
        self.sandboxes_dir = Path(root_dir or tempfile.gettempdir()) / "agentrl-sandboxes"
        self.base_dir = self.sandboxes_dir / self.run_id
        if disk not in (None, "ext4", "tmpfs"):
            raise ValueError(f"disk={disk!r}: use 'ext4', 'tmpfs' or None (ext4 where loop devices exist)")
        self.disk = disk or disk_backend()
        self._live: dict[str, LocalSandbox] = {}
        self._create_slots = asyncio.Semaphore(self.config.max_concurrent_creates)

    def limits_for(self, spec: SandboxSpec) -> LocalLimits:
        """The task's memory, at least `local_memory_mb`; `local_cpu_seconds` of CPU per process;
        the task's disk size as the largest file one process may write."""
        mem_mb = max(spec.memory_mb, self.config.local_memory_mb)
        return LocalLimits(mem_mb << 20, self.config.local_cpu_seconds, max(spec.disk_mb, 1) << 20)

    async def create(self, spec: SandboxSpec) -> LocalSandbox:
        allow_net = spec.allow_network and self.config.local_allow_network
        tools = {name: _tool(name) for name in _TOOLS + (("slirp4netns",) if allow_net else ())}
        plan = None
        dockerfile = Path(spec.files_dir) / "Dockerfile" if spec.files_dir else None
        if dockerfile is not None and dockerfile.is_file():
            try:
                plan = parse_dockerfile(dockerfile.read_text(), source=str(dockerfile))
            except DockerfileError as err:
                raise SandboxError("image_build", str(err)) from err
        sid = f"sbx-{uuid.uuid4().hex[:12]}"
        host_dir = self.base_dir / sid
        box = LocalSandbox(sid, host_dir, spec, plan, self.limits_for(spec), tools, allow_net, self.disk)
        async with self._create_slots:
            # The user namespace's holder starts while the disk is built (both are ~5-10 ms of
            # waiting on other processes).
            holder = asyncio.ensure_future(asyncio.to_thread(new_user_namespace, tools["unshare"], tools["cat"]))
            prepare = asyncio.ensure_future(asyncio.to_thread(self._prepare, box, plan, spec, self.run_id))
            try:
                await asyncio.shield(prepare)
                self._live[sid] = box
                box._on_close = lambda b: self._live.pop(b.id, None)
                await box._start(*await holder)
            except BaseException as err:
                # To its end even when cancelled again meanwhile: else the holder, the lock fd and
                # the folder are left behind.
                await run_to_end(_undo_create(box, prepare, holder))
                if isinstance(err, DockerfileError):
                    raise SandboxError("image_build", str(err)) from err
                if isinstance(err, OSError):
                    raise SandboxError("create", f"cannot prepare sandbox root {host_dir}: {err} "
                                       f"(in {_where(err)})") from err
                raise
        return box

    @classmethod
    def _prepare(cls, box: LocalSandbox, plan: DockerfilePlan | None, spec: SandboxSpec, run_id: str) -> None:
        """The sandbox's folder: its owner lock (taken first, so sweep_stale never takes a folder
        being built for a live process), the stage owned by the sandbox's root, its disk."""
        box.host_dir.mkdir(parents=True)
        box.owner_lock_fd = os.open(box.host_dir / OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(box.owner_lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(box.owner_lock_fd, json.dumps({"pid": os.getpid(), "run_id": run_id, "created": time.time()}).encode())
        cls._build_stage(box, plan, spec)
        chown_tree(box.stage)
        if box.disk_kind == "ext4":
            make_disk_image(box.stage, box.host_dir / "disk.img", box.disk_mb)
            shutil.rmtree(box.stage)

    @staticmethod
    def _build_stage(box: LocalSandbox, plan: DockerfilePlan | None, spec: SandboxSpec) -> None:
        root = box.stage
        root.mkdir()
        for d in ("tmp", "var/tmp", "root", "home", "run", "opt", "proc", "dev", "sys", "usr", "etc"):
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
        init if it still runs: what a crashed process left behind. Like the Daytona sweep, call
        it at run end: it also removes sandboxes other workers of the run still use (sweep_stale
        is the one for run start). Returns how many were removed."""
        if not self.base_dir.is_dir():
            return 0
        removed = 0
        for d in sorted(self.base_dir.iterdir()):
            if d.name in self._live or not d.is_dir():
                continue
            await asyncio.to_thread(_remove_sandbox_dir, d)
            removed += 1
        return removed

    async def sweep_stale(self) -> int:
        """Remove the sandboxes of dead owners, of any run under this provider's root folder: a
        folder whose owner lock (OWNER_LOCK, flock()ed by the creating process for the sandbox's
        life, released by the kernel when that process dies however it dies) can be taken, or
        that has no lock file and is older than STALE_GRACE_S. Their init is killed if it still
        runs. Sandboxes of live processes, this one's included, are never touched, so it is safe
        to call at every run start while other runs share the folder. Returns how many."""
        return await asyncio.to_thread(self._sweep_stale)

    def _sweep_stale(self) -> int:
        if not self.sandboxes_dir.is_dir():
            return 0
        removed = 0
        for run_dir in sorted(p for p in self.sandboxes_dir.iterdir() if p.is_dir()):
            for d in sorted(p for p in run_dir.iterdir() if p.is_dir()):
                if d.name in self._live or not _owner_is_gone(d):
                    continue
                _remove_sandbox_dir(d)
                removed += 1
            try:
                run_dir.rmdir()  # only when empty: a live run's folder stays
            except OSError:
                pass
        return removed

    async def aclose(self) -> None:
        """Close this provider's sandboxes. Other providers of the same run (other workers) are
        left alone; sweep() at run end and sweep_stale() at start remove what crashed processes left."""
        await asyncio.gather(*(box.close() for box in list(self._live.values())))
        try:
            self.base_dir.rmdir()
        except OSError:
            pass


def _where(err: BaseException) -> str:
    """The function and line an error came from (which step of a create failed)."""
    frames = traceback.extract_tb(err.__traceback__)
    return f"{frames[-1].name}:{frames[-1].lineno}" if frames else "?"


async def _undo_create(box: LocalSandbox, prepare: asyncio.Future, holder: asyncio.Future) -> None:
    """What a failed (or cancelled) create leaves: the folder's build, the holder, the sandbox."""
    if not prepare.done():
        # Cancelled while the thread still builds the folder: close() must not remove it and close
        # its lock fd under the thread (the fd's number could be another sandbox's by the time the
        # thread writes to it).
        await asyncio.wait([prepare])
    if not prepare.cancelled():
        prepare.exception()  # retrieved: its error, if any, is the create's or moot
    await _drop_holder(holder)
    await box.close()


async def _drop_holder(job: asyncio.Future) -> None:
    """End a user-namespace holder that a failed create did not hand over."""
    try:
        proc, _ = await job
    except BaseException:  # noqa: BLE001 - it failed to start: nothing to end
        return
    if proc.poll() is None:
        proc.kill()
        await asyncio.to_thread(proc.wait)
    if proc.stdin is not None:
        proc.stdin.close()  # its pipe, else one fd leaks per failed create


def _owner_is_gone(d: Path) -> bool:
    """True when no live process holds the folder's owner lock (see sweep_stale)."""
    try:
        fd = os.open(d / OWNER_LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            return time.time() - d.stat().st_mtime > STALE_GRACE_S
        except OSError:
            return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True  # released when this fd closes; the folder is removed right after
    except OSError:
        return False
    finally:
        os.close(fd)


def _remove_sandbox_dir(d: Path) -> None:
    """Kill the sandbox's init if it still runs (its pid namespace dies with it), then delete it."""
    try:
        rec = json.loads((d / "init.pid").read_text())
        kill_if_started_at(rec["init"], rec["init_start"])  # the same process, never a reused pid
    except (OSError, ValueError, KeyError, TypeError):
        pass
    shutil.rmtree(d, True)
