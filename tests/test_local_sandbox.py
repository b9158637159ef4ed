"""The local (bubblewrap) sandbox: isolation, limits, timeouts, output cap, cleanup."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

from agentrl.config.schema import SandboxConfig
from agentrl.sandbox.base import Sandbox, SandboxError, SandboxSpec
from agentrl.sandbox.dockerfile import DockerfileError, parse_dockerfile
from agentrl.sandbox.local import LocalSandboxProvider
from agentrl.sandbox.local_procs import CappedOutput, pids_in_namespace

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


@pytest.fixture
async def provider(tmp_path):
    p = LocalSandboxProvider(SandboxConfig(), run_id=f"t{uuid.uuid4().hex[:8]}", root_dir=tmp_path / "boxes")
    yield p
    await p.aclose()


@pytest.fixture
async def box(provider):
    return await provider.create(SandboxSpec())


async def test_exec_basics_and_clean_environment(box, monkeypatch):
    monkeypatch.setenv("DAYTONA_API_KEY", "host-secret-value")
    assert isinstance(box, Sandbox)
    res = await box.exec("pwd; id -u; echo ${DAYTONA_API_KEY:-unset}; exit 3")
    assert res.exit_code == 3 and not res.timed_out
    assert res.output.split() == ["/app", "0", "unset"]
    res = await box.exec("echo $X; pwd", cwd="/tmp", env={"X": "given"})
    assert res.output.split() == ["given", "/tmp"]
    res = await box.exec("echo out; echo err >&2")
    assert res.output == "out\nerr\n"


async def test_no_network(box):
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        probe = f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected || echo refused"
        res = await box.exec(probe, timeout_s=10)
        assert "refused" in res.output and "connected" not in res.output
        res = await box.exec(
            "exec 3<>/dev/tcp/1.1.1.1/53 && echo connected || echo unreachable", timeout_s=10
        )
        assert "unreachable" in res.output
        res = await box.exec("ls /sys/class/net 2>/dev/null || cat /proc/net/dev")
        assert "eth0" not in res.output
    finally:
        server.close()


async def test_cannot_write_outside_root(box, tmp_path):
    name = f"agentrl-probe-{uuid.uuid4().hex}"
    secret = tmp_path / "host-only.txt"
    secret.write_text("host data")
    res = await box.exec(
        f"echo x > /tmp/{name} && echo tmp-ok; touch /usr/{name} || echo usr-ro; touch /etc/{name} || echo etc-ro; "
        f"cat {secret} || echo host-invisible"
    )
    assert "tmp-ok" in res.output and "usr-ro" in res.output and "etc-ro" in res.output
    assert "host-invisible" in res.output and "host data" not in res.output
    assert not Path(f"/tmp/{name}").exists() and not Path(f"/usr/{name}").exists()
    assert (box.root / "tmp" / name).exists()  # it went to the sandbox's own /tmp
    res = await box.exec("mount -o remount,rw,bind /usr && echo remounted || echo denied")
    assert "denied" in res.output
    res = await box.exec("cat /etc/shadow; echo end")
    assert "root:" not in res.output and res.output.endswith("end\n")  # host hashes hidden


async def test_pid_namespace(box):
    res = await box.exec("ls /proc | grep -c '^[0-9]'; ps -eo comm")
    count, *names = res.output.split()
    assert int(count) < 10, res.output
    assert "pytest" not in names and "python" not in " ".join(names)


async def test_timeout_kills_the_whole_tree(box):
    await box.exec("cp /usr/bin/sleep /tmp/keeper && tmux new-session -d -s keep '/tmp/keeper 1000'")
    await box.exec("cp /usr/bin/sleep /tmp/runaway")
    start = time.monotonic()
    res = await box.exec(
        "/tmp/runaway 1000 & setsid /tmp/runaway 1001 & echo begun; /tmp/runaway 1002", timeout_s=1
    )
    assert res.timed_out and res.exit_code == -1 and "begun" in res.output
    assert time.monotonic() - start < 8
    left = await box.exec("ps -eo args")
    assert "/tmp/runaway" not in left.output
    assert "/tmp/keeper 1000" in left.output  # another exec's processes are left alone


async def test_output_cap_with_huge_output(box):
    start = time.monotonic()
    res = await box.exec("yes | head -c 200M; echo tail-marker", max_output_bytes=4096, timeout_s=60)
    elapsed = time.monotonic() - start
    assert res.exit_code == 0 and res.truncated and not res.timed_out
    assert res.output.startswith("y\ny\n") and res.output.endswith("tail-marker\n")
    assert len(res.output.encode()) < 4096 + 100
    assert "bytes of output omitted" in res.output
    assert elapsed < 20, elapsed
    res = await box.exec("yes", max_output_bytes=1000, timeout_s=1)  # endless: timeout, still capped
    assert res.timed_out and res.truncated and len(res.output) < 1100


def test_capped_output_keeps_head_and_tail():
    async def run():
        cap = CappedOutput(10)
        for chunk in (b"0123", b"4567", b"89abcdef", b"ghij"):
            cap.data_received(chunk)
        return cap

    cap = asyncio.run(run())
    assert cap.total == 20 and cap.truncated
    assert bytes(cap.head) == b"01234" and bytes(cap.tail) == b"fghij"


async def test_close_kills_every_process_and_removes_files(provider):
    box = await provider.create(SandboxSpec())
    await box.exec("tmux new-session -d -s s 'sleep 1000'; (setsid nohup sleep 1001 >/dev/null 2>&1 &)")
    ns = box._ns
    assert len(pids_in_namespace(ns)) >= 4
    await box.close()
    assert pids_in_namespace(ns) == []
    assert not box.host_dir.exists()
    await box.close()  # idempotent
    with pytest.raises(SandboxError) as err:
        await box.exec("true")
    assert err.value.kind == "closed"


async def test_rlimits(tmp_path):
    cfg = SandboxConfig(local_memory_mb=256, local_cpu_seconds=1)
    p = LocalSandboxProvider(cfg, run_id="limits", root_dir=tmp_path)
    try:
        box = await p.create(SandboxSpec(memory_mb=256, disk_mb=1))
        res = await box.exec("python3 -c 'b = bytearray(16 << 20); print(\"small ok\")'")
        assert "small ok" in res.output
        res = await box.exec("python3 -c 'b = bytearray(512 << 20)'")
        assert res.exit_code != 0 and "MemoryError" in res.output
        res = await box.exec("head -c 2M /dev/zero > /tmp/big || echo too-large")
        assert "too-large" in res.output
        start = time.monotonic()
        res = await box.exec("while :; do :; done", timeout_s=20)
        assert not res.timed_out and res.exit_code in (128 + 24, 128 + 9)  # SIGXCPU or SIGKILL
        assert time.monotonic() - start < 15
    finally:
        await p.aclose()


async def test_dockerfile_workdir_env_copy(provider, tmp_path):
    env_dir = tmp_path / "environment"
    (env_dir / "data").mkdir(parents=True)
    (env_dir / "data" / "nums.txt").write_text("1\n2\n")
    (env_dir / "run.sh").write_text("echo run\n")
    (env_dir / "Dockerfile").write_text(
        "FROM ubuntu:24.04\nRUN apt-get update && \\\n    apt-get install -y jq\nWORKDIR /srv\nWORKDIR app\n"
        'ENV GREETING="hello world" PATH=/opt/tools:$PATH\nCOPY data/ ./data/\nCOPY --chmod=755 run.sh /usr/local/bin/\n'
        "COPY --chmod=755 run.sh /opt/bin/\n"
    )
    box = await provider.create(SandboxSpec(files_dir=str(env_dir)))
    assert box.workdir == "/srv/app"
    assert [u.split(":")[0] for u in box.unsupported] == ["line 1", "line 2", "line 8"]
    assert "/usr/local/bin/" in box.unsupported[2]
    res = await box.exec(
        'pwd; echo "$GREETING"; echo $PATH; cat data/nums.txt; test -x /opt/bin/run.sh && echo exe'
    )
    lines = res.output.splitlines()
    assert lines[0] == "/srv/app" and lines[1] == "hello world"
    assert lines[2].startswith("/opt/tools:/usr/local/sbin") and lines[3:] == ["1", "2", "exe"]


def test_dockerfile_errors_name_the_line():
    with pytest.raises(DockerfileError, match="Dockerfile:2"):
        parse_dockerfile("FROM x\nENV =broken\n")
    plan = parse_dockerfile("FROM a AS b\nCOPY --from=b /x /y\nADD https://example.com/f /f\nUSER nobody\n")
    assert len(plan.unsupported) == 4 and plan.copies == []


async def test_upload_download_stay_inside(box, tmp_path):
    await box.upload(b"bin\x00ary\xff", "/tests/sub/f.bin")
    assert await box.download("/tests/sub/f.bin") == b"bin\x00ary\xff"
    await box.upload(b"rel", "rel.txt")
    assert (await box.exec("cat /app/rel.txt")).output == "rel"
    with pytest.raises(FileNotFoundError):
        await box.download("/nope")
    host_file = tmp_path / "victim.txt"
    host_file.write_text("untouched")
    await box.exec(f"mkdir -p /logs && ln -s {host_file} /logs/link")  # a planted link to a host path
    with pytest.raises(FileNotFoundError):
        await box.download("/logs/link")
    await box.upload(b"overwrite", "/logs/link")  # replaces the link, never follows it
    assert host_file.read_text() == "untouched"
    assert (await box.exec("test -L /logs/link || cat /logs/link")).output == "overwrite"
    with pytest.raises(SandboxError):
        await box.upload(b"x", "/usr/evil")
    assert not Path("/usr/evil").exists()


async def test_cancelled_exec_leaves_no_process(box):
    await box.exec("cp /usr/bin/sleep /tmp/cancelme")
    task = asyncio.create_task(box.exec("/tmp/cancelme 1000", timeout_s=60))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "/tmp/cancelme" not in (await box.exec("ps -eo args")).output


async def test_sweep_removes_sandboxes_left_by_another_process(tmp_path):
    owner = LocalSandboxProvider(SandboxConfig(), run_id="sweep", root_dir=tmp_path)
    janitor = LocalSandboxProvider(SandboxConfig(), run_id="sweep", root_dir=tmp_path)
    box = await owner.create(SandboxSpec())
    ns = box._ns
    await LocalSandboxProvider(SandboxConfig(), run_id="sweep", root_dir=tmp_path).aclose()
    assert (await box.exec("echo alive")).output == "alive\n"  # aclose leaves other workers' boxes
    assert await janitor.sweep() == 1
    assert not box.host_dir.exists()
    for _ in range(100):
        if not pids_in_namespace(ns):
            break
        await asyncio.sleep(0.05)
    assert pids_in_namespace(ns) == []
    await owner.aclose()
    assert not owner.base_dir.exists()


async def test_many_sandboxes_are_independent(provider):
    a, b = await asyncio.gather(provider.create(SandboxSpec()), provider.create(SandboxSpec()))
    await a.exec("echo a > /app/who")
    assert (await b.exec("cat /app/who 2>/dev/null || echo none")).output.strip() == "none"
    assert os.path.exists(a.root / "app" / "who")


def test_host_side_tools_may_come_from_path_but_in_sandbox_tools_may_not(tmp_path, monkeypatch):
    # The GPU machine has no bubblewrap package: its .deb is unpacked with dpkg -x and put on PATH.
    # bwrap runs on the host, so that copy is used; setpriv runs inside the sandbox, whose /usr is
    # the host's, so a PATH-only copy would not exist in there and is refused.
    import agentrl.sandbox.local as local
    from agentrl.sandbox.base import SandboxError

    for name in ("bwrap", "setpriv"):
        f = tmp_path / name
        f.write_text("#!/bin/sh\n")
        f.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    real_access = local.os.access
    monkeypatch.setattr(local.os, "access", lambda p, mode: (not str(p).startswith(("/usr/", "/bin/", "/sbin/")))
                        and real_access(p, mode))
    assert local._tool("bwrap") == str(tmp_path / "bwrap")
    with pytest.raises(SandboxError, match="setpriv"):
        local._tool("setpriv")


async def test_a_killed_init_is_seen_at_once_not_when_the_loop_reaps_bwrap(box):
    # CI: the init was SIGKILLed mid-command, the command returned, and the episode went on to be
    # scored 0.0 because bwrap's returncode was still unset. The init's /proc entry decides.
    import signal

    assert box.alive()
    os.kill(box._init_pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{box._init_pid}/stat") and time.monotonic() < deadline:
        with open(f"/proc/{box._init_pid}/stat", "rb") as f:  # a zombie counts as dead
            if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                break
        time.sleep(0.01)  # blocking on purpose: the event loop never runs, so bwrap is not reaped
    assert not box.alive()
    with pytest.raises(SandboxError) as e:
        await box.kill_all()
    assert e.value.kind == "lost"


async def test_a_create_cancelled_while_its_folder_is_built_cleans_up_after_the_build(provider, monkeypatch):
    import threading

    from agentrl.sandbox.local import LocalSandboxProvider as P

    building, release, seen = threading.Event(), threading.Event(), {}
    real = P._build_stage

    def slow_build(box, plan, spec):
        building.set()
        release.wait(10)
        seen["fd_open_after_cancel"] = os.fstat(box.owner_lock_fd) is not None  # raises if closed under us
        real(box, plan, spec)

    monkeypatch.setattr(P, "_build_stage", staticmethod(slow_build))
    before = set(os.listdir("/proc/self/fd"))
    task = asyncio.ensure_future(provider.create(SandboxSpec()))
    await asyncio.to_thread(building.wait, 10)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # the create waits for the thread instead of pulling the folder from under it
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen["fd_open_after_cancel"]
    leaked = {f: os.readlink(f"/proc/self/fd/{f}") for f in set(os.listdir("/proc/self/fd")) - before}
    assert list(provider.base_dir.iterdir()) == [] and not leaked, leaked  # the holder's pipe included
