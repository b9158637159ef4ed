"""Host integrity of the local sandbox: each test tries one write or read the host must refuse
(agentrl/sandbox/local_isolation.py), and the sweep of sandboxes whose owner died."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from agentrl.config.schema import SandboxConfig
from agentrl.sandbox.base import SandboxError, SandboxSpec
from agentrl.sandbox.local import LocalSandboxProvider
from agentrl.sandbox.local_isolation import HOST_ID_BASE, SHM_BYTES

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
async def provider(tmp_path):
    p = LocalSandboxProvider(SandboxConfig(), run_id=f"iso{uuid.uuid4().hex[:6]}", root_dir=tmp_path / "boxes")
    yield p
    await p.aclose()


async def test_root_inside_is_an_unprivileged_uid_outside(provider):
    box = await provider.create(SandboxSpec())
    r = await box.exec("id -u; cat /proc/self/uid_map; echo x > /tmp/mine; sleep 30 & echo $!")
    uid, inside, outside, count, _pid = r.output.split()
    assert (uid, inside, outside, count) == ("0", "0", str(HOST_ID_BASE), "65536")
    assert (box.root / "tmp" / "mine").stat().st_uid == HOST_ID_BASE  # its files are not root's on the host
    host_uids = set()
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.readlink(f"/proc/{pid}/ns/pid") == box._ns:
                host_uids.add(Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0])
        except OSError:
            continue
    assert host_uids == {str(HOST_ID_BASE)}  # every process, the init included
    r = await box.exec("unshare -U true && echo nested || echo refused")
    assert r.output.strip().endswith("refused")  # no fresh user namespace with capabilities inside


def _host_file_only_its_owner_reads() -> str | None:
    """A file of the host's root in the sandbox's /etc or /usr binds that others may not read (mode 600)."""
    for top in ("/etc", "/usr"):
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_uid == 0 and st.st_size and not st.st_mode & 0o044:
                    if path not in ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-"):  # masked
                        return path
    return None


async def test_root_inside_has_a_container_roots_powers_over_its_own_files_only(provider):
    # What a task's tests (run as root after the agent) may rely on, as root in a Docker container does.
    box = await provider.create(SandboxSpec())
    r = await box.exec(
        "echo secret > /tmp/f && chmod 000 /tmp/f && cat /tmp/f; "
        "chmod 000 /tmp && echo y > /tmp/y && echo wrote-locked-dir; chmod 1777 /tmp; "
        "chown 1000:1000 /tmp/f && stat -c %u:%g /tmp/f; "
        "setpriv --reuid 1000 --regid 1000 --clear-groups id -u; "
        "python3 -c \"import socket; s = socket.socket(); s.bind(('127.0.0.1', 80)); print('port-80')\""
    )
    assert r.output.split() == ["secret", "wrote-locked-dir", "1000:1000", "1000", "port-80"], r.output
    # and nothing past it: no mount, no raw socket, no device node, the host's root-only files unreadable
    host_file = _host_file_only_its_owner_reads()
    r = await box.exec(
        "mkdir -p /tmp/m && { mount -t tmpfs x /tmp/m 2>/dev/null && echo mounted || echo mount-refused; }; "
        "python3 -c \"import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)\" "
        "2>/dev/null && echo raw || echo raw-refused; "
        "mknod /tmp/null c 1 3 2>/dev/null && echo mknod || echo mknod-refused; "
        + (f"cat {host_file} > /dev/null 2>&1 && echo read-host || echo host-refused" if host_file else "echo host-refused")
    )
    assert r.output.split() == ["mount-refused", "raw-refused", "mknod-refused", "host-refused"], (host_file, r.output)


async def test_kernel_knobs_are_read_only(provider):
    before = Path("/proc/sys/kernel/core_pattern").read_text()
    box = await provider.create(SandboxSpec())
    r = await box.exec(
        "echo '|/tmp/pwn' > /proc/sys/kernel/core_pattern || echo core-refused; "
        "echo 1 > /proc/sys/net/ipv4/ip_forward || echo net-refused; "
        "touch /sys/pwn || echo sys-refused; mkdir /sys/pwn || echo sys-dir-refused; "
        "{ [ ! -e /proc/sysrq-trigger ] || echo b > /proc/sysrq-trigger; } 2>/dev/null || echo sysrq-refused; true"
    )
    for word in ("core-refused", "net-refused", "sys-refused", "sys-dir-refused"):
        assert word in r.output, r.output
    assert "Read-only file system" in r.output
    assert Path("/proc/sys/kernel/core_pattern").read_text() == before


async def test_host_credentials_and_home_are_hidden(provider):
    box = await provider.create(SandboxSpec())
    present = [f for f in ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-") if os.path.exists(f)]
    assert present, "this host has no shadow files to hide"
    r = await box.exec(" ".join(f"echo {f}:$(wc -c < {f});" for f in present) + " ls -A /root | wc -l")
    lines = r.output.split()
    assert lines[:-1] == [f"{f}:0" for f in present]  # empty stand-ins, whatever the host holds
    assert lines[-1] == "0" and any(os.scandir("/root"))  # the host's /root is not the sandbox's
    r = await box.exec("echo x > /etc/shadow || echo refused")
    assert "refused" in r.output


@pytest.mark.parametrize("disk", ["ext4", "tmpfs"])
async def test_disk_quota_and_shm_limit(tmp_path, disk):
    p = LocalSandboxProvider(SandboxConfig(), run_id=f"q{disk}", root_dir=tmp_path, disk=disk)
    try:
        box = await p.create(SandboxSpec(disk_mb=32))
        # 4 x 10 MB: each file is under the 32 MB per-file rlimit, together they overflow the disk.
        r = await box.exec("df -m / | tail -1; for i in 1 2 3 4; do head -c 10M /dev/zero > /tmp/f$i || echo full; done")
        assert "full" in r.output and "No space left on device" in r.output, r.output
        assert int(r.output.split()[1]) <= 32  # df's size column, in MB
        shm_files = SHM_BYTES // (20 << 20) + 1  # 20 MB each, one more than fits
        r = await box.exec(f"for i in $(seq {shm_files}); do head -c 20M /dev/zero > /dev/shm/s$i || echo shm-full; done")
        assert "shm-full" in r.output and "No space left on device" in r.output, r.output
        assert shutil.disk_usage(tmp_path).free > 0  # (the host's disk is untouched by the sandbox's)
    finally:
        await p.aclose()


def _host_address() -> str | None:
    """A non-loopback address of this host (no packet is sent)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))
        addr = s.getsockname()[0]
        return None if addr.startswith("127.") else addr
    except OSError:
        return None
    finally:
        s.close()


