"""One local sandbox: the bubblewrap init, commands entered into it, files, kill_all, close.

The provider (agentrl/sandbox/local.py) builds the stage (the sandbox's first files) and hands it to
LocalSandbox; the module docstring there explains the design (one init per sandbox, nsenter per
exec, rlimits), local_isolation.py what keeps the host safe (user namespace, disk image, masks).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from agentrl.sandbox.base import ExecResult, SandboxError, SandboxSpec, nul_refusal
from agentrl.sandbox.dockerfile import DEFAULT_PATH, DockerfilePlan
from agentrl.sandbox.local_files import download_file, upload_file
from agentrl.sandbox.local_isolation import (
    BWRAP_MARKER_ENV,
    LAUNCH_SCRIPT,
    MIN_DISK_MB,
    ROOT_CAPS,
    SlirpNetwork,
    bwrap_argv,
    memfd_with,
    shared_mountpoint,
)
from agentrl.sandbox.local_procs import (
    CappedOutput,
    PipeReader,
    ProcessRef,
    end_all_but,
    kill_exec_tree,
    ns_members,
    only_child,
    open_capped_pipe,
    parent_of,
    pid_namespace,
    read_json,
    run_to_end,
    running,
    seal_inheritable_fds,
    spawned_with,
    start_time,
    wait_namespace_empty,
)

log = logging.getLogger(__name__)

# /proc/PID/ns entry -> nsenter's option for it
_NS_OPTIONS = {"user": "user", "mnt": "mount", "uts": "uts", "ipc": "ipc", "net": "net", "pid": "pid", "cgroup": "cgroup"}
_BOUNDING_SET = "--bounding-set=-all," + ",".join("+" + cap for cap in ROOT_CAPS)  # what an exec's root keeps
_DRAIN_GRACE_S = 0.5  # after the command exits, how long background children may hold its pipe
_READY_TIMEOUT_S = 30.0
# Processes one sandbox may hold. Neither RLIMIT_NPROC (ignored for root) nor a pids cgroup (absent
# on hosts whose cgroup v2 lacks the pids controller) bounds a fork bomb, and a host's pid_max can be
# as low as 32768: a watchdog counts the sandbox's own /proc and kills its pid namespace above this.
MAX_PIDS = 1024
_PIDS_POLL_S = 0.1
# kill_all: SIGKILL rounds until the sandbox is quiet. A process in uninterruptible sleep (D) may
# take a moment to die; one that outlives this is reported, and scoring does not start beside it.
KILL_ALL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LocalLimits:
    """Per-process rlimits applied to every exec."""

    memory_bytes: int
    cpu_seconds: int
    file_bytes: int


class LocalSandbox:
    """One bubblewrap sandbox. Created by LocalSandboxProvider.create; see the module docstring."""

    def __init__(
        self,
        sid: str,
        host_dir: Path,
        spec: SandboxSpec,
        plan: DockerfilePlan | None,
        limits: LocalLimits,
        tools: dict[str, str],
        allow_network: bool,
        disk_kind: str = "ext4",
    ):
        self.id = sid
        self.host_dir = host_dir
        self.stage = host_dir / "stage"  # the first files; the provider builds it, the disk copies it
        self.mountpoint = shared_mountpoint()  # where the disk is mounted, in the sandbox's own namespace
        self.disk_kind = disk_kind  # "ext4" (a loop-mounted image) or "tmpfs"
        self.disk_mb = max(spec.disk_mb, MIN_DISK_MB)
        self.spec = spec
        self.limits = limits
        self.allow_network = allow_network
        # The Dockerfile's WORKDIR wins over spec.workdir: it is what the image would have used.
        self.workdir = (plan.workdir if plan and plan.workdir else spec.workdir) or "/"
        self.unsupported: list[str] = list(plan.unsupported) if plan else []
        if spec.image and plan is None:
            self.unsupported.append(f"image {spec.image} (local runs use the host's /usr and /etc)")
        self.base_env = {
            "PATH": DEFAULT_PATH,
            "HOME": "/root",
            "HOSTNAME": "sandbox",
            **(plan.env if plan else {}),
            **spec.env,
        }
        self._tools = tools
        self._bwrap: asyncio.subprocess.Process | None = None
        # Every signal to bwrap or the init goes through these pidfds, never a pid number: both can be
        # reaped (bwrap by the loop, the init by bwrap) and their numbers reused by a host process.
        self._bwrap_ref: ProcessRef | None = None
        self._init_ref: ProcessRef | None = None
        self._init_pid = 0
        # The init's /proc directory, opened once it is proven ours: every path into the sandbox (its
        # namespaces for nsenter and slirp4netns, its root) goes through this fd, which goes stale
        # (ESRCH) when the init dies instead of following its number to the next process. With the
        # number, an exec racing the init's death could enter another sandbox's namespaces.
        self._init_dir = -1
        self._init_start: int | None = None
        self._keeper_pid = 0  # the init's one child (`sleep infinity`): its exit would end the sandbox
        # Host pids of the nsenters of running execs: each one's child is inside the sandbox while it
        # is not, so _members walks from them as well as from the init.
        self._nsenters: set[int] = set()
        self._network: SlirpNetwork | None = None
        self.owner_lock_fd = -1  # held while this process owns the sandbox (sweep_stale reads it)
        self._ns = ""
        self._ns_kinds: list[str] = []  # the init's namespaces that differ from ours
        self._closed = False
        self._on_close = None
        self._watchdog: asyncio.Task | None = None
        self.pids_exceeded = 0  # how many processes it held when the watchdog killed it

    def __repr__(self) -> str:
        return f"LocalSandbox(id={self.id!r}, workdir={self.workdir!r}, closed={self._closed})"

    @property
    def root(self) -> Path:
        """The sandbox's / as the host's root sees it (through the init's /proc entry): its disk
        is mounted in a mount namespace of its own, so no host path shows it."""
        return Path(self._init_path("root"))

    def _init_path(self, name: str, fd: int | None = None) -> str:
        """/proc/<init>/`name`, through the fd `fd` (default: the sandbox's own) of this process:
        a path other processes may open too, and that never names another process's entry."""
        return f"/proc/{os.getpid()}/fd/{self._init_dir if fd is None else fd}/{name}"

    # --- lifecycle -------------------------------------------------------------------------------

    async def _start(self, holder: subprocess.Popen, userns: str) -> None:
        """Start the init inside the user namespace `userns` that `holder` keeps (new_user_namespace);
        the holder is let go once bwrap's processes are in it."""
        t = self._tools
        data_fds: list[int] = []

        def data_fd(data: bytes) -> int:
            data_fds.append(memfd_with(data))
            return data_fds[-1]

        info_reader = asyncio.StreamReader()
        info_pipe: PipeReader | None = None
        log_fd = -1
        r, w = os.pipe()
        try:
            # bwrap's --info-fd: the read end is the PipeReader's from here on, even when it raises
            # (local_procs says why not loop.connect_read_pipe); the write end and the data fds are
            # ours until bwrap has been started with them.
            info_pipe = PipeReader(r, info_reader.feed_data, info_reader.feed_eof)
            src = self.host_dir / ("disk.img" if self.disk_kind == "ext4" else "stage")
            argv = [t["unshare"], "--mount", "--propagation", "private", "--", t["sh"], "-c", LAUNCH_SCRIPT, "sh",
                    str(self.mountpoint), str(src), self.disk_kind, str(self.disk_mb), userns,
                    *bwrap_argv(t["bwrap"], t["bash"], self.mountpoint, self.allow_network, w, data_fd)]  # fmt: skip
            log_fd = os.open(self.host_dir / "bwrap.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            bwrap_id = uuid.uuid4().hex
            seal_inheritable_fds(keep=(w, *data_fds))  # uvloop ignores close_fds (local_procs says why)
            spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_fd,
                pass_fds=(w, *data_fds),
                env={"PATH": DEFAULT_PATH, BWRAP_MARKER_ENV: bwrap_id},
            ))
            try:
                # Cancelled inside the spawn, asyncio closes the transport before its stdout pipe is
                # connected and that pipe stays open (the fd stress found it): let the spawn finish,
                # keep the process so that the create's cleanup ends it, then re-raise.
                self._bwrap = await run_to_end(spawn)
            finally:
                if self._bwrap is None and spawn.done() and not spawn.cancelled() and spawn.exception() is None:
                    self._bwrap = spawn.result()
                if self._bwrap is not None:
                    tag = f"{BWRAP_MARKER_ENV}={bwrap_id}".encode()
                    self._bwrap_ref = ProcessRef(self._bwrap.pid, lambda pid: spawned_with(pid, tag))
        except BaseException as err:
            if info_pipe is not None:
                info_pipe.close()
            if isinstance(err, OSError):
                raise SandboxError("create", f"cannot start bwrap: {err}") from err
            raise
        finally:
            for fd in (w, log_fd, *data_fds):
                if fd >= 0:
                    os.close(fd)
        try:
            info = await asyncio.wait_for(read_json(info_reader), _READY_TIMEOUT_S)
            line = await asyncio.wait_for(self._bwrap.stdout.readline(), _READY_TIMEOUT_S)
        except (TimeoutError, ValueError) as err:
            raise SandboxError("create", f"bwrap did not start: {err!r}; {self._bwrap_log()}") from err
        finally:
            info_pipe.close()
            holder.stdin.close()  # bwrap's processes are in the user namespace now: the holder may go
            await asyncio.to_thread(holder.wait, 5)
        if line.strip() != b"ready":
            raise SandboxError("create", f"bwrap init did not come up; {self._bwrap_log()}")
        self._init_pid = int(info["child-pid"])
        # The init is bwrap's child: a pid with bwrap as its parent, while bwrap is not reaped, is it.
        bwrap_pid, bwrap_ref = self._bwrap.pid, self._bwrap_ref
        self._init_ref = ProcessRef(self._init_pid, lambda pid: parent_of(pid) == bwrap_pid and bwrap_ref.exists())
        if self._init_ref.held:
            self._init_dir = os.open(f"/proc/{self._init_pid}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        if not self._init_ref.exists():  # not reaped since the open: the directory is the init's
            raise SandboxError("create", f"sandbox {self.id}: its init exited while starting; {self._bwrap_log()}")
        try:
            self._keeper_pid = only_child(self._init_pid)
        except OSError as err:
            raise SandboxError("create", f"sandbox {self.id}: {err}") from err
        self._init_start = start_time(self._init_pid)
        (self.host_dir / "init.pid").write_text(json.dumps(
            {"bwrap": self._bwrap.pid, "init": self._init_pid, "init_start": self._init_start}
        ))  # fmt: skip
        if self.disk_kind == "tmpfs":  # copied onto the tmpfs by LAUNCH_SCRIPT
            await asyncio.to_thread(shutil.rmtree, self.stage, True)
        for kind in _NS_OPTIONS:
            try:
                if os.readlink(self._init_path(f"ns/{kind}")) != os.readlink(f"/proc/self/ns/{kind}"):
                    self._ns_kinds.append(kind)
            except OSError:
                continue
        self._ns = pid_namespace(self._init_pid) or ""
        if self._ns != os.readlink(self._init_path("ns/pid")):  # raises once the init is gone
            raise SandboxError("create", f"sandbox {self.id}: its init exited while starting")
        if not {"user", "pid", "mnt", "net"} <= set(self._ns_kinds):
            raise SandboxError("create", "bwrap did not create private user, pid, mount and net namespaces")
        if self.allow_network:
            try:
                self._network = await asyncio.to_thread(
                    SlirpNetwork, t["slirp4netns"], self._init_path("ns/net"), self.host_dir / "slirp.log"
                )
            except OSError as err:
                raise SandboxError("create", f"sandbox {self.id}: {err}") from err
        self._watchdog = asyncio.create_task(self._watch_pids())

    async def _watch_pids(self) -> None:
        """Kill the whole sandbox (its pid 1) once it holds more than MAX_PIDS processes. Listing the
        sandbox's own /proc costs one small readdir, so it can run every 0.1 s for every sandbox."""
        proc_dir = self._init_path("root/proc")
        while not self._closed:
            await asyncio.sleep(_PIDS_POLL_S)
            try:
                n = sum(1 for name in os.listdir(proc_dir) if name.isdigit())
            except OSError:
                return  # the sandbox is gone
            if n > MAX_PIDS:
                self.pids_exceeded = n
                log.warning("sandbox %s: %d processes exceed the limit of %d; killing it", self.id, n, MAX_PIDS)
                self._init_ref.kill()
                return

    def _members(self) -> list[int]:
        """The sandbox's live processes (host pids): pids_in_namespace(self._ns), found from the
        init and the running execs' nsenters (local_procs.ns_members). Blocking; any thread."""
        return ns_members(self._ns, self._init_pid, tuple(self._nsenters))  # the GIL makes tuple() atomic

    def _init_reaped(self) -> bool:
        """Whether the init has been reaped: then no process of the sandbox is left (the kernel
        reaps a pid namespace's init last, local_procs.wait_namespace_empty). Called from close()'s
        wait in its thread: the ref is closed only after that wait has returned."""
        return self._init_ref is not None and self._init_ref.held and not self._init_ref.exists()

    def _bwrap_log(self) -> str:
        if self.pids_exceeded:
            return f"it was killed holding {self.pids_exceeded} processes, over its limit of {MAX_PIDS} (a fork bomb?)"
        try:
            text = (self.host_dir / "bwrap.log").read_text(errors="replace").strip()
        except OSError:
            text = ""
        return f"bwrap said: {text[-2000:]}" if text else "bwrap printed nothing"

    async def close(self) -> None:
        """End every process of the sandbox and remove its files. Runs to its end even when the
        caller is cancelled meanwhile (then re-raises): stopping half way would leave slirp4netns,
        the folder and the owner-lock fd behind."""
        if self._closed:
            return
        self._closed = True
        await run_to_end(self._teardown())

    async def _teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        try:
            if self._init_ref is not None:
                self._init_ref.kill()  # pid 1 of the namespace: the kernel kills all the others
            if self._bwrap is not None:
                # bwrap's monitor reaps the init and exits by itself; kill it only if it lingers
                # (killing it first would leave the init a zombie for the host's pid 1 to reap),
                # or at once when no init is known (cancelled while starting: --die-with-parent
                # ends the init with it).
                if self._init_ref is None and self._bwrap_ref is not None:
                    self._bwrap_ref.kill()
                try:
                    await asyncio.wait_for(self._bwrap.wait(), 2)
                except TimeoutError:
                    if self._bwrap_ref is not None:
                        self._bwrap_ref.kill()
                    await asyncio.wait_for(self._bwrap.wait(), 10)
                # bwrap has exited, but its stdout pipe stays open until every holder of the write end
                # is gone: a launch script killed while starting leaves children that hold it a while
                # longer, and a loop closed meanwhile left the pipe to the garbage collector (the fd
                # stress on asyncio found it). Close the transport (asyncio's Process keeps it as
                # _transport; no public handle) and give its fd close the one loop turn it takes.
                transport = getattr(self._bwrap, "_transport", None)
                if transport is not None:
                    transport.close()
                    await asyncio.sleep(0)
            if self._network is not None:
                await asyncio.to_thread(self._network.stop)
            if self._ns and not await asyncio.to_thread(
                wait_namespace_empty, self._ns, 10.0, members=self._members, init_reaped=self._init_reaped
            ):
                log.warning("sandbox %s: processes still alive 10 s after close", self.id)
            await asyncio.to_thread(shutil.rmtree, self.host_dir, True)
        except Exception as err:  # noqa: BLE001 - close never raises: log and move on, sweep() retries the files
            log.warning("sandbox %s: close failed: %s", self.id, err)
        finally:
            for ref in (self._init_ref, self._bwrap_ref):
                if ref is not None:
                    ref.close()
            if self._init_dir >= 0:
                fd, self._init_dir = self._init_dir, -1
                os.close(fd)
            if self.owner_lock_fd >= 0:
                os.close(self.owner_lock_fd)
                self.owner_lock_fd = -1
            if self._on_close is not None:
                self._on_close(self)

    async def kill_all(self) -> int:
        """Sandbox protocol: SIGKILL every process but the init (bwrap's pid 1 and its one child),
        in rounds until none is left; returns how many were ended. Raises SandboxError(kill) when
        some survive KILL_ALL_TIMEOUT_S, (closed)/(lost) when the sandbox itself is gone."""
        self._check_alive()
        keep = {self._init_pid, self._keeper_pid}
        ended, left = await asyncio.to_thread(
            end_all_but, self._ns, keep, KILL_ALL_TIMEOUT_S, members=self._members
        )
        self._check_alive()
        if left:
            raise SandboxError(
                "kill", f"sandbox {self.id}: {len(left)} process(es) outlived SIGKILL for {KILL_ALL_TIMEOUT_S:g} s"
            )
        return ended

    @property
    def closed(self) -> bool:
        return self._closed

    def alive(self) -> bool:
        # bwrap's returncode is set only when the event loop reaps it, which under load came after
        # the next exec (CI: a killed sandbox's episode went on to be scored 0.0); the init's own
        # /proc entry says at once.
        return (not self._closed and not self.pids_exceeded and self._bwrap is not None
                and self._bwrap.returncode is None and running(self._init_pid, self._init_start))

    # --- commands --------------------------------------------------------------------------------

    def _argv(self, script: str, args: list[str], cwd: str, init_dir: int) -> list[str]:
        """The command line of one exec; nsenter finds the sandbox through `init_dir`, a duplicate
        of the init's directory fd that this process holds until nsenter is done with it (no fd
        goes to nsenter itself: its inherited fds would reach the command inside the sandbox)."""
        t = self._tools
        lim = self.limits
        ns = [f"--{_NS_OPTIONS[kind]}={self._init_path(f'ns/{kind}', init_dir)}" for kind in self._ns_kinds]
        return [
            t["nsenter"], *ns, f"--root={self._init_path('root', init_dir)}", "--",
            t["setpriv"], _BOUNDING_SET, "--inh-caps=-all", "--ambient-caps=-all", "--no-new-privs", "--",
            t["prlimit"], f"--as={lim.memory_bytes}", f"--cpu={lim.cpu_seconds}",
            f"--fsize={lim.file_bytes}", "--core=0", "--",
            t["env"], "-C", cwd, "--", t["setsid"], "-w", t["bash"], "-c", script, "bash", *args,
        ]  # fmt: skip

    def _env(self, extra: dict[str, str] | None, marker: str) -> dict[str, str]:
        # A clean environment: nothing of the host process (its keys!) leaks in. Passed as the
        # process environment, never on a command line.
        return {**self.base_env, **(extra or {}), "AGENTRL_EXEC_ID": marker}

    def _check_alive(self) -> None:
        if self._closed:
            raise SandboxError("closed", f"sandbox {self.id} is closed")
        if not self.alive():
            raise SandboxError("lost", f"sandbox {self.id} died; {self._bwrap_log()}")

    async def exec(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 60.0,
        max_output_bytes: int = 1 << 20,
    ) -> ExecResult:
        self._check_alive()
        refused = nul_refusal(command, env)
        if refused is not None:
            return refused
        return await self._run(
            command, [], cwd=cwd, env=env, timeout_s=timeout_s, max_output_bytes=max_output_bytes
        )

    async def _run(
        self,
        script: str,
        args: list[str],
        *,
        cwd: str | None,
        env: dict[str, str] | None,
        timeout_s: float,
        max_output_bytes: int,
        stdin: bytes | None = None,
    ) -> ExecResult:
        self._check_alive()
        marker = uuid.uuid4().hex
        tag = f"AGENTRL_EXEC_ID={marker}".encode()  # what _env puts in the command's environment
        w, reader, pipe = open_capped_pipe(max_output_bytes)
        init_dir = -1
        try:
            init_dir = os.dup(self._init_dir)  # this exec's own: close() may close the sandbox's meanwhile
            seal_inheritable_fds(keep=(w,))  # uvloop ignores close_fds: nothing else may reach the command
            proc = await asyncio.create_subprocess_exec(
                *self._argv(script, args, cwd or self.workdir, init_dir),
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=w,
                stderr=w,
                env=self._env(env, marker),
            )
        except OSError as err:
            pipe.close()
            if init_dir >= 0:
                os.close(init_dir)
            raise SandboxError("exec", f"cannot start a command in sandbox {self.id}: {err}") from err
        except BaseException:
            # Cancelled part way through the spawn: the loop kills nsenter, but the command it forked
            # into the sandbox may already run, and nobody would end it before close(). Its marker
            # finds it, as on a timeout.
            pipe.close()
            try:
                await run_to_end(asyncio.to_thread(kill_exec_tree, self._ns, tag, members=self._members))
            finally:
                if init_dir >= 0:
                    os.close(init_dir)
            raise
        finally:
            os.close(w)
        # nsenter is reaped by the loop as soon as it exits; from here on it is signalled by pidfd.
        nsenter = ProcessRef(proc.pid, lambda pid: spawned_with(pid, tag))
        self._nsenters.add(proc.pid)  # a number reused once it is reaped only adds candidates to _members
        try:
            return await self._wait_exec(proc, nsenter, tag, reader, pipe, stdin, timeout_s)
        finally:
            self._nsenters.discard(proc.pid)
            pipe.close()
            nsenter.close()
            os.close(init_dir)  # nsenter has exited or was killed: it opens nothing more through it

    async def _wait_exec(
        self,
        proc: asyncio.subprocess.Process,
        nsenter: ProcessRef,
        tag: bytes,
        reader: CappedOutput,
        pipe: PipeReader,
        stdin: bytes | None,
        timeout_s: float,
    ) -> ExecResult:
        timed_out = False
        try:
            async with asyncio.timeout(timeout_s):
                if stdin is not None:
                    await _feed(proc, stdin)
                await proc.wait()
        except TimeoutError:
            timed_out = True
        except BaseException:  # cancelled: the command must not outlive its caller, however often cancelled
            await run_to_end(self._kill_exec(tag, proc, nsenter))
            raise
        if timed_out:
            await run_to_end(self._kill_exec(tag, proc, nsenter))
        # Background children may still hold the pipe open; give them a moment, then stop reading
        # (they get SIGPIPE on their next write) rather than wait for them.
        try:
            await asyncio.wait_for(asyncio.shield(reader.eof), _DRAIN_GRACE_S)
        except TimeoutError:
            pass
        pipe.close()
        if timed_out:
            return ExecResult(-1, reader.text(), timed_out=True, truncated=reader.truncated)
        rc = proc.returncode
        if rc is not None and rc < 0:
            rc = 128 - rc  # killed by a signal: the shell's convention
        if not self.alive():
            raise SandboxError("lost", f"sandbox {self.id} died during a command; {self._bwrap_log()}")
        return ExecResult(rc if rc is not None else -1, reader.text(), truncated=reader.truncated)

    async def _kill_exec(self, tag: bytes, proc: asyncio.subprocess.Process, nsenter: ProcessRef) -> None:
        await asyncio.to_thread(kill_exec_tree, self._ns, tag, members=self._members)
        nsenter.kill()  # by pidfd: the loop may have reaped it meanwhile, and its pid be another's
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            log.warning("sandbox %s: nsenter %d did not exit after SIGKILL", self.id, proc.pid)

    # --- files: through a process inside the sandbox (local_files.py) --------------------------

    async def upload(self, data: bytes, path: str) -> None:
        await upload_file(self, data, path)

    async def download(self, path: str) -> bytes:
        return await download_file(self, path)


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command exited without reading all of it; its exit code says why

