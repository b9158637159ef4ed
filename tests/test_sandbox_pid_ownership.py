"""Process ownership of the local sandbox: it signals only processes it started, and its cleanup
(of a cancelled exec, of a failed create) runs to its end however often it is cancelled.

A pid number names a process only until that process is reaped: the event loop reaps nsenter and
bwrap, bwrap reaps the sandbox's init, and the kernel then hands the number to the next process
that forks. These tests make that happen for real: /proc/sys/kernel/ns_last_pid (writable by root,
which the local sandbox needs anyway) puts a fresh `sleep` of ours on the freed number, and the
sandbox must leave it alone. Each test runs on asyncio's loop and on uvloop's (Ray's, where installed).
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import threading
import time
import uuid

import pytest

from agentrl.config.schema import SandboxConfig
from agentrl.sandbox import local_box
from agentrl.sandbox.base import SandboxError, SandboxSpec
from agentrl.sandbox.local import LocalSandboxProvider
from agentrl.sandbox.local_isolation import _read_with_timeout
from agentrl.sandbox.local_procs import pids_in_namespace
from tests.test_sandbox_fd_ownership import LOOPS, needs_bwrap  # the same two loops, the same bwrap check

NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"
needs_pid_control = pytest.mark.skipif(
    not os.access(NS_LAST_PID, os.W_OK), reason=f"{NS_LAST_PID} not writable (needs root)"
)



def _run(loop_factory, main, *args):
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main(*args))


def _gone(pid: int) -> bool:
    """Reaped: the number is free (a zombie still holds it)."""
    return not os.path.exists(f"/proc/{pid}")


def spawn_at_pid(pid: int, argv: tuple[str, ...] = ("sleep", "60"), tries: int = 200) -> subprocess.Popen:
    """A process of ours (`argv`, default `sleep 60`) with the pid `pid` (free now): the next fork
    gets ns_last_pid + 1, unless another process of the machine forks first, then we try again."""
    for _ in range(tries):
        with open(NS_LAST_PID, "w") as f:
            f.write(str(pid - 1))
        proc = subprocess.Popen(argv)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    pytest.skip(f"could not get pid {pid} back in {tries} tries (a busy machine)")


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()  # Popen's kill polls first: never a reused number
    proc.wait()


async def _wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _provider(tmp_path) -> LocalSandboxProvider:
    return LocalSandboxProvider(SandboxConfig(), run_id=f"pid{uuid.uuid4().hex[:8]}", root_dir=tmp_path / "boxes")


def _open_fds() -> dict[str, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return out


def _in_sandbox(ns: str, needle: str) -> list[int]:
    out = []
    for pid in pids_in_namespace(ns):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle.encode() in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


# --- units -----------------------------------------------------------------------------------------


def test_slirp_ready_read_takes_fds_above_select_limit():
    """select() refuses fds >= 1024 (ValueError); a busy worker's slirp ready pipe gets such numbers."""
    r, w = os.pipe()
    high = next(n for n in range(1500, 4000) if not os.path.exists(f"/proc/self/fd/{n}"))
    try:
        os.dup2(r, high)
        start = time.monotonic()
        assert _read_with_timeout(high, 0.05) == b""  # nothing yet: the timeout, not a hang
        assert 0.04 < time.monotonic() - start < 1
        os.write(w, b"1")
        assert _read_with_timeout(high, 5) == b"1"
        with pytest.raises(ValueError):  # what the old code ran into
            select.select([high], [], [], 0)
    finally:
        for fd in (r, w, high):
            os.close(fd)


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_run_to_end_finishes_its_cleanup_through_repeated_cancels(loop_factory):
    from agentrl.sandbox.local_procs import run_to_end

    async def main():
        steps: list[str] = []

        async def cleanup():
            for k in range(3):
                await asyncio.sleep(0.02)
                steps.append(f"step {k}")
            return "done"

        async def caller():
            return await run_to_end(cleanup())

        task = asyncio.ensure_future(caller())
        for _ in range(3):
            await asyncio.sleep(0.01)
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert steps == ["step 0", "step 1", "step 2"]  # every step ran before the cancel came out
        assert await run_to_end(cleanup()) == "done"  # uncancelled: its result

    _run(loop_factory, main)


@needs_pid_control
def test_a_process_ref_never_signals_the_next_owner_of_the_pid():
    from agentrl.sandbox.local_procs import ProcessRef

    proc = subprocess.Popen(["sleep", "60"])
    ref = ProcessRef(proc.pid, lambda pid: True)
    assert ref.held and ref.exists()
    _stop(proc)  # exited and reaped: its number is free
    victim = spawn_at_pid(proc.pid)
    try:
        assert not ref.kill() and not ref.exists()
        assert victim.poll() is None
    finally:
        ref.close()
        ref.close()  # once: the second is a no-op
        _stop(victim)
    gone = ProcessRef(proc.pid, lambda pid: False)  # a number that is not ours: never held
    assert not gone.held and not gone.kill()


