"""Integrity under an adversarial agent (issue #20): forged verdicts and host escapes.

Each scenario tries what an optimiser pointed at the reward could try, through the real episode
path (TB2Env on a local sandbox, or the Daytona SDK against the stand-in), and checks it is
refused: the verifier-isolation ones run the known forgeries of envs/tbench2/forgeries.py and
need each to be armed (in place when scoring starts) and to score 0; the host-integrity ones try
one write or read of host state from inside a local sandbox and need it refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import sys
import uuid
from pathlib import Path

from bench.faults_base import Checks, Outcome, Scenario

_ORPHAN = (
    "import asyncio, os, sys\n"
    "from agentrl.config.schema import SandboxConfig\n"
    "from agentrl.sandbox.base import SandboxSpec\n"
    "from agentrl.sandbox.local import LocalSandboxProvider\n"
    "async def main():\n"
    "    box = await LocalSandboxProvider(SandboxConfig(), run_id='killed-run', root_dir=sys.argv[1]).create(SandboxSpec())\n"
    "    print(box.host_dir, flush=True)\n"
    "    os.kill(os.getpid(), 9)\n"
    "asyncio.run(main())\n"
)


@contextlib.asynccontextmanager
async def _provider(tmp: Path, **config):
    from agentrl.config.schema import SandboxConfig
    from agentrl.sandbox.local import LocalSandboxProvider

    p = LocalSandboxProvider(SandboxConfig(**config), run_id=f"int{uuid.uuid4().hex[:6]}", root_dir=tmp / "boxes")
    try:
        yield p
    finally:
        await p.aclose()


async def _forgeries(tmp: Path, task_name: str, names: list[str], *, unplantable: tuple[str, ...] = ()) -> Outcome:
    """Each forgery must be armed and score 0; those in `unplantable` must fail to arm (locally
    /usr and /etc are read-only) and score 0."""
    from envs.tbench2.check import run_forgery
    from envs.tbench2.forgeries import by_name
    from envs.tbench2.loader import DEFAULT_TASKS_DIR, load_task

    c = Checks()
    task = load_task(DEFAULT_TASKS_DIR / task_name)
    async with _provider(tmp) as p:
        for f in by_name(names):
            r = await run_forgery(p, task, f)
            armed_ok = r.armed != (f.name in unplantable)
            state = "armed" if r.armed else "could not be planted"
            c(armed_ok and r.status == "scored" and r.reward == 0.0,
              f"{f.name} ({state}) on {task_name}: {r.status} {r.reward} ({r.detail[:80]})")
    return c.outcome()


async def background_writers(tmp: Path) -> Outcome:
    return await _forgeries(tmp, "write-name", ["setsid-writer", "nohup-writer", "tmux-writer"])


async def tests_replaced(tmp: Path) -> Outcome:
    return await _forgeries(tmp, "write-name", ["tests-replacer"])


async def verdict_dirs(tmp: Path) -> Outcome:
    return await _forgeries(
        tmp, "write-name", ["planted-reward", "locked-verifier-dir", "symlinked-verifier-dir", "dir-as-reward-file"]
    )


async def broken_sandbox(tmp: Path) -> Outcome:
    return await _forgeries(tmp, "write-name", ["broken-sandbox"])


async def startup_hooks(tmp: Path) -> Outcome:
    return await _forgeries(tmp, "write-name", ["fake-bin-on-path", "startup-hooks", "python-user-site"],
                            unplantable=("fake-bin-on-path",))


async def fake_program_fresh_verifier(tmp: Path) -> Outcome:
    from envs.tbench2.check import run_forgery, run_oracle
    from envs.tbench2.forgeries import by_name
    from envs.tbench2.loader import DEFAULT_TASKS_DIR, load_task

    c = Checks()
    task = load_task(DEFAULT_TASKS_DIR / "hijack-path")
    (fake,) = by_name(["fake-bin-on-path"])
    async with _provider(tmp) as p:
        same = await run_forgery(p, task, fake, verifier_sandbox="same")
        c(same.armed and same.reward == 1.0,
          f"in the agent's own sandbox the faked program the test trusts wins ({same.reward}): the known limit")
        fresh = await run_forgery(p, task, fake)
        c(fresh.armed and fresh.reward == 0.0, f"the fresh verifier sandbox scores it {fresh.reward}")
        oracle, _ = await run_oracle(p, task)
        c(oracle.reward == 1.0 and "carried 1 file(s)" in oracle.detail,
          f"the real solution still passes there: {oracle.reward} ({oracle.detail[-60:]})")
    return c.outcome()


async def daytona_kill_all(tmp: Path) -> Outcome:
    from bench.faults_sandbox import _spec, daytona

    c = Checks()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        c(False, "the Daytona stand-in needs root for its per-sandbox pid namespace")
        return c.outcome()
    async with daytona() as (p, _h):
        sb = await p.create(_spec())
        await sb.exec("(setsid nohup sh -c 'while :; do date +%s%N > forged.txt; sleep 0.01; done' >/dev/null 2>&1 &); "
                      "tmux -L forge new-session -d 'sleep 1000'; sleep 0.3")
        ended = await sb.kill_all()
        first = (await sb.exec("cat forged.txt")).output
        await asyncio.sleep(0.3)
        second = (await sb.exec("cat forged.txt")).output
        left = (await sb.exec("for p in /proc/[0-9]*; do tr '\\000' ' ' < $p/cmdline; echo; done")).output
        c(ended >= 3 and first == second and "sleep 1000" not in left,
          f"kill_all through the SDK ended {ended} processes; the writer stopped and tmux is gone")
        await sb.close()
    return c.outcome()


async def host_uid(tmp: Path) -> Outcome:
    from agentrl.sandbox.base import SandboxSpec
    from agentrl.sandbox.local_isolation import HOST_ID_BASE

    c = Checks()
    async with _provider(tmp) as p:
        box = await p.create(SandboxSpec())
        r = await box.exec("id -u; echo x > /tmp/mine; unshare -U true 2>/dev/null && echo nested || echo no-nested")
        owner = (box.root / "tmp" / "mine").stat().st_uid
        c(r.output.split()[0] == "0" and owner == HOST_ID_BASE,
          f"root inside (uid {r.output.split()[0]}) writes files the host sees as uid {owner}, not 0")
        c("no-nested" in r.output, "a nested user namespace (capabilities again) is refused")
    return c.outcome()


async def kernel_knobs(tmp: Path) -> Outcome:
    from agentrl.sandbox.base import SandboxSpec

    c = Checks()
    before = Path("/proc/sys/kernel/core_pattern").read_text()
    async with _provider(tmp) as p:
        box = await p.create(SandboxSpec())
        r = await box.exec("echo '|/tmp/x' > /proc/sys/kernel/core_pattern || echo a; "
                           "echo 1 > /proc/sys/net/ipv4/ip_forward || echo b; touch /sys/x || echo c")
        c(r.output.count("Read-only file system") == 3 and {"a", "b", "c"} <= set(r.output.split()),
          "writes to /proc/sys/kernel/core_pattern, /proc/sys/net and /sys: Read-only file system")
    c(Path("/proc/sys/kernel/core_pattern").read_text() == before, "the host's core_pattern is unchanged")
    return c.outcome()


async def credentials(tmp: Path) -> Outcome:
    from agentrl.sandbox.base import SandboxSpec

    c = Checks()
    files = [f for f in ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-") if os.path.exists(f)]
    async with _provider(tmp) as p:
        box = await p.create(SandboxSpec())
        r = await box.exec(" ".join(f"wc -c < {f};" for f in files) + " ls -A /root | wc -l")
        sizes = r.output.split()
        c(files and sizes[:-1] == ["0"] * len(files), f"{', '.join(files)} read as empty inside")
        c(sizes[-1] == "0", "the host's /root is not visible (the sandbox's /root is its own)")
    return c.outcome()


async def disk_quota(tmp: Path) -> Outcome:
    from agentrl.sandbox.base import SandboxSpec

    c = Checks()
    async with _provider(tmp) as p:
        box = await p.create(SandboxSpec(disk_mb=32))
        r = await box.exec("for i in 1 2 3 4; do head -c 10M /dev/zero > /tmp/f$i || echo full; done; "
                           "for i in 1 2 3 4; do head -c 20M /dev/zero > /dev/shm/s$i || echo shm-full; done")
        c("full" in r.output.split(), f"40 MB into a 32 MB disk ({box.disk_kind}): No space left on device")
        c("shm-full" in r.output.split(), "80 MB into /dev/shm (64 MB): No space left on device")
    return c.outcome()


def _host_address() -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
        addr = s.getsockname()[0]
        return None if addr.startswith("127.") else addr
    except OSError:
        return None
    finally:
        s.close()


async def network(tmp: Path) -> Outcome:
    from agentrl.sandbox.base import SandboxError, SandboxSpec

    c = Checks()
    async with _provider(tmp, local_allow_network=True) as p:
        if shutil.which("slirp4netns") is None:
            try:
                await p.create(SandboxSpec(allow_network=True))
                c(False, "without slirp4netns a networked sandbox is refused")
            except SandboxError as e:
                c("slirp4netns" in str(e), f"without slirp4netns a networked sandbox is refused: {e}")
            return c.outcome()
        addr = _host_address()
        lo = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        out = await asyncio.start_server(lambda r, w: w.close(), addr, 0) if addr else None
        try:
            box = await p.create(SandboxSpec(allow_network=True))
            probe = "timeout 3 bash -c 'exec 3<>/dev/tcp/{}/{}' 2>/dev/null && echo open || echo closed"
            port = lo.sockets[0].getsockname()[1]
            r1 = await box.exec(probe.format("127.0.0.1", port), timeout_s=10)
            r2 = await box.exec(probe.format("10.0.2.2", port), timeout_s=10)
            c(r1.output.strip() == r2.output.strip() == "closed",
              f"a listener on the host's 127.0.0.1:{port} is unreachable (directly and through slirp's host alias)")
            if out is not None:
                r3 = await box.exec(probe.format(addr, out.sockets[0].getsockname()[1]), timeout_s=10)
                c(r3.output.strip() == "open", f"the way out works: the host's {addr} is reachable as any machine's")
        finally:
            lo.close()
            if out is not None:
                out.close()
    return c.outcome()


async def sweep_after_kill(tmp: Path) -> Outcome:
    from agentrl.sandbox.base import SandboxSpec

    c = Checks()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _ORPHAN, str(tmp / "boxes"),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                cwd=Path(__file__).resolve().parents[1])
    stdout, _ = await asyncio.wait_for(proc.communicate(), 60)
    orphan = Path(stdout.decode().strip() or "/nonexistent")
    c(proc.returncode == -9 and orphan.is_dir(), "a run killed with SIGKILL leaves its sandbox's folder behind")
    async with _provider(tmp) as p:
        live = await p.create(SandboxSpec())
        n = await p.sweep_stale()
        c(n == 1 and not orphan.exists() and live.host_dir.is_dir(),
          f"the next run's sweep_stale removed {n} (the dead run's) and kept its own live sandbox")
    return c.outcome()


_VI = "a forgery that is armed when scoring starts scores 0: "
SCENARIOS = (
    Scenario("integrity_verifier_background_writers", "security",
             _VI + "setsid, nohup double-fork and tmux writers of reward.txt/reward.json are killed first",
             background_writers),
    Scenario("integrity_verifier_tests_replaced", "security",
             _VI + "a loop replacing /tests/* as soon as they appear is killed before /tests is uploaded",
             tests_replaced),
    Scenario("integrity_verifier_planted_dirs", "security",
             _VI + "planted, chmod/chattr-locked, symlinked and folder-for-file verdicts are removed and remade",
             verdict_dirs),
    Scenario("integrity_verifier_broken_sandbox", "security",
             _VI + "a sandbox left unable to start a program scores 0 (a fresh sandbox of the task runs the tests), "
             "not an infra error", broken_sandbox),
    Scenario("integrity_verifier_startup_hooks", "security",
             _VI + "shell startup files and a user-site .pth do not reach the fixtures' tests; fake programs "
             "cannot even be planted on the default PATH (read-only /usr)",
             startup_hooks),
    Scenario("integrity_verifier_fresh_sandbox", "security",
             "a faked program the tests trust wins in the agent's own sandbox (the known limit) and scores 0 in "
             "the fresh verifier sandbox, where the real solution still scores 1", fake_program_fresh_verifier),
    Scenario("integrity_verifier_daytona_kill_all", "security",
             "kill_all through the Daytona SDK (stand-in) ends a setsid writer and a tmux server", daytona_kill_all),
    Scenario("integrity_host_uid", "security",
             "root in the local sandbox is an unprivileged host uid; nested user namespaces are refused", host_uid),
    Scenario("integrity_host_kernel_knobs", "security",
             "writes to /proc/sys (core_pattern, net) and /sys are refused; the host's core_pattern is unchanged",
             kernel_knobs),
    Scenario("integrity_host_credentials", "security",
             "the host's shadow files read as empty and its /root is invisible", credentials),
    Scenario("integrity_host_disk_quota", "security",
             "a sandbox with disk_mb=32 cannot write 40 MB, nor 80 MB into /dev/shm", disk_quota),
    Scenario("integrity_host_loopback", "security",
             "with local_allow_network, the host's 127.0.0.1 listeners stay unreachable while the way out works "
             "(without slirp4netns the sandbox is refused)", network),
    Scenario("integrity_sweep_after_kill", "security",
             "sandboxes of a SIGKILLed run are removed by the next run's sweep_stale, live ones kept",
             sweep_after_kill),
)
