"""Host integrity of the local sandbox: who the agent is on the host, what it can write, read and
reach. Pure mechanics (argv, uid maps, disk images, masks, the network helper); local_box.py
wires them into one sandbox's start.

- **Never the host's root.** Every process of a sandbox runs in a user namespace that maps uids and
  gids 0..65535 inside to HOST_ID_BASE.. outside: root inside is an unprivileged host uid, so a
  file or sysctl the host's root owns is "other" to it (host /proc/sys/kernel/core_pattern, the
  shadow files, /dev nodes). The provider writes the maps itself (root may map any range; no
  newuidmap needed) into a short-lived holder process, and bubblewrap then runs inside that
  namespace as its root. A single-uid map would break `chown` to other uids (tar, dpkg); the
  65536-id range keeps those working the way they work in a container. Commands keep only
  ROOT_CAPS (setpriv's bounding set), the file and user capabilities Docker gives a container's
  root: chown, permission checks that root passes whatever a file's mode, setuid to another uid
  of the sandbox, ports below 1024. Each is checked by the kernel against the sandbox's own user
  namespace, so it reaches only inodes whose owner is one of the sandbox's 65536 ids (a file the
  host's root owns in the read-only /usr or /etc binds is "nobody" inside and stays unreadable at
  mode 600) and only the sandbox's own processes and network namespace. No mount, no raw sockets,
  no device nodes. Package installs into /usr cannot work locally anyway (the host's, read-only).
- **No nested user namespaces**: user.max_user_namespaces is 0 inside, so the agent cannot get a
  fresh namespace with capabilities (the kernel's largest attack surface for unprivileged code).
- **Read-only kernel knobs**: /proc/sys (and /proc/sysrq-trigger where the host has one) are bound
  read-only over the sandbox's own procfs; /sys is an empty read-only tmpfs (a bind of the host's
  would show the host's network devices).
- **Masked credentials**: MASKED_FILES and MASKED_DIRS of the host's /etc that exist are covered by
  empty read-only stand-ins (the bind of /etc is the only host folder besides /usr).
- **A real disk quota**: the writable root is an ext4 image of `disk_mb` (sparse on the host's
  disk, loop-mounted in a private mount namespace that dies with the sandbox, so a crash leaves
  no mount and no loop device behind), or, where the host has no loop devices, a tmpfs of that
  size (then it is RAM). /dev/shm is a tmpfs of SHM_BYTES.
- **Network** (a task that allows it, with sandbox.local_allow_network on): the sandbox keeps its
  own network namespace with its own loopback, and slirp4netns (user-mode TCP/IP, no host
  configuration) connects it to the outside with `--disable-host-loopback`, so the host's
  127.0.0.0/8 services (the Ray dashboard, the engines) are unreachable while the internet is
  not. Why not the host's network plus a firewall rule: that needs iptables/nft and changes
  host-wide state from a training process; a veth pair needs NAT rules for the same reason.
  Services bound to the host's other addresses stay as reachable as from any machine on that
  network (cluster listeners use Ray's token authentication).
"""

from __future__ import annotations

import glob
import os
import select
import shutil
import stat
import subprocess
import time
from pathlib import Path

# What a command's root keeps (the rest of Docker's default set is left out: mknod, net_raw, sys_chroot,
# setpcap, setfcap, audit_write). Without them, root here failed where a container's root works: reading a
# file the agent made mode 000, `chmod 000 /tmp` then writing there, `chown user f`, `su user`, a server on
# port 80 (tbench2 tasks' tests run as root, after the agent's commands).
ROOT_CAPS = ("chown", "dac_override", "fowner", "fsetid", "kill", "setgid", "setuid", "net_bind_service")
HOST_ID_BASE = 1_000_000_000  # far above the usual /etc/subuid ranges (100000 + 65536 k)
ID_COUNT = 65536
SHM_BYTES = 64 << 20  # Docker's default /dev/shm size
# ext4 needs a few MB of metadata; smaller requests get this much (the per-file rlimit still
# enforces the task's size on any one file).
MIN_DISK_MB = 16
MASKED_FILES = (
    "/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers",
    "/etc/security/opasswd", "/etc/krb5.keytab", "/etc/ssh/ssh_host_*_key",
)  # fmt: skip
MASKED_DIRS = ("/etc/ssl/private", "/etc/sudoers.d", "/etc/ssh/keys")
SLIRP_NAMESERVER = "10.0.2.3"  # slirp4netns' built-in DNS forwarder
SLIRP_MTU = 65520  # the largest slirp4netns takes: fewer, bigger packets through user-mode TCP
# bwrap's environment carries a fresh marker under this name: it proves, right after the spawn and
# before any sandbox exists, that the pid still names that bwrap (local_procs.ProcessRef). The
# sandbox's pid 1 (a fork of bwrap) shows it in /proc/1/environ; knowing it gains nothing then.
BWRAP_MARKER_ENV = "AGENTRL_BWRAP_ID"
_HOLDER_TIMEOUT_S = 5.0
_SLIRP_READY_TIMEOUT_S = 10.0

