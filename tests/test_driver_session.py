"""The launcher's driver session (agentrl/cluster/driver_session.py): a SIGTERM to the launcher's whole
process group reaches the driver once, through the parent, and never its own session directly."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The "driver": records its pid and session, counts the SIGTERMs it gets, and 1.5 s after the first
# one exits with 10 + count (so the parent's exit code says how many arrived).
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    from agentrl.cluster.driver_session import shield_driver
    out = sys.argv[1]
    forked = shield_driver()
    got = []
    signal.signal(signal.SIGTERM, lambda *_: got.append(time.monotonic()))
    with open(out + ".tmp", "w") as f:
        f.write(f"{{os.getpid()}} {{os.getsid(0)}} {{int(forked)}}")
    os.replace(out + ".tmp", out)
    mode = sys.argv[2] if len(sys.argv) > 2 else ""
    if mode == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if got and time.monotonic() - got[0] > 1.5:
            if mode == "orphan":
                open(out + ".orphan", "w").write(str(len(got)))
            os._exit(10 + len(got))
        time.sleep(0.02)
    os._exit(99)
""")


def _start(tmp_path, *mode, env=None):
    script = tmp_path / "driver.py"
    script.write_text(CHILD.format(root=str(ROOT)))
    ready = tmp_path / "ready"
    p = subprocess.Popen([sys.executable, str(script), str(ready), *mode], start_new_session=True,
                         env={**os.environ, **(env or {})})
    deadline = time.time() + 20
    while not ready.exists():
        assert time.time() < deadline and p.poll() is None, "the driver never started"
        time.sleep(0.02)
    pid, sid, forked = (int(x) for x in ready.read_text().split())
    return p, pid, sid, forked


def test_a_group_sigterm_reaches_the_driver_once_and_not_its_session(tmp_path):
    p, child, sid, forked = _start(tmp_path)
    assert forked == 1 and child != p.pid
    assert sid == child and sid != os.getpgid(p.pid)  # its own session, outside the launcher's group
    # GNU timeout's stop: SIGTERM to the command's pid, then to its whole process group
    # (0.1 s apart here, so that the two cannot merge into one pending signal in the parent either)
    os.kill(p.pid, signal.SIGTERM)
    time.sleep(0.1)
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(timeout=20) == 11  # the driver got exactly one SIGTERM, through the parent


def test_a_second_signal_after_the_debounce_is_forwarded(tmp_path):
    p, child, _, _ = _start(tmp_path)
    os.kill(p.pid, signal.SIGTERM)
    time.sleep(1.2)  # > SIGNAL_DEBOUNCE_S: a second, deliberate stop
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(timeout=20) == 12


def test_the_driver_is_stopped_when_the_parent_dies(tmp_path):
    p, child, _, _ = _start(tmp_path, "orphan")
    os.kill(p.pid, signal.SIGKILL)  # nothing left to forward: the kernel's death signal does it
    p.wait(timeout=10)
    deadline = time.time() + 20
    while not (tmp_path / "ready.orphan").exists():
        assert time.time() < deadline, "the orphaned driver was never told to stop"
        time.sleep(0.05)
    assert (tmp_path / "ready.orphan").read_text() == "1"


def test_the_parent_exits_with_the_signal_that_killed_the_driver(tmp_path):
    p, _, _, _ = _start(tmp_path, "die")
    assert p.wait(timeout=20) == 128 + signal.SIGKILL


def test_off_switch_runs_the_driver_in_place(tmp_path):
    p, child, sid, forked = _start(tmp_path, env={"AGENTRL_DRIVER_SESSION": "0"})
    assert forked == 0 and child == p.pid
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(timeout=20) == 11


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_other_stop_signals_are_forwarded_too(tmp_path, sig):
    script = tmp_path / "driver.py"
    script.write_text(CHILD.format(root=str(ROOT)).replace("signal.signal(signal.SIGTERM,",
                                                           f"signal.signal({int(sig)},"))
    ready = tmp_path / "ready"
    p = subprocess.Popen([sys.executable, str(script), str(ready)], start_new_session=True)
    deadline = time.time() + 20
    while not ready.exists():
        assert time.time() < deadline
        time.sleep(0.02)
    os.kill(p.pid, sig)
    assert p.wait(timeout=20) == 11
