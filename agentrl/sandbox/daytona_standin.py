"""A local stand-in for the Daytona cloud, so tests and benchmarks drive the real SDK.

It is a real HTTP server on 127.0.0.1 speaking the REST routes `daytona` 0.226.1 calls (found by
reading its generated clients and by logging the 404s it hit): the control plane under `/api`
and the per-sandbox toolbox under `/toolbox/{id}`. Commands run for real as local subprocesses in
a per-sandbox temp dir; there is no isolation (it stands in for the cloud, not for a sandbox).
Relative file paths resolve against that dir, absolute ones are used as they are.

Clients must set DAYTONA_USE_DEPRECATED_POLLING=true (or `use_deprecated_polling`): there is no
socket.io endpoint. Faults are injected through `StandinFaults`; every call is recorded so a
test can assert on it (all sandboxes deleted, creates throttled, concurrency observed, ...).

    url, handle = start_standin(throttle_creates=3)   # url is the DAYTONA_API_URL
    ...
    handle.stop()
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field, fields

from aiohttp import MultipartWriter, web

DEFAULT_KEY = "standin-key"


@dataclass
class StandinFaults:
    """Fault knobs. Counters (`throttle_creates`, `capacity_errors`, `exec_errors`) are consumed
    one per matching request, process-wide."""

    api_key: str = DEFAULT_KEY  # the Bearer token the server accepts
    throttle_creates: int = 0  # the next N creates answer 429 "rate limit"
    retry_after_s: float | None = None  # Retry-After header sent with those 429s
    capacity_errors: int = 0  # the next N creates answer 503 "no available runners"
    create_delay_s: float = 0.0  # create answers after this delay; the sandbox exists already
    start_delay_s: float = 0.0  # a new sandbox stays 'starting' this long before 'started'
    fail_build_images: tuple[str, ...] = ()  # creates from these images end in 'build_failed'
    die_on_exec: int | None = None  # each sandbox dies during its Nth command (1-based)
    die_delay_s: float = 0.2  # ... this long after that command started
    exec_errors: int = 0  # the next N command starts answer 500 (the sandbox stays healthy)


@dataclass
class _Cmd:
    id: str
    command: str
    proc: asyncio.subprocess.Process | None = None
    output: bytearray = field(default_factory=bytearray)
    exit_code: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Box:
    id: str
    body: dict
    root: str
    image: str | None
    state: str = "starting"
    ready_at: float = 0.0
    error_reason: str | None = None
    sessions: dict[str, dict[str, _Cmd]] = field(default_factory=dict)
    commands: int = 0

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.body.get("labels") or {})


class _Standin:
    def __init__(self, faults: StandinFaults, root: str):
        self.f = faults
        self.root = root
        self.url = ""
        self.lock = threading.Lock()  # guards the records below against the test thread
        self.boxes: dict[str, _Box] = {}
        self.calls: list[tuple[str, str, int]] = []
        self.unknown_routes: list[str] = []
        self.created: list[str] = []
        self.deleted: list[str] = []
        self.creates_received = 0
        self.throttled_sent = 0
        self.capacity_sent = 0
        self.creating: set[str] = set()
        self.max_concurrent_creates = 0
        self.commands_run: list[str] = []
        self.activity_refreshes = 0

    # ---- plumbing -------------------------------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if request.headers.get("Authorization") != f"Bearer {self.f.api_key}":
            resp: web.StreamResponse = _err(401, "Unauthorized: invalid API key")
        else:
            try:
                resp = await handler(request)
            except web.HTTPNotFound:
                with self.lock:
                    self.unknown_routes.append(f"{request.method} {request.path}")
                resp = _err(404, f"no route {request.method} {request.path}")
        with self.lock:
            self.calls.append((request.method, request.path, resp.status))
        return resp

    def _box(self, request: web.Request, *, toolbox: bool = False) -> _Box:
        box = self.boxes.get(request.match_info["sid"])
        if box is None or box.state == "destroyed":
            raise _Fail(404, "Sandbox not found")
        if toolbox and box.state != "started":
            raise _Fail(404, f"sandbox {box.id} is not running (state {box.state})")
        return box

    def _dto(self, box: _Box) -> dict:
        if box.state == "starting" and time.monotonic() >= box.ready_at:
            box.state = "started"
        if box.state != "starting":
            with self.lock:
                self.creating.discard(box.id)
        b = box.body
        return {
            "id": box.id, "organizationId": "standin-org", "name": b.get("name") or box.id, "user": "daytona",
            "env": b.get("env") or {}, "labels": box.labels, "public": False,
            "networkBlockAll": bool(b.get("networkBlockAll")), "kvm": False, "target": "local",
            "cpu": b.get("cpu") or 1, "gpu": 0, "memory": b.get("memory") or 1, "disk": b.get("disk") or 3,
            "state": box.state, "errorReason": box.error_reason,
            "autoStopInterval": b.get("autoStopInterval"), "autoDeleteInterval": b.get("autoDeleteInterval"),
            "toolboxProxyUrl": f"{self.url}/toolbox",
        }

    # ---- control plane --------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        with self.lock:
            self.creates_received += 1
            if self.f.throttle_creates > 0:
                self.f.throttle_creates -= 1
                self.throttled_sent += 1
                headers = {"Retry-After": str(self.f.retry_after_s)} if self.f.retry_after_s is not None else None
                return _err(429, "Rate limit exceeded: too many requests", headers=headers)
            if self.f.capacity_errors > 0:
                self.f.capacity_errors -= 1
                self.capacity_sent += 1
                return _err(503, "No available runners: insufficient capacity")
        sid = uuid.uuid4().hex[:12]
        dockerfile = ((body.get("buildInfo") or {}).get("dockerfileContent")) or ""
        image = next((ln.split()[1] for ln in dockerfile.splitlines() if ln.upper().startswith("FROM ")), None)
        root = tempfile.mkdtemp(prefix=f"{sid}-", dir=self.root)
        box = _Box(sid, body, root, image, ready_at=time.monotonic() + self.f.start_delay_s)
        if image in self.f.fail_build_images:
            box.state, box.error_reason = "build_failed", f"failed to build image {image}: manifest unknown"
        with self.lock:
            self.boxes[sid] = box
            self.created.append(sid)
            self.creating.add(sid)
            self.max_concurrent_creates = max(self.max_concurrent_creates, len(self.creating))
        if self.f.create_delay_s:
            await asyncio.sleep(self.f.create_delay_s)  # the sandbox exists: a client timeout orphans it
        return web.json_response(self._dto(box))

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(self._dto(self._box(request)))

    async def delete(self, request: web.Request) -> web.Response:
        box = self._box(request)
        await self._kill_all(box)
        box.state = "destroyed"
        with self.lock:
            self.deleted.append(box.id)
            self.creating.discard(box.id)
        shutil.rmtree(box.root, ignore_errors=True)
        return web.json_response(self._dto(box))

    async def list(self, request: web.Request) -> web.Response:
        want = json.loads(request.query.get("labels") or "{}")
        items = [
            self._dto(b)
            for b in list(self.boxes.values())
            if b.state != "destroyed" and all(b.labels.get(k) == v for k, v in want.items())
        ]
        return web.json_response({"items": items, "nextCursor": None})

    async def last_activity(self, request: web.Request) -> web.Response:
        self._box(request)
        with self.lock:
            self.activity_refreshes += 1
        return web.Response(status=201)

    async def proxy_url(self, request: web.Request) -> web.Response:
        self._box(request)
        return web.json_response({"url": f"{self.url}/toolbox"})

    # ---- toolbox: processes ---------------------------------------------------------------
    async def _spawn(self, box: _Box, command: str, cwd: str | None = None, env: dict | None = None) -> _Cmd:
        with self.lock:
            if self.f.exec_errors > 0:
                self.f.exec_errors -= 1
                raise _Fail(500, "injected failure starting the command")
            self.commands_run.append(command)
        box.commands += 1
        cmd = _Cmd(uuid.uuid4().hex[:12], command)
        base_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": box.root, "LANG": "C.UTF-8"}
        cmd.proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", command,
            cwd=os.path.join(box.root, cwd) if cwd else box.root,
            env={**base_env, **(box.body.get("env") or {}), **(env or {})},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # one process group per command, so a kill reaches its children
        )
        asyncio.get_running_loop().create_task(self._pump(cmd))
        if self.f.die_on_exec is not None and box.commands == self.f.die_on_exec:
            asyncio.get_running_loop().call_later(
                self.f.die_delay_s, lambda: asyncio.ensure_future(self._die(box))
            )
        return cmd

    async def _pump(self, cmd: _Cmd) -> None:
        assert cmd.proc is not None and cmd.proc.stdout is not None
        while chunk := await cmd.proc.stdout.read(65536):
            cmd.output.extend(chunk)
        cmd.exit_code = await cmd.proc.wait()
        cmd.done.set()

    async def _die(self, box: _Box) -> None:
        if box.state == "started":
            await self._kill_all(box)
            box.state, box.error_reason = "error", "runner lost the sandbox"

    async def _kill_all(self, box: _Box) -> None:
        for cmds in box.sessions.values():
            for c in cmds.values():
                _killpg(c)
        box.sessions.clear()

    async def create_session(self, request: web.Request) -> web.Response:
        box = self._box(request, toolbox=True)
        box.sessions.setdefault((await request.json())["sessionId"], {})
        return web.Response(status=201)

    async def delete_session(self, request: web.Request) -> web.Response:
        box = self._box(request, toolbox=True)
        for c in box.sessions.pop(request.match_info["session"], {}).values():
            _killpg(c)
        return web.Response(status=204)

    async def session_exec(self, request: web.Request) -> web.Response:
        box = self._box(request, toolbox=True)
        session = box.sessions.get(request.match_info["session"])
        if session is None:
            raise _Fail(404, "session not found")
        body = await request.json()
        cmd = await self._spawn(box, body["command"])
        session[cmd.id] = cmd
        if body.get("runAsync") or body.get("async"):
            return web.json_response({"cmdId": cmd.id})
        await cmd.done.wait()
        out = cmd.output.decode("utf-8", "replace")
        return web.json_response({"cmdId": cmd.id, "exitCode": cmd.exit_code, "output": out, "stdout": out, "stderr": ""})

    def _cmd(self, request: web.Request) -> _Cmd:
        box = self._box(request, toolbox=True)
        cmd = box.sessions.get(request.match_info["session"], {}).get(request.match_info["cmd"])
        if cmd is None:
            raise _Fail(404, "command not found")
        return cmd

    async def get_command(self, request: web.Request) -> web.Response:
        cmd = self._cmd(request)
        return web.json_response({"id": cmd.id, "command": cmd.command, "exitCode": cmd.exit_code})

    async def command_logs(self, request: web.Request) -> web.Response:
        out = self._cmd(request).output.decode("utf-8", "replace")
        return web.json_response({"output": out, "stdout": out, "stderr": ""})

    async def execute(self, request: web.Request) -> web.Response:
        box = self._box(request, toolbox=True)
        body = await request.json()
        cmd = await self._spawn(box, body["command"], body.get("cwd"), body.get("envs"))
        try:
            await asyncio.wait_for(cmd.done.wait(), body.get("timeout") or None)
        except TimeoutError:
            _killpg(cmd)
            raise _Fail(408, "command execution timeout") from None
        return web.json_response({"exitCode": cmd.exit_code, "result": cmd.output.decode("utf-8", "replace")})

    # ---- toolbox: files -------------------------------------------------------------------
    def _path(self, box: _Box, path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(box.root, path)

    async def upload(self, request: web.Request) -> web.Response:
        box = self._box(request, toolbox=True)
        reader = await request.multipart()
        paths: dict[str, str] = {}  # "files[i]" -> destination, from the files[i].path fields
        while (part := await reader.next()) is not None:
            field_name = part.name or ""  # type: ignore[union-attr]
            prefix, _, kind = field_name.rpartition(".")
            if kind == "path":
                paths[prefix] = (await part.read()).decode()  # type: ignore[union-attr]
            elif kind == "file":  # the client percent-quotes the filename: prefer the path field
                dst = self._path(box, paths.get(prefix) or urllib.parse.unquote(part.filename or ""))  # type: ignore[union-attr]
                os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
                with open(dst, "wb") as fh:
                    fh.write(await part.read())  # type: ignore[union-attr]
        return web.json_response({})

    async def download(self, request: web.Request) -> web.StreamResponse:
        box = self._box(request, toolbox=True)
        paths = (await request.json())["paths"]
        mp = MultipartWriter("form-data")
        for p in paths:
            try:
                with open(self._path(box, p), "rb") as fh:
                    part = mp.append(fh.read(), {"Content-Type": "application/octet-stream"})
                name = "file"
            except OSError as e:
                code = "FILE_NOT_FOUND" if isinstance(e, FileNotFoundError) else "FILE_READ_FAILED"
                err = {"message": f"{p}: {e.strerror}", "statusCode": 404, "code": code, "source": "DAYTONA_DAEMON"}
                part = mp.append(json.dumps(err), {"Content-Type": "application/json"})
                name = "error"
            part.set_content_disposition("form-data", quote_fields=False, name=name, filename=p)
        resp = web.Response(status=200)
        resp.body = mp
        return resp

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.middleware, _fail_middleware], client_max_size=1 << 30)
        r, t = app.router, "/toolbox/{sid}"
        r.add_post("/api/sandbox", self.create)
        r.add_get("/api/sandbox", self.list)
        r.add_get("/api/sandbox/{sid}", self.get)
        r.add_delete("/api/sandbox/{sid}", self.delete)
        r.add_post("/api/sandbox/{sid}/last-activity", self.last_activity)
        r.add_get("/api/sandbox/{sid}/toolbox-proxy-url", self.proxy_url)
        r.add_post(t + "/process/session", self.create_session)
        r.add_delete(t + "/process/session/{session}", self.delete_session)
        r.add_post(t + "/process/session/{session}/exec", self.session_exec)
        r.add_get(t + "/process/session/{session}/command/{cmd}", self.get_command)
        r.add_get(t + "/process/session/{session}/command/{cmd}/logs", self.command_logs)
        r.add_post(t + "/process/execute", self.execute)
        r.add_post(t + "/files/bulk-upload", self.upload)
        r.add_post(t + "/files/bulk-download", self.download)
        return app


class _Fail(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@web.middleware
async def _fail_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except _Fail as e:
        return _err(e.status, str(e))


def _err(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"statusCode": status, "message": message}, status=status, headers=headers)


def _killpg(cmd: _Cmd) -> None:
    if cmd.proc is not None and cmd.proc.returncode is None:
        try:
            os.killpg(cmd.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class StandinHandle:
    """The running server: records for assertions, a few direct manipulations, and `stop()`."""

    def __init__(self, state: _Standin, loop: asyncio.AbstractEventLoop, thread: threading.Thread, runner):
        self._s, self._loop, self._thread, self._runner = state, loop, thread, runner
        self.url = state.url + "/api"
        self.faults = state.f  # mutable: a test may arm a fault between calls

    # records
    @property
    def calls(self) -> list[tuple[str, str, int]]:
        with self._s.lock:
            return list(self._s.calls)

    def __getattr__(self, name: str):
        if name in {"unknown_routes", "created", "deleted", "commands_run"}:
            with self._s.lock:
                return list(getattr(self._s, name))
        if name in {"creates_received", "throttled_sent", "capacity_sent", "max_concurrent_creates",
                    "activity_refreshes"}:
            return getattr(self._s, name)
        raise AttributeError(name)

    def live(self, **labels: str) -> list[str]:
        """Ids of sandboxes not deleted (including dead ones), optionally filtered by labels."""
        with self._s.lock:
            boxes = list(self._s.boxes.values())
        return [b.id for b in boxes if b.state != "destroyed" and all(b.labels.get(k) == v for k, v in labels.items())]

    def state_of(self, sid: str) -> str:
        return self._s.boxes[sid].state

    def labels_of(self, sid: str) -> dict[str, str]:
        return self._s.boxes[sid].labels

    def create_body(self, sid: str) -> dict:
        return dict(self._s.boxes[sid].body)

    def plant(self, labels: dict[str, str]) -> str:
        """A started sandbox that no client created (a leftover of an earlier process)."""
        sid = uuid.uuid4().hex[:12]
        root = tempfile.mkdtemp(prefix=f"{sid}-", dir=self._s.root)
        with self._s.lock:
            self._s.boxes[sid] = _Box(sid, {"labels": dict(labels)}, root, None, state="started")
        return sid

    def stop(self) -> None:
        """Kill every command, close the server, join its thread, remove the temp dirs. Idempotent."""
        if not self._thread.is_alive():
            return

        async def _shutdown() -> None:
            for box in list(self._s.boxes.values()):
                await self._s._kill_all(box)
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        shutil.rmtree(self._s.root, ignore_errors=True)

    def __enter__(self) -> "StandinHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_standin(**faults) -> tuple[str, StandinHandle]:
    """Start the stand-in on 127.0.0.1 (a free port) in its own thread and event loop.
    Keyword arguments are `StandinFaults` fields. Returns (api url, handle)."""
    known = {f.name for f in fields(StandinFaults)}
    bad = sorted(set(faults) - known)
    if bad:
        raise TypeError(f"unknown stand-in fault(s) {bad}; known: {sorted(known)}")
    f = StandinFaults(**faults)
    f.fail_build_images = tuple(f.fail_build_images)
    state = _Standin(f, tempfile.mkdtemp(prefix="daytona-standin-"))
    loop = asyncio.new_event_loop()
    started: dict[str, object] = {}
    ready = threading.Event()

    async def _serve() -> None:
        runner = web.AppRunner(state.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        state.url = f"http://{host}:{port}"
        started["runner"] = runner

    def _run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(_serve())
        except BaseException as e:  # surface a failed start to the caller instead of hanging it
            started["error"] = e
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    thread = threading.Thread(target=_run, name="daytona-standin", daemon=True)
    thread.start()
    ready.wait(timeout=30)
    if "runner" not in started:
        shutil.rmtree(state.root, ignore_errors=True)
        raise RuntimeError(f"daytona stand-in failed to start: {started.get('error', 'timed out')!r}")
    handle = StandinHandle(state, loop, thread, started["runner"])
    return handle.url, handle