# --- real sandboxes --------------------------------------------------------------------------------


@needs_bwrap
@needs_pid_control
@pytest.mark.parametrize("loop_factory", LOOPS)
def test_close_leaves_alone_a_process_that_got_the_dead_inits_pid(loop_factory, tmp_path):
    """The init dies first (the agent killed its keeper, or the pids watchdog fired), bwrap reaps it;
    close() must not SIGKILL whatever process has that number by then."""

    async def main():
        provider = _provider(tmp_path)
        victim = None
        try:
            box = await provider.create(SandboxSpec())
            init = box._init_pid
            os.kill(init, signal.SIGKILL)  # ours and alive: the box was just created
            await _wait_until(lambda: _gone(init))
            victim = spawn_at_pid(init)
            await box.close()
            assert victim.poll() is None, "close() killed the process that reused the init's pid"
        finally:
            if victim is not None:
                _stop(victim)
            await provider.aclose()

    _run(loop_factory, main)


@needs_bwrap
@needs_pid_control
@pytest.mark.parametrize("loop_factory", LOOPS)
def test_an_exec_racing_the_inits_death_never_enters_the_next_owner_of_its_pid(loop_factory, tmp_path, monkeypatch):
    """An exec checks that the sandbox lives, then nsenter enters it. If the init dies in between
    and its pid goes to a process in another user namespace (another sandbox's, say), nsenter by
    pid would enter that process's namespaces and root: here the host's /, with root's uid."""
    escaped = tmp_path / "escaped"

    async def main():
        provider = _provider(tmp_path)
        victim = None
        try:
            box = await provider.create(SandboxSpec())
            init = box._init_pid
            os.kill(init, signal.SIGKILL)  # ours and alive: the box was just created
            await _wait_until(lambda: _gone(init))
            victim = spawn_at_pid(init, ("unshare", "--user", "--map-root-user", "sleep", "60"))
            monkeypatch.setattr(box, "_check_alive", lambda: None)  # it passed just before the death
            try:
                await box.exec(f"touch {escaped}", cwd="/", timeout_s=10)
            except SandboxError as err:
                assert err.kind == "lost"
            assert not escaped.exists(), "a dead sandbox's exec ran in the namespaces of its pid's next owner"
        finally:
            if victim is not None:
                _stop(victim)
            await provider.aclose()

    _run(loop_factory, main)


@needs_bwrap
@needs_pid_control
@pytest.mark.parametrize("loop_factory", LOOPS)
def test_a_timed_out_exec_leaves_alone_a_process_that_got_nsenters_pid(loop_factory, tmp_path, monkeypatch):
    """On a timeout the exec's tree is killed first; nsenter then exits and the loop reaps it while
    the kill runs in its thread. The SIGKILL meant for nsenter must not reach the pid's next owner."""
    victims: list[subprocess.Popen] = []
    real_kill_tree = local_box.kill_exec_tree

    def kill_tree_then_reuse_nsenters_pid(ns: str, marker: bytes, **kw) -> int:
        nsenter = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _child_with(pid, marker)]
        killed = real_kill_tree(ns, marker, **kw)
        if len(nsenter) == 1:
            deadline = time.monotonic() + 10
            while not _gone(nsenter[0]) and time.monotonic() < deadline:
                time.sleep(0.005)  # the loop reaps it meanwhile
            victims.append(spawn_at_pid(nsenter[0]))
        return killed

    async def main():
        provider = _provider(tmp_path)
        try:
            box = await provider.create(SandboxSpec())
            monkeypatch.setattr(local_box, "kill_exec_tree", kill_tree_then_reuse_nsenters_pid)
            res = await box.exec("sleep 30", timeout_s=0.3)
            assert res.timed_out
            assert len(victims) == 1, "nsenter was not found"
            assert victims[0].poll() is None, "the timeout killed the process that reused nsenter's pid"
        finally:
            for v in victims:
                _stop(v)
            await provider.aclose()

    _run(loop_factory, main)