async def test_network_reaches_out_but_not_the_hosts_loopback(tmp_path):
    p = LocalSandboxProvider(SandboxConfig(local_allow_network=True), run_id="net", root_dir=tmp_path)
    try:
        if shutil.which("slirp4netns") is None:
            with pytest.raises(SandboxError, match="slirp4netns"):
                await p.create(SandboxSpec(allow_network=True))
            pytest.skip("slirp4netns not installed: networked local sandboxes are refused (checked above)")
        addr = _host_address()
        servers = [await asyncio.start_server(lambda r, w: w.close(), host, 0) for host in ("127.0.0.1", addr) if host]
        ports = [s.sockets[0].getsockname()[1] for s in servers]
        box = await p.create(SandboxSpec(allow_network=True))
        probe = "timeout 3 bash -c 'exec 3<>/dev/tcp/{}/{}' 2>/dev/null && echo open || echo closed"
        r = await box.exec(probe.format("127.0.0.1", ports[0]), timeout_s=10)
        assert r.output.strip() == "closed"  # its own loopback, not the host's
        r = await box.exec(probe.format("10.0.2.2", ports[0]), timeout_s=10)
        assert r.output.strip() == "closed"  # slirp's alias for the host's loopback is disabled
        if addr:  # the way out works: the host's own non-loopback address is "outside"
            r = await box.exec(probe.format(addr, ports[1]), timeout_s=10)
            assert r.output.strip() == "open"
        r = await box.exec("cat /etc/resolv.conf; ls /sys/class/net 2>/dev/null; cat /proc/net/dev")
        assert "nameserver 10.0.2.3" in r.output and "tap0" in r.output
        for s in servers:
            s.close()
    finally:
        await p.aclose()


_ORPHAN = """
import asyncio, os, sys
from agentrl.config.schema import SandboxConfig
from agentrl.sandbox.base import SandboxSpec
from agentrl.sandbox.local import LocalSandboxProvider
async def main():
    box = await LocalSandboxProvider(SandboxConfig(), run_id="dead-run", root_dir=sys.argv[1]).create(SandboxSpec())
    await box.exec("sleep 1000 &")
    print(box.host_dir, flush=True)
    os.kill(os.getpid(), 9)  # a killed run: nothing closes the sandbox
asyncio.run(main())
"""


async def test_sweep_stale_removes_only_sandboxes_of_dead_owners(tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _ORPHAN, str(tmp_path), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    orphan = Path(stdout.decode().strip())
    assert proc.returncode == -9 and orphan.is_dir(), stderr.decode()
    live = LocalSandboxProvider(SandboxConfig(), run_id="live-run", root_dir=tmp_path)
    other = LocalSandboxProvider(SandboxConfig(), run_id="other-live-run", root_dir=tmp_path)
    try:
        mine, theirs = await live.create(SandboxSpec()), await other.create(SandboxSpec())
        assert await live.sweep_stale() == 1
        assert not orphan.exists() and not orphan.parent.exists()  # the dead run's folder is gone
        assert mine.host_dir.is_dir() and theirs.host_dir.is_dir()  # live owners keep theirs
        assert (await theirs.exec("echo alive")).output == "alive\n"
        assert await other.sweep_stale() == 0
    finally:
        await live.aclose()
        await other.aclose()
