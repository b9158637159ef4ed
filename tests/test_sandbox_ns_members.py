"""Who is in a local sandbox: ns_members walks the sandbox's own process tree (its init's and its
running nsenters' descendants) and checks the walk against the sandbox's /proc, instead of reading
the pid namespace of every host process. It must find exactly what the full scan finds, also for
what the agent does to escape a kill (fork, setsid, double fork, threads, a main thread that exits
alone, an orphan whose nsenter was killed), and take the walk in the common case."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import pytest

from agentrl.config.schema import SandboxConfig
from agentrl.sandbox import local_box, local_procs
from agentrl.sandbox.base import SandboxSpec
from agentrl.sandbox.local import LocalSandboxProvider
from agentrl.sandbox.local_procs import pid_namespace, pids_in_namespace
from tests.test_sandbox_fd_ownership import needs_bwrap

pytestmark = needs_bwrap

# Every escape the agent has: a plain background child, one in a new session, a double fork (its
# parent exits, it is reparented to the init), a tmux server, a zombie (its parent never waits),
# a child forked by a process's second thread, and a process whose main thread called exit(2) while
# its other thread runs on (its leader shows "Z").
ESCAPES = r"""
sleep 1000 >/dev/null 2>&1 &
setsid sleep 1001 >/dev/null 2>&1 &
( (sleep 1002 >/dev/null 2>&1 &) & )
tmux new-session -d -s s 'sleep 1003'
(sleep 0.01 & exec sleep 1004) >/dev/null 2>&1 &
python3 -c '
import os, subprocess, threading, time
threading.Thread(target=lambda: (subprocess.Popen(["sleep", "1005"]), time.sleep(1000))).start()
time.sleep(1000)' >/dev/null 2>&1 &
python3 -c '
import ctypes, threading, time
threading.Thread(target=lambda: time.sleep(1000)).start()
ctypes.CDLL(None).syscall(60, 0)' >/dev/null 2>&1 &
"""
ESCAPED = 8  # sleep 1000-1005, the thread-forked sleep's python and the one-thread-left python (+ tmux)


@pytest.fixture
async def provider(tmp_path):
    p = LocalSandboxProvider(SandboxConfig(), run_id=f"m{uuid.uuid4().hex[:8]}", root_dir=tmp_path / "boxes")
    yield p
    await p.aclose()


@pytest.fixture
def full_scans(monkeypatch) -> list[str]:
    """Records each full /proc scan (pids_in_namespace) that the sandbox code makes."""
    scans: list[str] = []

    def counted(ns: str) -> list[int]:
        scans.append(ns)
        return pids_in_namespace(ns)

    monkeypatch.setattr(local_procs, "pids_in_namespace", counted)
    return scans


def _unreaped(pidfds: list[int]) -> list[int]:
    """Those of `pidfds` whose process is not reaped yet."""
    out = []
    for fd in pidfds:
        try:
            signal.pidfd_send_signal(fd, 0)
            out.append(fd)
        except ProcessLookupError:
            pass
    return out


async def _reaped(pidfds: list[int], timeout_s: float = 10.0) -> bool:
    """Whether all of `pidfds` are reaped within `timeout_s`: an orphan's zombie waits for the host's
    pid 1, which reaped one ~1.4 s after its exit here (a firecracker init)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while _unreaped(pidfds) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return not _unreaped(pidfds)


def _running(ns: str, needle: bytes) -> list[int]:
    """The live processes of `ns` whose command line holds `needle`."""
    out = []
    for pid in pids_in_namespace(ns):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


async def _orphan(box) -> list[int]:
    """Start an exec whose nsenter is then killed from outside, leaving its command (a shell, a
    background sleep and a setsid one) reparented outside the sandbox; returns pidfds of its processes."""
    task = asyncio.ensure_future(box.exec("sleep 1010 & setsid sleep 1011 & sleep 1012", timeout_s=60))
    deadline = asyncio.get_running_loop().time() + 10
    while len(_running(box._ns, b"sleep\x00101")) < 3:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)
    (nsenter,) = box._nsenters
    command = [p for p in pids_in_namespace(box._ns) if p not in (box._init_pid, box._keeper_pid)]
    pidfds = [os.pidfd_open(p) for p in command]
    os.kill(nsenter, signal.SIGKILL)  # our own child, not reaped yet: the number is still its own
    res = await task
    assert res.exit_code == 128 + signal.SIGKILL
    outside = [p for p in command if pid_namespace(local_procs.parent_of(p) or 1) != box._ns]
    assert outside, "nothing of the command was reparented outside the sandbox"
    return pidfds


