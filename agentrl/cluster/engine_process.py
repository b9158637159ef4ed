"""One inference engine as a child process: SGLang's launch_server or the embedded engine.

Starts the command the plan computed, writes its output to a log in the run dir, waits until
the HTTP API answers, and restarts it with exponential backoff when it dies. The caller
re-sends the current weights after a restart (`restarts` tells it one happened).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_engine_argv(argv: list[str], host: str, port: int) -> tuple[list[str], str]:
    """A planned engine command made runnable here: `agentrl` becomes this interpreter (the caller's
    own environment) and `--port` gets `port` (0 picks a free one). Returns (argv, url)."""
    port = port or free_port(host)
    argv = list(argv)
    if argv[:1] == ["agentrl"]:
        argv = [sys.executable, "-m", "agentrl.cli", *argv[1:]]
    if "--port" in argv:
        argv[argv.index("--port") + 1] = str(port)
    return argv, f"http://{host}:{port}"


class EngineStartError(RuntimeError):
    pass


class EngineProcess:
    def __init__(self, argv: list[str], url: str, log_path: Path, env: dict[str, str] | None = None,
                 ready_timeout_s: float = 600.0, max_restarts: int = 5):
        self.argv = argv
        self.url = url
        self.log_path = Path(log_path)
        self.env = env or {}
        self.ready_timeout_s = ready_timeout_s
        self.max_restarts = max_restarts
        self.restarts = 0
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        # Own process group, so stop() ends the engine and anything it spawned.
        self._proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                      start_new_session=True)
        log.close()
        await self._wait_ready()

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        async with httpx.AsyncClient(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise EngineStartError(f"engine exited with code {self._proc.returncode} while starting; "
                                           f"see {self.log_path}")
                try:
                    r = await client.get(self.url + "/health")
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        self.stop()
        raise EngineStartError(f"engine not ready after {self.ready_timeout_s:.0f} s; see {self.log_path}")

    async def ensure_alive(self) -> bool:
        """Restart a dead engine (backoff 1, 2, 4, ... s). True if a restart happened."""
        if self.alive():
            return False
        if self.restarts >= self.max_restarts:
            raise EngineStartError(f"engine died {self.restarts} times; giving up (see {self.log_path})")
        await asyncio.sleep(min(2 ** self.restarts, 30))
        self.restarts += 1
        await self.start()
        return True

    def stop(self, grace_s: float = 10.0) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGTERM)
            self._proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        except ProcessLookupError:
            pass
