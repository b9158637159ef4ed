"""The engine process manager: waits for /health, restarts a dead engine, stops its whole group."""

import asyncio
import os
import signal
import sys

import pytest

from agentrl.cluster.engine_process import EngineProcess, EngineStartError, free_port

SERVER = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers(); self.wfile.write(b"ok")
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
        assert proc.alive() and not await proc.ensure_alive()
        os.kill(first, signal.SIGKILL)
        await asyncio.sleep(0.3)
        assert await proc.ensure_alive()  # restarted after backoff
        assert proc.alive() and proc.pid != first and proc.restarts == 1
        proc.stop()
        assert not proc.alive()

    asyncio.run(main())


def test_engine_that_exits_during_start_names_its_log(tmp_path):
    async def main():
        proc = EngineProcess([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
                             f"http://127.0.0.1:{free_port()}", tmp_path / "e.log", ready_timeout_s=30)
        with pytest.raises(EngineStartError, match="exited with code 3"):
            await proc.start()
        assert "boom" in (tmp_path / "e.log").read_text()

    asyncio.run(main())
