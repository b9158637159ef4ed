"""The Sandbox protocol's contract, run against both real backends: the local one (bubblewrap) and
Daytona (the real SDK against the local stand-in of the Daytona cloud, tests/doubles/).

Each test states one clause of agentrl/sandbox/base.py: exec results, timeouts as results, files
in and out, kill_all (every process the agent started ends, tmux servers and setsid daemons
included, the sandbox and its files stay usable), and a closed sandbox refusing work."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from agentrl.config.schema import SandboxConfig
from agentrl.sandbox.base import NUL_EXIT_CODE, Sandbox, SandboxError, SandboxSpec

KEY = "sk-dtn-CONFORMANCE-7e1d"
# Background processes an agent can leave behind, each a different way out of its exec: a setsid
# daemon, a nohup'd double fork, a tmux server, and a loop that keeps rewriting a file.
LEFTOVERS = (
    "(setsid nohup sleep 1001 >/dev/null 2>&1 &); "
    "( (sleep 1002 >/dev/null 2>&1 &) & ); "
    "tmux -L {sock} new-session -d 'sleep 1003'; "
    "(nohup sh -c 'while :; do echo forged > writer.out; sleep 0.01; done' >/dev/null 2>&1 &); "
    "sleep 0.3; echo started"
)
PROCESS_LIST = "for p in /proc/[0-9]*; do tr '\\000' ' ' < $p/cmdline 2>/dev/null; echo; done"


@pytest.fixture(params=["local", "daytona"])
async def backend(request, tmp_path, monkeypatch):
    """(provider, spec) of one backend; closed afterwards."""
    if request.param == "local":
        if shutil.which("bwrap") is None:
            pytest.skip("bubblewrap not installed")
        from agentrl.sandbox.local import LocalSandboxProvider

        p = LocalSandboxProvider(SandboxConfig(), run_id=f"conf{uuid.uuid4().hex[:6]}", root_dir=tmp_path / "b")
        yield p, SandboxSpec()
        await p.aclose()
        return
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("the stand-in gives each sandbox a pid namespace only as root")
    from agentrl.sandbox.daytona import DaytonaSandboxProvider
    from tests.doubles.daytona_standin import start_standin

    monkeypatch.setenv("DAYTONA_API_KEY", KEY)
    monkeypatch.setenv("DAYTONA_USE_DEPRECATED_POLLING", "true")
    url, handle = start_standin(api_key=KEY)
    p = DaytonaSandboxProvider(SandboxConfig(backend="daytona", daytona_api_url=url), f"conf-{uuid.uuid4().hex[:6]}")
    yield p, SandboxSpec(image="ubuntu:22.04", workdir=".")
    await p.aclose()
    handle.stop()


@pytest.fixture
async def box(backend):
    provider, spec = backend
    sb = await provider.create(spec)
    yield sb
    await sb.close()


async def test_exec_files_and_timeouts(box):
    assert isinstance(box, Sandbox)
    r = await box.exec('echo "$GREETING"; echo err >&2; exit 3', env={"GREETING": "hi there"})
    assert (r.exit_code, r.output, r.timed_out) == (3, "hi there\nerr\n", False)
    await box.upload(b"\x00bytes\xff", "sub/f.bin")
    assert await box.download("sub/f.bin") == b"\x00bytes\xff"
    with pytest.raises(FileNotFoundError):
        await box.download("no/such/file")
    r = await box.exec("echo begun; sleep 30", timeout_s=1)
    assert r.timed_out and r.exit_code == -1 and r.output == "begun\n"
    # Model output can decode to a NUL byte, which no shell can receive: the command's own failure.
    for cmd, env in (("echo a\x00b > nul.txt", None), ("echo hi", {"X": "a\x00b"})):
        r = await box.exec(cmd, env=env)
        assert r.exit_code == NUL_EXIT_CODE and "NUL byte" in r.output and not r.timed_out
    assert (await box.exec("ls nul.txt")).exit_code != 0  # nothing ran


async def test_kill_all_ends_every_agent_process_and_keeps_the_sandbox(box):
    sock = f"conf-{uuid.uuid4().hex[:8]}"
    await box.upload(b"kept\n", "kept.txt")
    r = await box.exec(LEFTOVERS.format(sock=sock), timeout_s=20)
    assert r.output.strip().endswith("started"), r.output
    before = (await box.exec(PROCESS_LIST)).output
    assert "sleep 1001" in before and "sleep 1002" in before and "sleep 1003" in before
    ended = await box.kill_all()
    assert ended >= 5, ended  # sleep x3, the tmux server, the writer loop (and its sleeps)
    after = (await box.exec(PROCESS_LIST)).output
    assert not any(m in after for m in ("sleep 100", "tmux", "writer.out")), after
    r = await box.exec("rm -f writer.out; sleep 0.3; test -e writer.out && echo rewritten || echo quiet")
    assert r.output.strip() == "quiet"  # the writer is gone, not merely paused
    assert (await box.exec("cat kept.txt")).output == "kept\n"  # files stay
    assert await box.kill_all() == 0  # nothing left to end
    await box.exec(f"rm -f /tmp/tmux-*/{sock} 2>/dev/null; true")


async def test_closed_sandbox_refuses_work(backend):
    provider, spec = backend
    sb = await provider.create(spec)
    await sb.close()
    await sb.close()  # idempotent
    for call in (sb.exec("true"), sb.kill_all()):
        with pytest.raises(SandboxError) as err:
            await call
        assert err.value.kind == "closed"


def test_daytona_kill_script_refuses_to_run_in_the_hosts_pid_namespace():
    """Run where it is not a container's, "every process but pid 1" would be the whole machine."""
    import subprocess

    from agentrl.sandbox.daytona_exec import KILL_ALL_SCRIPT, kill_all_result

    stat = Path("/proc/2/stat")
    if not stat.exists() or "(kthreadd)" not in stat.read_text():
        pytest.skip("this test runs in a container's pid namespace itself")
    r = subprocess.run(["sh", "-c", KILL_ALL_SCRIPT], capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 4 and "host's pid namespace" in r.stdout
    with pytest.raises(SandboxError) as err:
        kill_all_result(r.returncode, r.stdout, "sb-1")
    assert err.value.kind == "kill"
