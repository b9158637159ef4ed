"""File-descriptor ownership of the local sandbox: every fd has one owner, which closes it once.

The bug these guard against: on the GPU machine a local-sandbox create failed with EBADF inside
`shutil.rmtree` (2 in ~1,900 episodes). Ray runs worker processes on uvloop wherever it is
installed, and uvloop's connect_read_pipe closes a pipe's fd through libuv and then again through
the file object handed to it (MagicStack/uvloop#763): a thread that opened a file in between
lost its fd. The sandbox now reads pipes with local_procs.PipeReader, which owns its fd.

Two detectors, used together (FdGuard):
- os.close is wrapped: closing an fd that is not open is a double close that nobody's open
  happened to fill (the common case of the same bug), recorded with both closers' stacks;
- os.fdopen is wrapped so that an unbuffered binary file object checks, when it closes, that its
  fd is still open: closed already means that a second owner (a loop's transport) closed it.
Each test runs on asyncio's loop and, where uvloop is installed (the GPU image), on uvloop's.
"""

from __future__ import annotations

import asyncio
import io
import os
import random
import shutil
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

import pytest

from agentrl.config.schema import SandboxConfig
from agentrl.sandbox.base import SandboxError, SandboxSpec
from agentrl.sandbox.local import LocalSandboxProvider
from agentrl.sandbox.local_procs import PipeReader, open_capped_pipe

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def _uvloop_factory():
    uvloop = pytest.importorskip("uvloop", reason="uvloop not installed (Ray uses it where it is)")
    return uvloop.new_event_loop


LOOPS = [
    pytest.param(lambda: asyncio.new_event_loop, id="asyncio"),
    pytest.param(_uvloop_factory, id="uvloop"),
]


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


class FdGuard:
    """Records double closes (see the module docstring) while installed with `install`."""

    def __init__(self):
        self.double_closes: list[str] = []
        self.made_at: dict[int, str] = {}  # fd -> where os.pipe made it (to name a leak's maker)
        self._last_close: dict[int, list[str]] = {}
        self._real_close, self._real_fdopen, self._real_pipe = os.close, os.fdopen, os.pipe

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FdGuard:
        monkeypatch.setattr(os, "close", self._close)
        monkeypatch.setattr(os, "fdopen", self._fdopen)
        monkeypatch.setattr(os, "pipe", self._pipe)
        return self

    def _pipe(self) -> tuple[int, int]:
        r, w = self._real_pipe()
        self.made_at[r] = self.made_at[w] = "".join(traceback.format_stack(limit=6)[:-1])
        return r, w

    def explain(self, leaked: dict[str, str]) -> str:
        return "\n".join(f"fd {fd} -> {what}, made by os.pipe at\n{self.made_at.get(int(fd), '(not os.pipe)')}"
                         for fd, what in leaked.items())

    def _close(self, fd: int) -> None:
        stack = traceback.format_stack(limit=7)[:-1]
        if not _is_open(fd):
            before = "".join(self._last_close.get(fd, ["(not closed through os.close)\n"]))
            self.double_closes.append(f"os.close({fd}) of a closed fd at\n{''.join(stack)}closed before at\n{before}")
        self._last_close[fd] = stack
        self._real_close(fd)

    def _fdopen(self, fd: int, mode: str = "r", buffering: int = -1, *args, **kwargs):
        if buffering != 0 or "b" not in mode or args or kwargs:
            return self._real_fdopen(fd, mode, buffering, *args, **kwargs)
        guard = self

        class SoleOwnerFile(io.FileIO):
            def close(self):
                if not self.closed and not _is_open(self.fileno()):
                    guard.double_closes.append(
                        f"fd {self.fileno()} was closed under its file object; the file object was made at\n"
                        + "".join(made_at)
                    )
                super().close()

        made_at = traceback.format_stack(limit=7)[:-1]
        return SoleOwnerFile(fd, mode.replace("b", ""))