# Runs as the host's root in a fresh private mount namespace: mount the sandbox's writable root
# (the ext4 image, or a tmpfs filled from the stage) on the shared mountpoint (each sandbox sees
# only its own mount there), then enter the sandbox's user namespace as its root, forbid nested
# user namespaces (from there, with every capability of it: the holder lost its own at exec,
# before the maps existed), and exec bwrap. Each command is an exec on the create path (~2-5 ms
# apiece), so ext4's empty lost+found stays. $1 mountpoint, $2 image or stage, $3 "ext4" |
# "tmpfs", $4 size in MB, $5 user namespace path; then the bwrap argv.
LAUNCH_SCRIPT = r"""set -e
root=$1 src=$2 kind=$3 mb=$4 userns=$5
shift 5
if [ "$kind" = ext4 ]; then
  mount -o loop,noinit_itable,nosuid,nodev -- "$src" "$root"
else
  mount -t tmpfs -o "size=${mb}m,mode=0755,uid=@ID@,gid=@ID@,nosuid,nodev" tmpfs "$root"
  cp -a -- "$src"/. "$root"/
fi
exec nsenter --user="$userns" --setuid 0 --setgid 0 -- /bin/sh -c \
  'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"' sh "$@"
""".replace("@ID@", str(HOST_ID_BASE))


def shared_mountpoint() -> Path:
    """The empty folder every sandbox mounts its disk on, each in its private mount namespace (so
    they never see each other's). bwrap resolves its sources as the sandbox's uid, which may not
    enter the provider's folder (a 0700 parent), so the mountpoint is a fixed root-owned folder
    under /run (or /tmp): checked to be a real root-owned directory, never a planted link."""
    base = Path("/run") if os.path.isdir("/run") and not os.path.islink("/run") else Path("/tmp")
    mp = base / ".agentrl-sandbox-root"
    try:
        mp.mkdir(mode=0o755)
    except FileExistsError:
        pass
    st = os.lstat(mp)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise OSError(f"{mp} must be a directory owned by root and writable only by it; remove it")
    return mp


def disk_backend() -> str:
    """"ext4" where loop devices and mkfs.ext4 exist, else "tmpfs"."""
    if os.path.exists("/dev/loop-control") and shutil.which("mkfs.ext4", path="/usr/sbin:/sbin:/usr/bin"):
        return "ext4"
    return "tmpfs"


def chown_tree(root: Path) -> None:
    """Give a freshly built stage to the sandbox's root (HOST_ID_BASE), links included."""
    os.lchown(root, HOST_ID_BASE, HOST_ID_BASE)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), HOST_ID_BASE, HOST_ID_BASE)


def make_disk_image(stage: Path, image: Path, size_mb: int) -> None:
    """A sparse ext4 image of `size_mb` holding the stage's files (mke2fs -d copies them with their
    owners). No journal (a sandbox's disk never outlives a crash), no reserved blocks, inode tables
    initialised lazily and never in the background (mount option noinit_itable): ~10 ms for 10 GB."""
    with open(image, "wb") as f:
        f.truncate(max(size_mb, MIN_DISK_MB) << 20)
    try:
        subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-O", "^has_journal,^resize_inode", "-m", "0", "-E",
             f"lazy_itable_init=1,nodiscard,root_owner={HOST_ID_BASE}:{HOST_ID_BASE}", "-d", str(stage), str(image)],
            check=True, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/sbin:/sbin:/usr/bin:/bin"},
        )  # fmt: skip
    except subprocess.CalledProcessError as err:
        raise OSError(f"mkfs.ext4 of the {size_mb} MB disk failed: {err.stderr.strip()[-300:]}") from None
    except subprocess.TimeoutExpired:
        raise OSError(f"mkfs.ext4 of the {size_mb} MB disk took over 60 s") from None


def new_user_namespace(unshare: str, cat: str) -> tuple[subprocess.Popen, str]:
    """A process holding a new user namespace whose ids 0..ID_COUNT-1 map to HOST_ID_BASE..;
    returns it and the namespace's path. It exits when its stdin closes (or this process dies):
    close it once the sandbox's own processes have entered the namespace."""
    holder = subprocess.Popen(
        [unshare, "--user", "--", cat],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    mine = os.readlink("/proc/self/ns/user")
    deadline = time.monotonic() + _HOLDER_TIMEOUT_S
    try:
        while os.readlink(f"/proc/{holder.pid}/ns/user") == mine:  # until unshare(2) has run
            if holder.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"unshare --user did not create a user namespace (exit {holder.returncode})")
            time.sleep(0.0002)
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{holder.pid}/{name}", "w") as f:
                f.write(f"0 {HOST_ID_BASE} {ID_COUNT}\n")
    except BaseException:
        holder.kill()
        holder.wait()
        raise
    return holder, f"/proc/{holder.pid}/ns/user"