async def _until(ready, timeout_s: float = 60.0) -> None:
    """Wait for the agent's processes to be in place. A fixed `sleep 0.5` was too short for python3
    to start and reach its exit(2) or its first write beside CI's Ray lane on 2 cores."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await ready():
        assert asyncio.get_running_loop().time() < deadline, "the agent's processes never got in place"
        await asyncio.sleep(0.1)


async def test_the_walk_finds_what_the_full_scan_finds(provider, full_scans):
    box = await provider.create(SandboxSpec())
    await box.exec(ESCAPES, timeout_s=30)

    async def in_place() -> bool:  # every escape started, the lone thread's main thread exited
        members = box._members()
        return len(members) >= 2 + ESCAPED and any(_state(p) == "Z" for p in members)

    await _until(in_place)
    walked = box._members()
    assert full_scans == [], "the walk fell back to a full scan"
    assert walked == pids_in_namespace(box._ns)
    assert len(walked) >= 2 + ESCAPED
    assert len([p for p in walked if _state(p) == "Z"]) == 1  # the python whose main thread exited
    agents = [p for p in walked if p not in (box._init_pid, box._keeper_pid)]
    assert await box.kill_all() >= ESCAPED
    assert [p for p in agents if _running_threads(p)] == []
    assert box._members() == pids_in_namespace(box._ns) == sorted([box._init_pid, box._keeper_pid])
    assert full_scans == []


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _running_threads(pid: int) -> list[str]:
    """The threads of `pid` that have not exited."""
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    out.append(tid)
        except OSError:
            pass
    return out


async def test_an_orphan_of_a_killed_nsenter_is_found_and_ended_by_kill_all(provider, full_scans):
    box = await provider.create(SandboxSpec())
    pidfds = await _orphan(box)
    full_scans.clear()
    assert box._members() == pids_in_namespace(box._ns)
    assert full_scans, "the walk cannot see the orphan: it must have fallen back to the full scan"
    assert await box.kill_all() == len(pidfds)
    assert pids_in_namespace(box._ns) == sorted([box._init_pid, box._keeper_pid])
    assert await _reaped(pidfds)
    for fd in pidfds:
        os.close(fd)


# Writers that try to outlive kill_all (the step before the task's tests) and rewrite a result:
# one that forks a new generation and exits every 2 ms, so no pid stays its own for long; one
# whose name fakes the status lines that the walk reads ("State: Z", "Threads: 1"); one whose
# main thread exits while its writer thread runs on.
FORGERS = r"""
python3 -c '
import os, time
while True:
    if os.fork(): os._exit(0)
    open("/tmp/res_fork", "w").write("PASS"); time.sleep(0.002)' >/dev/null 2>&1 &
python3 -c '
import ctypes, time
ctypes.CDLL(None).prctl(15, b"x\nState:\tZ (zombie)\nThreads:\t1", 0, 0, 0)
while True:
    open("/tmp/res_name", "w").write("PASS"); time.sleep(0.01)' >/dev/null 2>&1 &
python3 -c '
import ctypes, threading, time
def write():
    while True:
        open("/tmp/res_thread", "w").write("PASS"); time.sleep(0.01)
threading.Thread(target=write).start()
ctypes.CDLL(None).syscall(60, 0)' >/dev/null 2>&1 &
"""


async def test_writers_that_fork_away_or_fake_their_status_do_not_outlive_kill_all(provider):
    box = await provider.create(SandboxSpec())
    await box.exec(FORGERS, timeout_s=30)

    async def all_writing() -> bool:
        return (await box.exec("ls /tmp/res_fork /tmp/res_name /tmp/res_thread", timeout_s=10)).exit_code == 0

    await _until(all_writing)
    assert await box.kill_all() >= 3
    assert pids_in_namespace(box._ns) == sorted([box._init_pid, box._keeper_pid])
    await box.exec("rm -f /tmp/res_*", timeout_s=10)
    await asyncio.sleep(1.0)  # a survivor writes every 2-10 ms
    assert (await box.exec("ls /tmp/res_* 2>/dev/null", timeout_s=10)).output.strip() == ""


async def test_an_orphan_of_a_killed_nsenter_is_ended_by_close(provider):
    box = await provider.create(SandboxSpec())
    pidfds = await _orphan(box)
    await box.close()
    assert _unreaped(pidfds) == []  # the init is reaped last: close waited for it, so they are gone
    for fd in pidfds:
        os.close(fd)


async def test_an_episode_takes_the_walk_and_close_scans_nothing(provider, full_scans, monkeypatch):
    box = await provider.create(SandboxSpec())
    await box.exec(ESCAPES, timeout_s=30)
    await box.upload(b"data", "/app/f")
    assert await box.download("/app/f") == b"data"
    res = await box.exec("sleep 1020 & setsid sleep 1021 & sleep 1022", timeout_s=0.5)  # kill_exec_tree
    assert res.timed_out
    assert await box.kill_all() >= ESCAPED
    assert full_scans == [], "an episode's scans fell back to reading every host process"
    walks: list[str] = []
    real_walk = local_procs.ns_members
    monkeypatch.setattr(local_box, "ns_members", lambda ns, *a: walks.append(ns) or real_walk(ns, *a))
    ns = box._ns
    await box.close()
    assert full_scans == [] and walks == [], "close scanned although the init was reaped"
    assert pids_in_namespace(ns) == []


def test_an_open_proc_dir_signals_a_zombie_and_goes_stale_once_reaped():
    """The kernel fact the walk's check stands on: an open /proc/PID directory is a pidfd that still
    signals a zombie and fails (ESRCH) once the process is reaped, so a namespace pid whose walked
    process was reaped since (and the number maybe reused) is never taken for the walked one."""
    import subprocess

    proc = subprocess.Popen(["sleep", "60"])
    fd = os.open(f"/proc/{proc.pid}", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert local_procs._unreaped(fd)
        proc.kill()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # a zombie now, not reaped
        assert local_procs._unreaped(fd)
        proc.wait()
        assert not local_procs._unreaped(fd)
    finally:
        os.close(fd)


async def test_a_listed_process_not_still_the_walked_one_sends_the_scan_to_the_full_one(
    provider, full_scans, monkeypatch
):
    box = await provider.create(SandboxSpec())
    await box.exec("sleep 1030 >/dev/null 2>&1 &")
    monkeypatch.setattr(local_procs, "_unreaped", lambda fd: False)  # as if each was reaped since the walk
    assert box._members() == pids_in_namespace(box._ns)
    assert full_scans