def _child_with(pid: int, marker: bytes) -> bool:
    """A direct child of this process whose environment carries `marker`: the exec's nsenter."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        with open(f"/proc/{pid}/environ", "rb") as f:
            return ppid == os.getpid() and marker in f.read().split(b"\0")
    except (OSError, ValueError, IndexError):
        return False


@needs_bwrap
@pytest.mark.parametrize("loop_factory", LOOPS)
def test_an_exec_cancelled_while_spawning_ends_its_command(loop_factory, tmp_path, monkeypatch):
    """The cancel lands while the loop still finishes the spawn (after the fork: the loop kills
    nsenter then), but the command nsenter forked into the sandbox already runs."""
    real_spawn = asyncio.create_subprocess_exec
    command = "/tmp/spawnme 1000"

    async def spawn_that_finishes_late(*args, **kw):
        proc = await real_spawn(*args, **kw)
        if command in args:
            try:
                await asyncio.sleep(30)  # the rest of the spawn; cancelled here
            except asyncio.CancelledError:
                proc.kill()  # what both loops do to a process whose spawn was cancelled
                raise
        return proc

    async def main():
        provider = _provider(tmp_path)
        try:
            box = await provider.create(SandboxSpec())
            await box.exec("cp /usr/bin/sleep /tmp/spawnme")
            monkeypatch.setattr(asyncio, "create_subprocess_exec", spawn_that_finishes_late)
            task = asyncio.ensure_future(box.exec(command, timeout_s=60))
            await _wait_until(lambda: _in_sandbox(box._ns, "/tmp/spawnme"))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert _in_sandbox(box._ns, "/tmp/spawnme") == []  # ended before the cancel came out
            monkeypatch.undo()
            assert (await box.exec("echo still usable")).output == "still usable\n"
        finally:
            await provider.aclose()

    _run(loop_factory, main)


@needs_bwrap
@pytest.mark.parametrize("loop_factory", LOOPS)
def test_an_exec_cancelled_twice_ends_its_command_and_closes_its_fds(loop_factory, tmp_path):
    async def main():
        provider = _provider(tmp_path)
        try:
            box = await provider.create(SandboxSpec())
            await box.exec("cp /usr/bin/sleep /tmp/cancel2")
            before = _open_fds()
            task = asyncio.ensure_future(box.exec("/tmp/cancel2 1000", timeout_s=60))
            await _wait_until(lambda: _in_sandbox(box._ns, "/tmp/cancel2"))
            task.cancel()
            await asyncio.sleep(0)  # the exec is in its cleanup now (killing the tree in a thread)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert _in_sandbox(box._ns, "/tmp/cancel2") == []
            assert _open_fds() == before
        finally:
            await provider.aclose()

    _run(loop_factory, main)


@needs_bwrap
@pytest.mark.parametrize("loop_factory", LOOPS)
def test_a_create_cancelled_twice_still_cleans_up(loop_factory, tmp_path, monkeypatch):
    """The first cancel lands while the folder is built in its thread; the create waits for the
    build, and a second cancel (a worker's shutdown after an episode timeout) must not cut that
    short: the user-namespace holder, the owner-lock fd and the folder would be left."""
    from agentrl.sandbox.local import LocalSandboxProvider as Provider

    building, release = threading.Event(), threading.Event()
    real_build = Provider._build_stage

    def slow_build(box, plan, spec):
        building.set()
        release.wait(10)
        real_build(box, plan, spec)

    monkeypatch.setattr(Provider, "_build_stage", staticmethod(slow_build))

    async def main():
        provider = _provider(tmp_path)
        before_fds, before_kids = _open_fds(), _children()
        try:
            task = asyncio.ensure_future(provider.create(SandboxSpec()))
            await asyncio.to_thread(building.wait, 10)
            for _ in range(2):
                task.cancel()
                await asyncio.sleep(0.05)
            assert not task.done()  # still waiting for the build, then cleaning up
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert list(provider.base_dir.iterdir()) == []
            leaked = {k: v for k, v in _open_fds().items() if k not in before_fds}
            assert leaked == {}  # the owner lock and the holder's pipe included
            assert _children() - before_kids == set()  # the holder ended
        finally:
            release.set()
            await provider.aclose()

    _run(loop_factory, main)


def _children() -> set[int]:
    """Live (unreaped) children of this process."""
    out = set()
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[1]) == os.getpid():
                    out.add(int(name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def test_end_all_but_counts_a_process_that_died_of_another_kill(monkeypatch):
    """A process gone before its own signal (a tmux pane whose server was just killed fails the
    pidfd namespace check as it dies) still counts as ended: the count is of the processes found
    and then gone, not of the signals that got through (which made it 4 of 5 under load)."""
    from agentrl.sandbox import local_procs

    alive = {10, 11, 12}
    kills: list[int] = []

    def kill(pid, ns):
        kills.append(pid)
        alive.discard(pid)
        if pid == 10:
            alive.discard(11)  # 11 dies with 10, before its own kill
        return pid in (10, 12)

    def members():
        return sorted(alive | {1})

    monkeypatch.setattr(local_procs, "kill_in_namespace", lambda pid, ns: kill(pid, ns) if pid in alive else False)
    ended, left = local_procs.end_all_but("ns", {1}, 1.0, pause_s=0.0, members=members)
    assert (ended, left) == (3, [])
    assert kills == [10, 12]  # 11 was never signalled: it was gone by then