def masks() -> tuple[list[str], list[str]]:
    """(files, dirs) of the host's credential paths that exist and must be covered."""
    files = sorted({p for pat in MASKED_FILES for p in glob.glob(pat) if os.path.isfile(p)})
    dirs = [d for d in MASKED_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    return files, dirs


def mask_args(files: list[str], dirs: list[str], data_fd) -> list[str]:
    """bwrap arguments covering `files` with empty read-only files (one fresh fd each, from
    `data_fd()`: bwrap copies and closes it) and `dirs` with empty read-only tmpfs."""
    args: list[str] = []
    for f in files:
        args += ["--perms", "0444", "--ro-bind-data", str(data_fd(b"")), f]
    for d in dirs:
        args += ["--perms", "0555", "--size", "4096", "--tmpfs", d, "--remount-ro", d]
    return args


def kernel_args() -> list[str]:
    """bwrap arguments making the kernel's knobs read-only: /proc/sys, /proc/sysrq-trigger, /sys."""
    return [
        "--ro-bind", "/proc/sys", "/proc/sys", "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger",
        "--perms", "0555", "--size", "4096", "--tmpfs", "/sys", "--remount-ro", "/sys",
        "--perms", "1777", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm",
    ]  # fmt: skip


def bwrap_argv(bwrap: str, bash: str, mountpoint: Path, allow_network: bool, info_fd: int, data_fd) -> list[str]:
    """bubblewrap's argv. It runs as the root of the sandbox's user namespace, so the namespaces it
    makes belong to that namespace; `mountpoint` holds this sandbox's disk (LAUNCH_SCRIPT)."""
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--bind", str(mountpoint), "/"]  # fmt: skip
    for name in ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / name
        if host.is_dir() and not host.is_symlink():
            argv += ["--ro-bind", str(host), f"/{name}"]
    argv += ["--proc", "/proc", "--dev", "/dev", *kernel_args(), *mask_args(*masks(), data_fd)]
    if allow_network:  # slirp4netns' DNS forwarder; the host's resolver may be on its loopback
        argv += ["--ro-bind-data", str(data_fd(f"nameserver {SLIRP_NAMESERVER}\n".encode())), "/etc/resolv.conf"]
    argv += ["--hostname", "sandbox", "--chdir", "/", "--info-fd", str(info_fd), "--",
             bash, "-c", "echo ready; exec sleep infinity"]  # fmt: skip
    return argv


def memfd_with(data: bytes) -> int:
    """A close-on-exec fd at offset 0 holding `data` (bwrap's --*-data options read one to EOF):
    only the bwrap it is passed to (pass_fds) gets it. Inheritable, it went into every process
    the loop started meanwhile: uvloop, Ray's loop where installed, implements no close_fds."""
    fd = os.memfd_create("agentrl-bwrap-data", os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class SlirpNetwork:
    """slirp4netns connecting one sandbox's network namespace to the outside. It exits when
    `stop()` closes its exit pipe, and by itself if this process dies (the pipe closes then too)."""

    def __init__(self, slirp: str, netns: str, log_path: Path):
        """`netns`: the path of the sandbox's network namespace (a /proc/PID/ns/net entry)."""
        ready_r, ready_w = os.pipe()
        self._exit_r, self._exit_w = os.pipe()
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            self.proc = subprocess.Popen(
                [slirp, "--configure", f"--mtu={SLIRP_MTU}", "--disable-host-loopback", f"--ready-fd={ready_w}",
                 f"--exit-fd={self._exit_r}", "--netns-type=path", netns, "tap0"],
                pass_fds=(ready_w, self._exit_r), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                env={"PATH": "/usr/bin:/bin"},
            )  # fmt: skip
        finally:
            os.close(ready_w)
            os.close(self._exit_r)
            os.close(log)
        try:
            ready = _read_with_timeout(ready_r, _SLIRP_READY_TIMEOUT_S)
        finally:
            os.close(ready_r)
        if ready != b"1":
            self.stop()
            detail = log_path.read_text(errors="replace").strip()[-500:] if log_path.exists() else ""
            raise OSError(f"slirp4netns did not configure the network: {detail or 'no output'}")

    def stop(self) -> None:
        if self._exit_w >= 0:
            os.close(self._exit_w)
            self._exit_w = -1
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _read_with_timeout(fd: int, timeout_s: float) -> bytes:
    """Up to 16 bytes from `fd`, or b"" when nothing came within `timeout_s`. poll, not select:
    select refuses fds >= 1024 (FD_SETSIZE), which a busy worker's fds reach."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return os.read(fd, 16) if poller.poll(max(0, int(timeout_s * 1000))) else b""
