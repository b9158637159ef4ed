"""A Harbor environment backed by agentrl's local bubblewrap sandbox.

    harbor run -p envs/tbench2/tasks -a oracle --env agentrl.harbor.environment:LocalSandboxEnvironment

Harbor's trial runner, agents and verifier drive it exactly as they drive Docker; each Harbor
environment (the agent's, and a separate verifier's) is one agentrl LocalSandbox
(agentrl/sandbox/local.py: namespaces, a disk image of the task's storage size, rlimits, no
network unless the task's policy is public). What follows from that backend, and what Harbor sees:
- environment/Dockerfile is interpreted, not built: WORKDIR, ENV, ARG and COPY are honoured, the
  host's read-only /usr and /etc stand in for the image (unsupported steps are logged). A task
  with only `docker_image` gets its environment/ folder uploaded into the workdir, as Harbor does.
- every command runs as the sandbox's own root (an unprivileged host uid); a task that asks for
  another user is refused. stdout and stderr come back interleaved, in ExecResult.stdout.
- network: "no-network" and "public" (slirp4netns, no route to the host) are enforced from the
  start; allowlists and switching policy after start are not offered, so Harbor refuses such
  tasks before starting them.
- the verifier gets into the task's workdir as root on Docker would: the local sandbox's root enters
  a folder the agent locked (local_isolation.ROOT_CAPS), and when Harbor starts verifying (see
  _VERIFICATION_STARTS) a file the agent put where the workdir goes is replaced by the folder, and
  on a sandbox whose root cannot enter a locked folder, that folder gets its owner's search bit back
  (agentrl/sandbox/workdir.py); the agent's commands never do.
- every process the agent left running (setsid daemons, tmux servers, a loop rewriting the reward
  file) is ended when Harbor starts verifying, as agentrl's own scorer does (envs/tbench2/scorer.py):
  on Docker they outlive the agent phase, so a background `echo 1 > /logs/verifier/reward.txt`
  loop scored 1.0 here too. What differs from Docker: a service the agent was asked to leave
  running is gone when the tests look for it (agentrl's scorer scores the same), and in a
  multi-step trial each step's agent starts without the earlier steps' processes.
- memory is a per-process limit; CPUs are not enforced (both as agentrl's local backend does).
- files move as tar archives (modes, links and empty folders kept); downloads are extracted with
  Harbor's own safe tar filter on the host.
"""

from __future__ import annotations

import asyncio
import io
import re
import shlex
import shutil
import tarfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from harbor.environments.base import (
    BaseEnvironment,
    EnvironmentPath,
    ExecResult,
    SandboxBuildFailedError,
    transfer_tar_filter,
)
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import NetworkMode, TaskOS
from harbor.models.trial.paths import EnvironmentPaths
from harbor.utils.scripts import quote_shell_arg

from agentrl.config.schema import SandboxConfig
from agentrl.sandbox.base import SandboxError, SandboxSpec
from agentrl.sandbox.workdir import enter_workdir_command

ENVIRONMENT_TYPE = "agentrl-local"
IMPORT_PATH = "agentrl.harbor.environment:LocalSandboxEnvironment"
# Harbor's exec without a timeout means none; the sandbox needs a bound. A day is past every TB2
# agent timeout (at most 12000 s) and Harbor's own wait_for ends the call sooner anyway.
NO_TIMEOUT_S = 86400.0
TIMEOUT_EXIT_CODE = 124  # what `timeout` returns, as Harbor's Daytona environment reports it
# Output one exec returns. Terminus-2 reads the tmux pane (kilobytes); oracles and verifiers write
# to files under /logs. 8 MiB keeps a runaway command's output from filling host memory.
EXEC_OUTPUT_CAP_BYTES = 8 << 20
ROOT_USERS = (None, "root", 0, "0")
_TRANSFER = "/tmp/.agentrl-harbor-{}.tar"
_UNSAFE_ID = re.compile(r"[^A-Za-z0-9_.-]")
_REQUIRED_TOOLS = ("bwrap", "nsenter", "setpriv", "prlimit", "unshare", "tar")
# How Harbor (0.26.0) starts verifying, the only sign of that phase an environment gets: every
# Verifier.verify() first runs `rm -f -- <reward.txt> <reward.json>` (_remove_reward_files, as root,
# in the workdir), and the shared-step and separate verifiers empty /logs/verifier before it
# (empty_dirs). Either one would fail with 125 where the workdir is a file the agent left, or a
# folder the sandbox's root cannot enter (see agentrl/sandbox/workdir.py), as would test.sh after them.
_PATHS = EnvironmentPaths.for_os(TaskOS.LINUX)
_VERIFICATION_STARTS = "rm -f -- " + " ".join(quote_shell_arg(p, TaskOS.LINUX)
                                              for p in (_PATHS.reward_text_path, _PATHS.reward_json_path))