def _run(loop_factory, main, *args):
    """main(*args) on a fresh loop of the kind `loop_factory` names (skips when not installed)."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main(*args))


def _open_fds() -> dict[str, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return out


# --- PipeReader: the one owner of a pipe's read end ------------------------------------------------


def _new_pipe_at(number: int) -> int:
    """A fresh pipe whose read end has the fd `number` (free now): returns its write end."""
    a, b = os.pipe()
    if a != number:
        os.dup2(a, number)
        os.close(a)
    return b


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_pipe_reader_closes_its_fd_once_and_never_reads_a_reused_number(loop_factory, monkeypatch):
    guard = FdGuard().install(monkeypatch)

    async def main():
        got, eofs = [], []
        # Read to EOF: the reader closes the fd by itself.
        r, w = os.pipe()
        reader = PipeReader(r, got.append, lambda: eofs.append(1))
        os.write(w, b"hello")
        os.close(w)
        for _ in range(100):
            if reader.closed:
                break
            await asyncio.sleep(0.001)
        assert reader.closed and b"".join(got) == b"hello" and eofs == [1] and not _is_open(r)
        # The number now belongs to someone else: closing the reader again must leave it alone.
        b = _new_pipe_at(r)
        reader.close()
        os.write(b, b"theirs")
        await asyncio.sleep(0.01)
        assert os.read(r, 100) == b"theirs" and eofs == [1]
        for fd in (b, r):
            os.close(fd)

        # Closed before EOF (a cancelled exec): the loop stops watching the number at once.
        got.clear()
        r, w = os.pipe()
        reader = PipeReader(r, got.append, lambda: eofs.append(2))
        reader.close()
        assert eofs == [1, 2] and not _is_open(r)
        b = _new_pipe_at(r)
        os.write(b, b"not the reader's")
        await asyncio.sleep(0.01)
        assert got == [] and os.read(r, 100) == b"not the reader's"
        for fd in (b, r, w):
            os.close(fd)

    _run(loop_factory, main)
    assert guard.double_closes == [], "\n".join(guard.double_closes)


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_capped_pipe_is_drained_and_closed_once(loop_factory, monkeypatch):
    guard = FdGuard().install(monkeypatch)

    async def main():
        before = _open_fds()
        w, out, pipe = open_capped_pipe(8)
        os.write(w, b"0123456789abcdef")
        os.close(w)
        await asyncio.wait_for(out.eof, 5)
        pipe.close()
        pipe.close()
        assert out.text() == "0123\n[... 8 bytes of output omitted ...]\ncdef" and out.truncated
        assert _open_fds() == before

    _run(loop_factory, main)
    assert guard.double_closes == [], "\n".join(guard.double_closes)


# --- real sandboxes: what an episode worker does to them ------------------------------------------


async def _cancel_after(coro, delay_s: float) -> None:
    """An episode timeout around a call: wait_for cancels it part way."""
    try:
        await asyncio.wait_for(coro, delay_s)
    except TimeoutError:
        pass


async def _cancel_twice(coro, delay_s: float, again_s: float) -> None:
    """An episode timeout, then a worker shutdown while the call still cleans up."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(delay_s)
    task.cancel()
    await asyncio.sleep(again_s)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def _episode(provider: LocalSandboxProvider, rnd: random.Random) -> None:
    """One episode's use of a sandbox, with the interruptions a worker adds: exec timeouts, execs
    cancelled part way (once, or twice: the second while it cleans up), files in and out, and
    (sometimes) a create cancelled part way, once or twice."""
    if rnd.random() < 0.2:
        task = asyncio.ensure_future(provider.create(SandboxSpec()))
        await asyncio.sleep(rnd.random() * 0.05)
        task.cancel()
        if rnd.random() < 0.5:
            await asyncio.sleep(rnd.random() * 0.01)
            task.cancel()
        try:
            await (await task).close()
        except asyncio.CancelledError:
            pass
        return
    box = await provider.create(SandboxSpec())
    try:
        assert (await box.exec("echo hi")).output == "hi\n"
        res = await box.exec("sleep 5", timeout_s=0.1 + rnd.random() * 0.1)
        assert res.timed_out
        await _cancel_after(box.exec("sleep 5; echo never"), 0.05 + rnd.random() * 0.1)
        await _cancel_twice(box.exec("sleep 5; echo never"), 0.05 + rnd.random() * 0.1, rnd.random() * 0.01)
        await box.upload(b"x" * 64, "/tmp/f")
        assert await box.download("/tmp/f") == b"x" * 64
    finally:
        await asyncio.gather(box.close(), box.close())  # the episode's finally and a worker shutdown


def _watch_own_fds(stop: threading.Event, stolen: list[str]) -> None:
    """What the create path's threads do (rmtree, os.walk): open a directory, use its fd, close
    it. An fd that changes under it was closed by someone else and its number reused."""
    path = tempfile.mkdtemp(prefix="fdwatch")
    try:
        while not stop.is_set():
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            ino = os.fstat(fd).st_ino
            time.sleep(0.0005)
            try:
                same = os.fstat(fd).st_ino == ino
            except OSError:
                same = False
            if same:
                os.close(fd)
            else:
                stolen.append(f"fd {fd}")  # not ours any more: never close it
    finally:
        os.rmdir(path)


