"""Process plumbing of the local sandbox: a capped output pipe, a killer for one exec's tree,
processes named by pidfds (ProcessRef), who is in a pid namespace (ns_members: from the sandbox's
own process tree, not every host process), and cleanup that runs to its end however often it is
cancelled (run_to_end).

Kept apart from local.py because both are pure host-side mechanics with their own tests: neither
knows about bubblewrap, only about pipes, /proc and pid namespaces.

Pipes are read with PipeReader, never with `loop.connect_read_pipe`: uvloop (Ray's event loop in
every worker process wherever uvloop is installed, e.g. the GPU image) hands the file object's fd
to libuv, which closes it, and then closes the file object too: the same fd number twice
(MagicStack/uvloop#763, open in 0.23.0). When another thread opened a file in between, its fd
is the one closed: EBADF in a create's rmtree, 2 in ~1,900 GPU episodes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterable

_READ_CHUNK = 256 << 10  # bytes per read: what asyncio's own pipe transport reads at once


class PipeReader:
    """Reads the read end `fd` of a pipe on the running loop, calling `on_data(bytes)` per read and
    `on_eof()` once, at EOF or at close(). It owns `fd` from construction to close(): the loop is
    only asked to watch it (add_reader), so nothing else ever closes it, and close() stops the
    watch before closing the number, so a later owner of the number is never read from. Not
    thread-safe: use it on the loop's thread."""

    def __init__(self, fd: int, on_data: Callable[[bytes], None], on_eof: Callable[[], None]):
        self._loop = asyncio.get_running_loop()
        self._fd = fd
        self._on_data, self._on_eof = on_data, on_eof
        try:
            os.set_blocking(fd, False)
            self._loop.add_reader(fd, self._readable)
        except BaseException:
            self._fd = -1
            os.close(fd)
            raise

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def _readable(self) -> None:
        if self._fd < 0:
            return
        try:
            data = os.read(self._fd, _READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""  # not readable any more: the same as EOF for a pipe
        if data:
            self._on_data(data)
        else:
            self.close()

    def close(self) -> None:
        """Stop reading and close the fd (once); `on_eof` runs if it has not yet."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            self._loop.remove_reader(fd)
        finally:
            os.close(fd)
            self._on_eof()


class CappedOutput:
    """Reads a pipe to EOF keeping at most `max_bytes`: the first half and the last half.

    Everything in between is counted and dropped as it arrives, so a command that prints 1 GB
    costs 1 GB of pipe reads but never 1 GB of memory. The reader keeps draining after the cap so
    the writer never blocks on a full pipe (blocking would change what the command does).
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, max_bytes)
        self._head_cap = self.max_bytes // 2
        self._tail_cap = self.max_bytes - self._head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.eof: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.total += len(data)
        room = self._head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self._tail_cap:
            if len(data) >= self._tail_cap:
                self.tail[:] = data[-self._tail_cap :]
            else:
                self.tail += data
                excess = len(self.tail) - self._tail_cap
                if excess > 0:
                    del self.tail[:excess]

    def eof_received(self) -> None:
        if not self.eof.done():
            self.eof.set_result(None)

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def text(self) -> str:
        if not self.truncated:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", errors="replace")
        omitted = self.total - len(self.head) - len(self.tail)
        marker = f"\n[... {omitted} bytes of output omitted ...]\n"
        return (
            bytes(self.head).decode("utf-8", errors="replace")
            + marker
            + bytes(self.tail).decode("utf-8", errors="replace")
        )


def open_capped_pipe(max_bytes: int) -> tuple[int, CappedOutput, PipeReader]:
    """A fresh pipe: returns (write fd for the child, the capping reader, the PipeReader that owns
    the read end). The caller closes the write fd after spawning and the PipeReader when done."""
    reader = CappedOutput(max_bytes)
    r, w = os.pipe()
    try:
        pipe = PipeReader(r, reader.data_received, reader.eof_received)  # owns r, even when it raises
    except BaseException:
        os.close(w)
        raise
    return w, reader, pipe


def pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def pids_in_namespace(ns: str) -> list[int]:
    """Host pids of the live processes in the pid namespace `ns` ("pid:[inode]"): every host process's
    namespace is read, O(processes of the host). ns_members finds the same set for a sandbox from its
    own process tree and falls back to this."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and pid_namespace(int(name)) == ns and not _ended(int(name)):
            out.append(int(name))
    return out


def _ended(pid: int) -> bool:
    """Gone, or a zombie whose threads have all exited. A main thread that called exit(2) leaves a
    "Z" leader while its other threads run on (num_threads counts them): measured, such a process
    escaped kill_all when only the state was read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0] in (b"Z", b"X") and int(fields[17]) <= 1
    except (OSError, IndexError, ValueError):
        return True


# ns_members walks at most this many processes, then scans the host's /proc instead: the walk holds
# one fd per process until its check, and a fork bomb (a sandbox may reach MAX_PIDS, 1024) must not
# take a worker's fds. The busiest sandbox of the tests held 12 (tests/test_sandbox_ns_members.py).
_WALK_MAX = 128
# A /proc/PID directory opened so is a pidfd (pidfd_send_signal takes it; opened O_PATH it does not,
# EBADF); it signals a zombie and fails with ESRCH once the process is reaped.
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def ns_members(ns: str, init: int, entrants: Iterable[int] = ()) -> list[int]:
    """pids_in_namespace(ns), in O(processes of the namespace) instead of O(processes of the host).

    `init` is the namespace's pid 1 (host pid), `entrants` host processes that entered it (nsenter:
    its child is inside, its parent outside). The processes found by walking their descendants are
    checked against the namespace's own procfs (the sandbox's /proc, through the init's root), which
    lists every process of the namespace, zombies too, whatever its parent: when some process
    listed there was not found (an orphan of a killed nsenter, reparented outside the namespace; a
    fork the walk missed), or the init is gone, this is pids_in_namespace(ns). The listing comes
    after the walk, and each process it names must still be the one the walk found (a pidfd held
    since), so a process that exists when the listing is read is never missed. That listing is
    trusted: nothing in the sandbox can mount over its /proc (no CAP_SYS_ADMIN, see local_isolation.ROOT_CAPS;
    no nested user namespaces, max_user_namespaces is 0 in there). Blocking."""
    found = _walk_namespace(ns, init, entrants)
    return found if found is not None else pids_in_namespace(ns)


def _walk_namespace(ns: str, init: int, entrants: Iterable[int]) -> list[int] | None:
    """The live processes of `ns` among the descendants of `init` and `entrants`, sorted; None when
    the namespace's procfs names a process they do not hold or cannot be read, or when they are
    more than _WALK_MAX."""
    held: dict[int, tuple[int, int, bool]] = {}  # namespace pid -> (host pid, pidfd, live)
    try:
        todo = [init, *_children(entrants)]
        seen: set[int] = set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            member = _open_member(pid, ns)
            if member is None:
                continue  # not of `ns` (a host process, a reused number) or gone: not counted
            fd, inner, live, kids = member
            if inner in held or len(held) >= _WALK_MAX:
                os.close(fd)
                return None
            held[inner] = (pid, fd, live)
            todo += kids
        if not _lists_only(held, init):
            return None
        return sorted(pid for pid, _, live in held.values() if live)
    finally:
        for _, fd, _ in held.values():
            os.close(fd)


def _children(parents: Iterable[int]) -> list[int]:
    """The children of single-threaded host processes (nsenter), read by number: each is checked
    by _open_member, so a number reused by an unrelated process only adds candidates."""
    out: list[int] = []
    for pid in parents:
        try:
            with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
                out += map(int, f.read().split())
        except OSError:
            continue
    return out


