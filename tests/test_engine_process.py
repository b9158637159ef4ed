"""The engine process manager: waits for health, starts again after a death, stops its whole group,
and never leaves an orphan when the process that started it dies."""

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from agentrl.cluster.engine_process import (
    EngineProcess,
    EngineStartError,
    free_port,
    free_port_block,
    ports_free,
)
from tests.proc_util import running

SERVER = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path in ("/health", "/health_generate")
        self.send_response(200 if ok else 404); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_start_restart_stop(tmp_path):
    async def main():
        port = free_port()
        proc = EngineProcess([sys.executable, "-c", SERVER, str(port)], f"http://127.0.0.1:{port}",
                             tmp_path / "engine.log", ready_timeout_s=30)
        await proc.start()
        first = proc.pid
        assert proc.alive()
        os.kill(first, signal.SIGKILL)
        await asyncio.sleep(0.3)
        assert not proc.alive()
        await proc.start()  # the same command again (EngineGroup restarts this way, after its backoff)
        assert proc.alive() and proc.pid != first
        proc.stop()
        assert not proc.alive()
        assert (tmp_path / "engine.log").read_text().count("start: ") == 2  # each start is marked in the log

    asyncio.run(main())


def test_engine_that_exits_during_start_names_its_log(tmp_path):
    async def main():
        proc = EngineProcess([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
                             f"http://127.0.0.1:{free_port()}", tmp_path / "e.log", ready_timeout_s=30)
        with pytest.raises(EngineStartError, match="exited with code 3"):
            await proc.start()
        assert "boom" in (tmp_path / "e.log").read_text()
        quiet = EngineProcess([sys.executable, "-c", "import time; time.sleep(60)"], None, tmp_path / "n.log")
        await quiet.start()  # serves no HTTP (a node_rank > 0 process): up once it did not exit
        assert quiet.alive()
        quiet.stop()
        failing = EngineProcess([sys.executable, "-c", "raise SystemExit(4)"], None, tmp_path / "f.log")
        with pytest.raises(EngineStartError, match="code 4"):
            await failing.start()

    asyncio.run(main())


def test_port_block_is_free():
    p = free_port_block("127.0.0.1", 7)
    assert ports_free("127.0.0.1", p, 7)
    with socket.socket() as s:
        s.bind(("127.0.0.1", p + 3))
        assert not ports_free("127.0.0.1", p, 7)


PARENT = r"""
import asyncio, sys
from pathlib import Path
from agentrl.cluster.engine_process import EngineProcess
proc = EngineProcess([sys.executable, "-c", "import time; time.sleep(120)"], None, Path(sys.argv[1]))
proc.spawn()
print(proc.pid, flush=True)
asyncio.run(asyncio.sleep(120))
"""


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs util-linux setpriv")
def test_engine_dies_with_the_process_that_started_it(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "c.log")], stdout=subprocess.PIPE,
                              text=True)
    child = int(parent.stdout.readline())
    try:
        # setpriv sets the parent-death signal and then execs the engine; a parent killed before that
        # (a few ms, longer on a loaded box) leaves nothing to signal, so wait for the exec.
        for _ in range(600):
            if os.path.realpath(f"/proc/{child}/exe") != os.path.realpath(shutil.which("setpriv")):
                break
            time.sleep(0.05)
        os.kill(parent.pid, signal.SIGKILL)  # an actor killed outright
        parent.wait(10)
        for _ in range(600):  # 30 s: SIGTERM from the kernel is instant, but a loaded 2-core box is slow to run it
            if not running(child):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the engine outlived the process that started it")
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


FAILING_SERVER = r"""
import http.server, sys
print("model type gemma3: cache layer 0 is not supported", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(500); self.end_headers(); self.wfile.write(b"generation failed")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_an_engine_that_answers_with_errors_is_reported_while_it_is_waited_for(tmp_path, monkeypatch, caplog):
    import agentrl.cluster.engine_process as ep

    monkeypatch.setattr(ep, "WAIT_NOTE_EVERY_S", 0.5)

    async def main():
        port = free_port()
        proc = EngineProcess([sys.executable, "-c", FAILING_SERVER, str(port)], f"http://127.0.0.1:{port}",
                             tmp_path / "engine.log", ready_timeout_s=3)
        with pytest.raises(EngineStartError, match="not ready after 3 s"):
            await proc.start()
        assert not proc.alive()

    with caplog.at_level("WARNING", logger="agentrl.cluster.engine_process"):
        asyncio.run(main())
    notes = [r.getMessage() for r in caplog.records]
    assert notes and all("not ready after" in n for n in notes)
    assert any("HTTP 500: generation failed" in n and "cache layer 0 is not supported" in n for n in notes), notes