class LocalSandboxOptions(EnvironmentOptions):
    """`--ek` options of the environment."""

    disk: Literal["ext4", "tmpfs"] | None = None  # the sandbox root's kind; None: ext4 where loop devices exist
    root_dir: str | None = None  # where sandbox folders live; None: the system temp folder


class LocalSandboxEnvironment(BaseEnvironment):
    """One agentrl local sandbox per Harbor environment (see the module docstring)."""

    options_model = LocalSandboxOptions
    options: LocalSandboxOptions

    @staticmethod
    def type() -> str:
        return ENVIRONMENT_TYPE

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        # Memory is an rlimit per process (a limit); CPUs are not enforced, so any value is accepted.
        return EnvironmentResourceCapabilities(memory_limit=True, fractional_cpus=True)

    @classmethod
    def preflight(cls, kwargs: dict[str, Any] | None = None) -> None:
        super().preflight(kwargs)
        missing = [t for t in _REQUIRED_TOOLS if shutil.which(t) is None]
        if missing:
            raise SystemExit(f"the agentrl local sandbox needs {', '.join(missing)} on PATH "
                             "(apt-get install bubblewrap util-linux tar)")

    def _validate_definition(self) -> None:
        if (self.environment_dir / "docker-compose.yaml").exists():
            raise ValueError(f"{self.environment_dir}/docker-compose.yaml: compose environments are not supported "
                             "by the agentrl local sandbox; give the task an environment/Dockerfile")
        if not (self.environment_dir / "Dockerfile").is_file() and not self.task_env_config.docker_image:
            raise FileNotFoundError(f"{self.environment_dir}/Dockerfile not found: the agentrl local sandbox "
                                    "interprets it (or set [environment].docker_image)")

    # -- lifecycle ---------------------------------------------------------------------------

    def _sandbox_spec(self) -> SandboxSpec:
        cfg, defaults = self.task_env_config, SandboxSpec()
        has_dockerfile = (self.environment_dir / "Dockerfile").is_file()
        return SandboxSpec(
            image=cfg.docker_image,
            files_dir=str(self.environment_dir) if has_dockerfile else None,
            workdir=cfg.workdir or "/",
            cpus=float(self._effective_cpus or defaults.cpus),
            memory_mb=int(self._effective_memory_mb or defaults.memory_mb),
            disk_mb=int(self._effective_storage_mb or defaults.disk_mb),
            allow_network=self.network_policy.network_mode == NetworkMode.PUBLIC,
            labels={"harbor_session": self.session_id},
        )

    async def start(self, force_build: bool) -> None:
        from agentrl.sandbox.local import LocalSandboxProvider

        spec = self._sandbox_spec()
        run_id = (_UNSAFE_ID.sub("_", self.session_id)[:48] + "-" + uuid.uuid4().hex[:8]).lstrip("-.")
        self._provider = LocalSandboxProvider(SandboxConfig(local_allow_network=spec.allow_network), run_id,
                                              root_dir=self.options.root_dir, disk=self.options.disk)
        try:
            self._box = await self._provider.create(spec)
        except SandboxError as err:
            await self._provider.aclose()
            if err.kind == "image_build":
                raise SandboxBuildFailedError(str(err)) from err
            raise
        if self._box.unsupported:
            self.logger.info("agentrl local sandbox skips: %s", "; ".join(self._box.unsupported))
        paths = EnvironmentPaths.for_os(self.os)
        await self.ensure_dirs([str(paths.agent_dir), str(paths.verifier_dir), str(paths.artifacts_dir),
                                *self._mount_targets(writable_only=True)])
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        """The sandbox goes whatever `delete` says: a local sandbox cannot outlive this process."""
        box, provider = getattr(self, "_box", None), getattr(self, "_provider", None)
        self._box = None
        if box is not None:
            await box.close()
        if provider is not None:
            await provider.aclose()

    def _sandbox(self):
        box = getattr(self, "_box", None)
        if box is None:
            raise RuntimeError(f"environment {self.session_id} is not started (call start first)")
        return box

    # -- commands ------------------------------------------------------------------------------

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        who = self._resolve_user(user)
        if who not in ROOT_USERS:
            raise RuntimeError(f"user={who!r}: the agentrl local sandbox runs every command as its own root "
                               "(there are no other users in it)")
        cwd = cwd or self._workdir()
        if command == _VERIFICATION_STARTS:  # nothing the agent left running may write or change the verdict
            await self._sandbox().kill_all()
            await self._let_verifier_in(cwd)
        res = await self._sandbox().exec(
            command, cwd=cwd, env=self._merge_env(env),
            timeout_s=float(timeout_sec) if timeout_sec else NO_TIMEOUT_S, max_output_bytes=EXEC_OUTPUT_CAP_BYTES,
        )
        return ExecResult(stdout=res.output, stderr="", return_code=TIMEOUT_EXIT_CODE if res.timed_out else res.exit_code)

    async def empty_dirs(self, dirs: Sequence[EnvironmentPath], *, chmod: bool = True) -> ExecResult | None:
        if str(EnvironmentPaths.for_os(self.os).verifier_dir) in map(str, dirs):  # a verifier starts
            await self._let_verifier_in(self._workdir())
        return await super().empty_dirs(dirs, chmod=chmod)

    def _workdir(self) -> str:
        """Where a command without a cwd runs: the task's workdir, else the Dockerfile's WORKDIR."""
        return self.task_env_config.workdir or self._sandbox().workdir

    async def _let_verifier_in(self, workdir: str) -> None:
        """Make `workdir` a folder the sandbox's root can enter, as root on Docker would (a file in its
        way is replaced, a folder it cannot enter gets its owner's search bit); others keep their modes."""
        if workdir != "/":
            await self._sandbox().exec(enter_workdir_command(workdir), cwd="/", timeout_s=60.0)

    async def _run_checked(self, command: str, what: str) -> None:
        res = await self._sandbox().exec(command, cwd="/", timeout_s=600.0, max_output_bytes=64 << 10)
        if res.exit_code != 0:
            raise RuntimeError(f"{what} failed in sandbox {self._sandbox().id} (exit {res.exit_code}): "
                               f"{res.output.strip()[-500:]}")

    # -- files ---------------------------------------------------------------------------------

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        source = Path(source_path)
        await self._sandbox().upload(await asyncio.to_thread(source.read_bytes), target_path)
        mode = source.stat().st_mode & 0o777
        if mode != 0o644:  # the sandbox writes uploads 644; keep the host file's mode, as docker cp does
            await self._run_checked(f"chmod {mode:o} -- {shlex.quote(target_path)}", f"chmod of {target_path}")

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        archive = await asyncio.to_thread(_pack, Path(source_dir))
        tmp = _TRANSFER.format(uuid.uuid4().hex)
        await self._sandbox().upload(archive, tmp)
        t = shlex.quote(target_dir)
        await self._run_checked(f"mkdir -p -- {t} && tar -C {t} -xf {tmp} --no-same-owner; rc=$?; rm -f {tmp}; "
                                "exit $rc", f"upload of {source_dir} to {target_dir}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._sandbox().download(source_path)
        # The mode travels too (as with docker cp): a carried script must stay executable.
        mode = await self._sandbox().exec(f"stat -c %a -- {shlex.quote(source_path)}", cwd="/", timeout_s=60.0)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(target.write_bytes, data)
        if mode.exit_code == 0 and mode.output.strip().isdigit():
            target.chmod(int(mode.output.strip(), 8) & 0o777)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        tmp = _TRANSFER.format(uuid.uuid4().hex)
        s = shlex.quote(source_dir)
        await self._run_checked(f"test -d {s} || {{ echo 'no such folder: {s}'; exit 44; }}; tar -C {s} -cf {tmp} .",
                                f"packing {source_dir}")
        try:
            data = await self._sandbox().download(tmp)
        finally:
            await self._sandbox().exec(f"rm -f {tmp}", cwd="/", timeout_s=60.0)
        await asyncio.to_thread(_unpack, data, Path(target_dir))


def _pack(source: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for child in sorted(source.iterdir()):
            tf.add(child, arcname=child.name)  # links stay links; modes are kept
    return buf.getvalue()


def _unpack(data: bytes, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tf:
        tf.extractall(target, filter=transfer_tar_filter)  # Harbor's filter: nothing lands outside target