def _open_member(pid: int, ns: str) -> tuple[int, int, bool, list[int]] | None:
    """(pidfd, pid inside `ns`, live, children) of host pid `pid` when it is a process of `ns`, else
    None. Every read goes through the pidfd (its /proc directory, which goes stale once the process
    is reaped), so all of them are of one process, and the caller can ask later whether it still
    is unreaped. The children are those of every thread: a thread's fork is the thread's child."""
    try:
        fd = os.open(f"/proc/{pid}", _OPEN_DIR)
    except OSError:
        return None
    try:
        if os.readlink("ns/pid", dir_fd=fd) != ns:
            os.close(fd)
            return None
        status = _read_at(fd, "status")
        threads = int(_status_field(status, b"Threads"))
        live = _status_field(status, b"State").split()[0] not in (b"Z", b"X") or threads > 1  # as in _ended
        tids = [str(pid)] if threads == 1 else _list_at(fd, "task")
        kids = [int(k) for tid in tids for k in _read_at(fd, f"task/{tid}/children", missing_ok=True).split()]
        return fd, int(_status_field(status, b"NSpid").split()[-1]), live, kids
    except (OSError, IndexError, ValueError):
        os.close(fd)
        return None


def _status_field(status: bytes, key: bytes) -> bytes:
    """The value of `key` in a /proc/PID/status. Only the first line (Name) is the process's to
    choose, and the kernel escapes newlines there, so b"\\nKey:" starts the real line. Finding
    three fields this way costs ~1 us; splitting the whole file into a dict cost 15 us."""
    start = status.index(b"\n" + key + b":") + len(key) + 2
    return status[start : status.index(b"\n", start)]


def _lists_only(held: dict[int, tuple[int, int, bool]], init: int) -> bool:
    """Whether every process that the namespace's procfs (read now, through the held init's root)
    lists is one of `held`, still unreaped: then no process of it exists that the walk missed."""
    init_fd = next((fd for pid, fd, _ in held.values() if pid == init), None)
    if init_fd is None:
        return False  # the init is gone: no listing to check against
    try:
        names = _list_at(init_fd, "root/proc")
    except OSError:
        return False  # it exited meanwhile (a zombie has no root)
    for name in names:
        if name.isdigit():
            entry = held.get(int(name))
            if entry is None or not _unreaped(entry[1]):
                return False
    return True


def _unreaped(pidfd: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, 0)
        return True
    except OSError:
        return False


def _read_at(dir_fd: int, name: str, *, missing_ok: bool = False) -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        if missing_ok:  # a thread that exited since the listing
            return b""
        raise
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def _list_at(dir_fd: int, name: str) -> list[str]:
    fd = os.open(name, _OPEN_DIR, dir_fd=dir_fd)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, session id) of a process, as seen from the host."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[3])
    except (OSError, IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot): with the pid, it names one process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def running(pid: int, started: int | None) -> bool:
    """Whether the process `pid` that started at `started` (start_time) still runs: not exited,
    not a zombie, and not a later process that reused the pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return False
    try:
        return fields[0] not in (b"Z", b"X") and int(fields[19]) == started
    except (IndexError, ValueError):
        return False


def has_marker(pid: int, marker: bytes) -> bool:
    """Whether `marker` ("NAME=value") is one of the process's environment entries."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


Members = Callable[[], list[int]]  # the live processes of one pid namespace: pids_in_namespace's answer


def exec_tree(ns: str, marker: bytes, members: Members | None = None) -> set[int]:
    """The processes one exec started inside the sandbox: those whose environment carries the
    exec's marker (inherited through forks, daemonising and setsid), everything in their sessions,
    and every descendant of those. Processes of other execs (e.g. a tmux server started earlier)
    carry other markers and sessions and are left alone. `members` lists the namespace's processes
    (default: pids_in_namespace(ns))."""
    pids = members() if members is not None else pids_in_namespace(ns)
    procs = {pid: st for pid in pids if (st := _stat(pid)) is not None}
    tree = {pid for pid in procs if has_marker(pid, marker)}
    sessions = {procs[pid][1] for pid in tree}
    tree |= {pid for pid, (_, sid) in procs.items() if sid in sessions}
    grew = True
    while grew:
        kids = {pid for pid, (ppid, _) in procs.items() if ppid in tree and pid not in tree}
        tree |= kids
        grew = bool(kids)
    return tree