async def _stress(tmp_path: Path, episodes: int, concurrency: int, seed: int) -> tuple[list[str], list[str]]:
    provider = LocalSandboxProvider(SandboxConfig(), run_id=f"fd{uuid.uuid4().hex[:8]}", root_dir=tmp_path / "boxes")
    errors: list[str] = []
    stolen: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_own_fds, args=(stop, stolen), daemon=True)
    watcher.start()
    slots = asyncio.Semaphore(concurrency)
    rnd = random.Random(seed)

    async def one(k: int) -> None:
        async with slots:
            try:
                await _episode(provider, random.Random(rnd.random() + k))
            except (SandboxError, OSError, AssertionError) as err:
                errors.append(f"{type(err).__name__}: {err}"[:300])

    try:
        await asyncio.gather(*(one(k) for k in range(episodes)))
    finally:
        stop.set()
        await asyncio.to_thread(watcher.join)
        await provider.aclose()
    await asyncio.sleep(0.05)  # the loop's last callbacks (pipe EOFs of killed processes)
    return errors, stolen


def _stress_on(loop_factory, tmp_path: Path, **kw) -> tuple[list[str], list[str], dict[str, str]]:
    """(errors, stolen fds, fds left open once the loop is closed: uvloop keeps a /dev/null of its
    own while a loop lives, and libuv a signal-lock pipe for the whole process from the first loop
    on, so one loop of the kind is made before counting)."""
    loop_factory()().close()
    before = _open_fds()
    errors, stolen = _run(loop_factory, _stress, tmp_path, kw["episodes"], kw["concurrency"], kw["seed"])
    leaked = {k: v for k, v in _open_fds().items() if k not in before}
    return errors, stolen, leaked


@needs_bwrap
@pytest.mark.parametrize("loop_factory", LOOPS)
def test_an_episode_workers_use_of_sandboxes_closes_every_fd_once(loop_factory, monkeypatch, tmp_path):
    guard = FdGuard().install(monkeypatch)
    errors, stolen, leaked = _stress_on(loop_factory, tmp_path, episodes=4, concurrency=4, seed=1)
    assert guard.double_closes == [], "\n".join(guard.double_closes)
    assert errors == [] and stolen == [], (errors, stolen)
    assert leaked == {}, guard.explain(leaked)


@pytest.mark.slow
@needs_bwrap
@pytest.mark.parametrize("loop_factory", LOOPS)
def test_sandbox_fd_ownership_stress(loop_factory, monkeypatch, tmp_path):
    """100 episodes, 8 at a time (15-30 s per loop here); before PipeReader, uvloop's run
    failed a create with EBADF or 'File exists' within about 60 sandboxes, or aborted in libuv."""
    guard = FdGuard().install(monkeypatch)
    errors, stolen, leaked = _stress_on(loop_factory, tmp_path, episodes=100, concurrency=8, seed=2)
    assert guard.double_closes == [], "\n".join(guard.double_closes[:3])
    assert errors == [] and stolen == [], (errors[:5], stolen[:5])
    assert leaked == {}, guard.explain(leaked)


def test_bwrap_data_fds_reach_no_process_but_the_one_they_are_passed_to():
    from agentrl.sandbox.local_isolation import memfd_with

    fd = memfd_with(b"nameserver 10.0.2.3\n")
    try:
        # uvloop spawns without close_fds: an inheritable fd would go into every concurrent exec
        assert not os.get_inheritable(fd) and os.read(fd, 100) == b"nameserver 10.0.2.3\n"
    finally:
        os.close(fd)


@needs_bwrap
@pytest.mark.parametrize("loop_factory", LOOPS)
def test_no_inheritable_fd_of_the_worker_reaches_a_sandboxed_command(loop_factory, tmp_path):
    """uvloop spawns without close_fds: an inheritable directory fd of the worker (here opened on
    the host's /) would reach the command inside the sandbox, and `..` from it escapes its root.
    The sandbox seals such fds before every spawn. What the command may hold: its stdin (/dev/null),
    its output pipe, the folder `ls` lists, and (uvloop) libuv's own copies of those stdio fds."""
    host_root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    r, w = os.pipe()
    for fd in (host_root, r, w):
        os.set_inheritable(fd, True)
    leaked_pipe = f"pipe:[{os.fstat(r).st_ino}]"

    async def main() -> str:
        provider = LocalSandboxProvider(SandboxConfig(), run_id=f"fd{uuid.uuid4().hex[:8]}", root_dir=tmp_path / "b")
        box = await provider.create(SandboxSpec())
        try:
            result = await box.exec("ls -l /proc/self/fd", timeout_s=30)
            assert result.exit_code == 0, result.output
            return result.output
        finally:
            await box.close()

    loop = loop_factory()()
    try:
        listing = loop.run_until_complete(main())
    finally:
        loop.close()
        for fd in (host_root, r, w):
            os.close(fd)
    targets = dict(line.split()[-3::2] for line in listing.splitlines() if " -> " in line)
    own = {"/dev/null", targets["1"]}
    others = {fd: t for fd, t in targets.items() if t not in own and not t.startswith("/proc/")}
    assert not others and leaked_pipe not in targets.values(), listing
