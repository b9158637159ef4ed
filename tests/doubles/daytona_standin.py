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
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, fields

from aiohttp import web

from tests.doubles.daytona_standin_toolbox import Box, Fail, ToolboxRoutes, error_response, fail_middleware

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


class _Standin(ToolboxRoutes):
    def __init__(self, faults: StandinFaults, root: str):
        self.f = faults
        self.root = root
        self.url = ""
        self.lock = threading.Lock()  # guards the records below against the test thread
        self.boxes: dict[str, Box] = {}
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
            resp: web.StreamResponse = error_response(401, "Unauthorized: invalid API key")
        else:
            try:
                resp = await handler(request)
            except web.HTTPNotFound:
                with self.lock:
                    self.unknown_routes.append(f"{request.method} {request.path}")
                resp = error_response(404, f"no route {request.method} {request.path}")
        with self.lock:
            self.calls.append((request.method, request.path, resp.status))
        return resp

    def _box(self, request: web.Request, *, toolbox: bool = False) -> Box:
        box = self.boxes.get(request.match_info["sid"])
        if box is None or box.state == "destroyed":
            raise Fail(404, "Sandbox not found")
        if toolbox and box.state != "started":
            raise Fail(404, f"sandbox {box.id} is not running (state {box.state})")
        return box

    def _dto(self, box: Box) -> dict:
        if box.state == "starting" and time.monotonic() >= box.ready_at:
            box.state = "started"
        if box.state != "starting":
            with self.lock:
                self.creating.discard(box.id)
        b = box.body
        return {
            "id": box.id,
            "organizationId": "standin-org",
            "name": b.get("name") or box.id,
            "user": "daytona",
            "env": b.get("env") or {},
            "labels": box.labels,
            "public": False,
            "networkBlockAll": bool(b.get("networkBlockAll")),
            "kvm": False,
            "target": "local",
            "cpu": b.get("cpu") or 1,
            "gpu": 0,
            "memory": b.get("memory") or 1,
            "disk": b.get("disk") or 3,
            "state": box.state,
            "errorReason": box.error_reason,
            "autoStopInterval": b.get("autoStopInterval"),
            "autoDeleteInterval": b.get("autoDeleteInterval"),
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
                headers = (
                    {"Retry-After": str(self.f.retry_after_s)} if self.f.retry_after_s is not None else None
                )
                return error_response(429, "Rate limit exceeded: too many requests", headers=headers)
            if self.f.capacity_errors > 0:
                self.f.capacity_errors -= 1
                self.capacity_sent += 1
                return error_response(503, "No available runners: insufficient capacity")
        sid = uuid.uuid4().hex[:12]
        dockerfile = ((body.get("buildInfo") or {}).get("dockerfileContent")) or ""
        image = next(
            (ln.split()[1] for ln in dockerfile.splitlines() if ln.upper().startswith("FROM ")), None
        )
        root = tempfile.mkdtemp(prefix=f"{sid}-", dir=self.root)
        box = Box(sid, body, root, image, ready_at=time.monotonic() + self.f.start_delay_s)
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

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.middleware, fail_middleware], client_max_size=1 << 30)
        r = app.router
        r.add_post("/api/sandbox", self.create)
        r.add_get("/api/sandbox", self.list)
        r.add_get("/api/sandbox/{sid}", self.get)
        r.add_delete("/api/sandbox/{sid}", self.delete)
        r.add_post("/api/sandbox/{sid}/last-activity", self.last_activity)
        r.add_get("/api/sandbox/{sid}/toolbox-proxy-url", self.proxy_url)
        self.add_toolbox_routes(r, "/toolbox/{sid}")
        return app


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

    def _copy(self, name: str) -> list:
        with self._s.lock:
            return list(getattr(self._s, name))

    @property
    def unknown_routes(self) -> list[str]:
        """Requests no route matched (an SDK call the stand-in does not speak yet)."""
        return self._copy("unknown_routes")

    @property
    def created(self) -> list[str]:
        return self._copy("created")

    @property
    def deleted(self) -> list[str]:
        return self._copy("deleted")

    @property
    def commands_run(self) -> list[str]:
        return self._copy("commands_run")

    @property
    def creates_received(self) -> int:
        return self._s.creates_received

    @property
    def throttled_sent(self) -> int:
        return self._s.throttled_sent

    @property
    def capacity_sent(self) -> int:
        return self._s.capacity_sent

    @property
    def max_concurrent_creates(self) -> int:
        """Most sandboxes at once between their create request and being seen 'started'."""
        return self._s.max_concurrent_creates

    @property
    def activity_refreshes(self) -> int:
        return self._s.activity_refreshes

    def live(self, **labels: str) -> list[str]:
        """Ids of sandboxes not deleted (including dead ones), optionally filtered by labels."""
        with self._s.lock:
            boxes = list(self._s.boxes.values())
        return [
            b.id
            for b in boxes
            if b.state != "destroyed" and all(b.labels.get(k) == v for k, v in labels.items())
        ]

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
            self._s.boxes[sid] = Box(sid, {"labels": dict(labels)}, root, None, state="started")
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

    def __enter__(self) -> StandinHandle:
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