def kill_in_namespace(pid: int, ns: str) -> bool:
    """SIGKILL `pid` only if it still is a process of pid namespace `ns`: the pid is pinned with a
    pidfd first, so a pid that died and was reused by a host process since the scan is never hit.
    True when the signal was sent."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if pid_namespace(pid) != ns:  # checked after pinning: the pidfd now names this very process
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# A process in the middle of an execve shows an empty /proc/PID/environ for a few microseconds (the
# new image's environment is not mapped yet): 7 of 200 reads right after spawning a chain of 3 execs
# here. spawned_with waits that long, at most this long.
_EXEC_SETTLE_S = 0.05


def spawned_with(pid: int, marker: bytes) -> bool:
    """has_marker for a process we just spawned, which may be between two execs of its chain (bwrap
    is unshare, sh, nsenter, sh, then bwrap): an empty environment is read again until it is not."""
    deadline = time.monotonic() + _EXEC_SETTLE_S
    while True:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            return False
        if env or time.monotonic() > deadline:
            return marker in env.split(b"\0")
        time.sleep(0.0001)


def parent_of(pid: int) -> int | None:
    st = _stat(pid)
    return st[0] if st is not None else None


class ProcessRef:
    """One process this one started, named by a pidfd instead of its pid number. Once the process
    has exited and been reaped (by the event loop's child watcher, or by bwrap for the sandbox's
    init) its number is free, and a signal to the number can end an unrelated process that got it.

    The pidfd is opened right after the spawn and kept only when `is_ours(pid)`, asked after the
    pidfd pinned the number, confirms that the number still names the process we started (its
    environment carries our marker, its parent is our bwrap, ...): a process that was gone and
    reaped before that is never named. From then on kill() reaches our process or nobody. close()
    closes the pidfd exactly once. Not thread-safe: use it on the loop's thread."""

    def __init__(self, pid: int, is_ours: Callable[[int], bool]):
        self.pid = pid
        self._fd = -1
        try:
            fd = os.pidfd_open(pid)  # close-on-exec: no spawned process inherits it
        except OSError:
            return  # exited and reaped already: nothing of ours to signal
        try:
            ours = is_ours(pid)
        except BaseException:
            os.close(fd)
            raise
        if ours:
            self._fd = fd
        else:
            os.close(fd)

    @property
    def held(self) -> bool:
        """Whether the process was confirmed ours (and the pidfd is still open)."""
        return self._fd >= 0

    def signal(self, sig: int) -> bool:
        """Send `sig` to our process; False when it is reaped already (or was never confirmed)."""
        if self._fd < 0:
            return False
        try:
            signal.pidfd_send_signal(self._fd, sig)
            return True
        except ProcessLookupError:
            return False

    def kill(self) -> bool:
        return self.signal(signal.SIGKILL)

    def exists(self) -> bool:
        """Not reaped yet (alive or a zombie): while so, its pid number is still its own."""
        return self.signal(0)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def kill_if_started_at(pid: int, started: int | None) -> bool:
    """SIGKILL `pid` only if it is the process that started at `started` (start_time): the number
    is pinned with a pidfd before the start time is compared, so a reused pid is never hit."""
    if started is None:
        return False
    ref = ProcessRef(pid, lambda p: start_time(p) == started)
    try:
        return ref.kill()
    finally:
        ref.close()


async def run_to_end[T](aw: Awaitable[T]) -> T:
    """Await `aw` to its end even when the caller is cancelled meanwhile, once or many times, then
    re-raise the cancellation: for cleanup that must not stop half way (end processes, close fds,
    remove a folder). A bare `await` of cleanup stops at the first cancel; asyncio.shield stops
    waiting at it and leaves the rest running unwatched, with its caller gone."""
    task = asyncio.ensure_future(aw)
    cancel: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait([task])  # cancelling wait() leaves `task` running
        except asyncio.CancelledError as err:
            cancel = err
    if cancel is not None:
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation wins
        raise cancel
    return task.result()


