"""One inference engine process on one node: SGLang's launch_server or the embedded engine.

Starts the argv engine_argv built, writes its output to a log in the run dir and, for the
process that serves HTTP (node_rank 0), waits until `health_path` answers 200 (SGLang's
/health_generate runs a one-token generation: the model is loaded and generates). A process
that serves no HTTP (node_rank > 0 of a multi-node engine) is up once it has not exited within
SETTLE_S. The engine runs in its own process group (stop() ends it and everything it spawned)
and, where util-linux's setpriv exists, with a parent-death signal: if the actor that started it
dies, the engine gets SIGTERM instead of holding its GPUs and ports as an orphan. Restarts (with
backoff, all nodes of an engine together) are agentrl.cluster.engines.EngineGroup's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SETTLE_S = 1.0  # a non-serving process that survives this long started (bad flags fail faster)
POLL_S = 0.5
PROBE_TIMEOUT_S = 30.0  # one /health_generate answer (SGLang waits up to 20 s for a token)
STOP_GRACE_S = 10.0
# While an engine is not ready, say so this often: a model load takes minutes, but an engine that
# answers its health check with errors (a model it cannot serve) would otherwise wait out the
# whole ready timeout (600 s by default) in silence.
WAIT_NOTE_EVERY_S = 60.0

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ports_free(host: str, first: int, count: int) -> bool:
    """True if ports first..first+count-1 can all be bound on host now."""
    socks = []
    try:
        for p in range(first, first + count):
            s = socket.socket()
            socks.append(s)
            s.bind((host, p))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_port_block(host: str, count: int, attempts: int = 50) -> int:
    """A port p with p..p+count-1 free on host (SGLang binds a block after its dist-init port)."""
    for _ in range(attempts):
        p = free_port(host)
        if p + count <= 65536 and ports_free(host, p, count):
            return p
    raise OSError(f"no block of {count} free ports on {host} after {attempts} tries")


class EngineStartError(RuntimeError):
    pass


def _with_parent_death_signal(argv: list[str]) -> list[str]:
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv and sys.platform == "linux" else argv


class EngineProcess:
    def __init__(self, argv: list[str], url: str | None, log_path: Path, env: dict[str, str] | None = None,
                 ready_timeout_s: float = 600.0, health_path: str = "/health_generate"):
        self.argv = argv
        self.url = url  # None: this process serves no HTTP (node_rank > 0)
        self.log_path = Path(log_path)
        self.env = env or {}
        self.ready_timeout_s = ready_timeout_s
        self.health_path = health_path
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def spawn(self) -> None:
        """Start the process (on the calling thread: the parent-death signal follows that thread)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
            log.flush()
            # Own process group, so stop() ends the engine and anything it spawned.
            self._proc = subprocess.Popen(_with_parent_death_signal(self.argv), stdout=log, stderr=subprocess.STDOUT,
                                          env={**os.environ, **self.env}, start_new_session=True)

    async def start(self) -> None:
        self.spawn()
        await self._wait_ready()

    def _exited(self) -> EngineStartError:
        return EngineStartError(f"engine exited with code {self._proc.returncode} while starting; see {self.log_path}")

    async def _wait_ready(self) -> None:
        if self.url is None:
            await asyncio.sleep(SETTLE_S)
            if not self.alive():
                raise self._exited()
            return
        began = time.monotonic()
        deadline, next_note, last = began + self.ready_timeout_s, began + WAIT_NOTE_EVERY_S, "no answer yet"
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise self._exited()
                try:
                    r = await client.get(self.url + self.health_path)
                    if r.status_code == 200:
                        return
                    last = f"HTTP {r.status_code}: {r.text.strip()[:200]}"
                except httpx.HTTPError as err:
                    last = f"{type(err).__name__}"
                if time.monotonic() >= next_note:
                    next_note += WAIT_NOTE_EVERY_S
                    log.warning("engine at %s not ready after %.0f s of %.0f (last answer: %s); its log ends: %s",
                                self.url, time.monotonic() - began, self.ready_timeout_s, last, self._log_tail())
                await asyncio.sleep(POLL_S)
        self.stop()
        raise EngineStartError(f"engine not ready after {self.ready_timeout_s:.0f} s (no 200 from "
                               f"{self.url}{self.health_path}); see {self.log_path}")

    def _log_tail(self) -> str:
        """The engine log's last non-empty line (where a failing engine says why)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        return lines[-1][-300:] if lines else "(empty)"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
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