def seal_inheritable_fds(keep: tuple[int, ...] = ()) -> int:
    """Make every fd of this process above 2, but `keep`, non-inheritable; returns how many were.

    Called on the loop's thread right before a sandbox process is spawned. asyncio's loop spawns
    with close_fds; uvloop ignores close_fds and hands a child every inheritable fd of the worker
    (measured: a directory fd opened inheritable in the parent, and fds the launching shell passed
    down, listed in the child's /proc/self/fd). A directory fd inside the sandbox escapes its root
    (`..` from it is not held to the new root). Python's own fds are never inheritable (PEP 446),
    so what this finds came from outside Python: the process's parent, or C libraries."""
    sealed = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2 or fd in keep:
            continue
        try:
            if os.get_inheritable(fd):
                os.set_inheritable(fd, False)
                sealed += 1
        except OSError:
            continue  # the listing's own fd, closed by now, or one closed meanwhile
    return sealed


def kill_exec_tree(
    ns: str, marker: bytes, *, rounds: int = 50, pause_s: float = 0.01, members: Members | None = None
) -> int:
    """SIGKILL an exec's tree, rescanning until it is empty (a process may fork while we scan).
    Returns how many processes were signalled. Blocking: call through asyncio.to_thread."""
    killed = 0
    for _ in range(rounds):
        tree = exec_tree(ns, marker, members)
        if not tree:
            break
        killed += sum(kill_in_namespace(pid, ns) for pid in tree)
        time.sleep(pause_s)
    return killed


def end_all_but(
    ns: str, keep: set[int], timeout_s: float, *, pause_s: float = 0.005, members: Members | None = None
) -> tuple[int, list[int]]:
    """SIGKILL every live process of pid namespace `ns` except the host pids in `keep`, rescanning
    until none is left (a process may fork between a scan and its kill; a killed one cannot fork).
    `members` lists them (default: pids_in_namespace(ns)). Returns (how many of the processes it
    found are gone, the pids still alive at the deadline). Blocking.

    Gone, not signalled: a process that dies of another's kill between a scan and its own (a tmux
    server whose last pane was killed, a pane whose server was) is already past pidfd_send_signal's
    namespace check, and counting only the signals made the count depend on that race (CI under
    load: 4 of a test's 5 long-lived processes)."""
    members = members or (lambda: pids_in_namespace(ns))
    deadline = time.monotonic() + timeout_s
    found: set[int] = set()
    while True:
        victims = [pid for pid in members() if pid not in keep]
        found.update(victims)
        if not victims:
            return len(found), []
        if time.monotonic() > deadline:
            return len(found - set(victims)), victims
        for pid in victims:
            kill_in_namespace(pid, ns)
        time.sleep(pause_s)


# wait_namespace_empty's poll
_EMPTY_POLL_S = 0.02


def wait_namespace_empty(
    ns: str,
    timeout_s: float,
    *,
    members: Members | None = None,
    init_reaped: Callable[[], bool] | None = None,
) -> bool:
    """True once no process is left in the pid namespace; `members` lists them (default:
    pids_in_namespace(ns)). `init_reaped()` says whether the namespace's init has been reaped
    (not merely exited): the kernel reaps a pid namespace's init last, after every other process
    of it ("pidns: guarantee that the pidns init will be the last pidns process reaped", Linux
    3.4; seen here: a killed init stayed unreaped while a zombie of its namespace, whose parent was
    a host process, was not reaped, and was reaped right after it), so from then on nothing is
    scanned. Blocking."""
    members = members or (lambda: pids_in_namespace(ns))

    def empty() -> bool:
        return (init_reaped is not None and init_reaped()) or not members()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if empty():
            return True
        time.sleep(_EMPTY_POLL_S)
    return empty()


def only_child(pid: int) -> int:
    """The one child of `pid` (the sandbox init's keeper, read right after it said ready)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        kids = []
    if len(kids) != 1:
        raise OSError(f"the sandbox init {pid} has children {kids}, expected one")
    return kids[0]


async def read_json(reader: asyncio.StreamReader) -> dict:
    """One JSON document from a stream (bwrap's --info-fd), however it is split into reads."""
    buf = b""
    while True:
        chunk = await reader.read(4096)
        if not chunk:
            raise ValueError(f"bwrap closed its info pipe before reporting ({buf[:200]!r})")
        buf += chunk
        try:
            return json.loads(buf)
        except json.JSONDecodeError:
            continue
