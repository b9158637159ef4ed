"""The toolbox half of the Daytona stand-in: sessions, commands and files of one sandbox.

Split from daytona_standin.py to keep files small; `ToolboxRoutes` is mixed into the server
state there, which provides `f` (the faults), `lock`, `commands_run` and `_box()`.
Commands run as real local subprocesses, one process group each, so a kill reaches children, and
all commands of one sandbox share a pid namespace with its own /proc (as a container's processes
do), so a kill of "every process but pid 1" inside one reaches that sandbox's processes only.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import MultipartWriter, web


class Fail(Exception):
    """An error answer: a handler raises it, `fail_middleware` turns it into JSON."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@web.middleware
async def fail_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except Fail as e:
        return error_response(e.status, str(e))


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"statusCode": status, "message": message}, status=status, headers=headers)


def killpg(cmd: Cmd) -> None:
    if cmd.proc is not None and cmd.proc.returncode is None:
        try:
            os.killpg(cmd.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _first_child(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
    except OSError:
        return 0
    return int(kids[0]) if kids else 0


@dataclass
class Cmd:
    id: str
    command: str
    proc: asyncio.subprocess.Process | None = None
    output: bytearray = field(default_factory=bytearray)
    exit_code: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Box:
    id: str
    body: dict
    root: str
    image: str | None
    state: str = "starting"
    ready_at: float = 0.0
    error_reason: str | None = None
    sessions: dict[str, dict[str, Cmd]] = field(default_factory=dict)
    commands: int = 0
    init: asyncio.subprocess.Process | None = None  # `unshare --pid` holding the pid namespace
    init_pid: int = 0  # its child, pid 1 of the namespace (host pid)

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.body.get("labels") or {})


class ToolboxRoutes:
    """Process and file routes under {toolboxProxyUrl}/{sandbox id}. The server class that mixes
    this in provides `f` (faults), `lock`, `commands_run` and `_box(request, toolbox=...)`."""

    f: Any
    lock: threading.Lock
    commands_run: list[str]
    _box: Any

    # ---- toolbox: processes ---------------------------------------------------------------
    async def _spawn(self, box: Box, command: str, cwd: str | None = None, env: dict | None = None) -> Cmd:
        with self.lock:
            if self.f.exec_errors > 0:
                self.f.exec_errors -= 1
                raise Fail(500, "injected failure starting the command")
            self.commands_run.append(command)
        box.commands += 1
        cmd = Cmd(uuid.uuid4().hex[:12], command)
        base_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": box.root, "LANG": "C.UTF-8"}
        workdir = os.path.join(box.root, cwd) if cwd else box.root
        pid = await self._pid_namespace(box)  # (entering its mount namespace resets the cwd: --wd)
        enter = ["nsenter", "-t", str(pid), "-p", "-m", f"--wd={workdir}", "--"] if pid else []
        cmd.proc = await asyncio.create_subprocess_exec(
            *enter,
            "/bin/sh",
            "-c",
            command,
            cwd=workdir,
            env={**base_env, **(box.body.get("env") or {}), **(env or {})},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # one process group per command, so a kill reaches its children
        )
        asyncio.get_running_loop().create_task(self._pump(cmd))
        if self.f.die_on_exec is not None and box.commands == self.f.die_on_exec:
            asyncio.get_running_loop().call_later(
                self.f.die_delay_s, lambda: asyncio.ensure_future(self._die(box))
            )
        return cmd

    async def _pump(self, cmd: Cmd) -> None:
        assert cmd.proc is not None and cmd.proc.stdout is not None
        while chunk := await cmd.proc.stdout.read(65536):
            cmd.output.extend(chunk)
        cmd.exit_code = await cmd.proc.wait()
        cmd.done.set()

    async def _die(self, box: Box) -> None:
        if box.state == "started":
            await self._kill_all(box)
            box.state, box.error_reason = "error", "runner lost the sandbox"

    async def _pid_namespace(self, box: Box) -> int:
        """Host pid of pid 1 of the box's pid namespace, made on first use; 0 where it cannot be
        made (not root): commands then run in the host's, where agentrl's kill_all refuses to run."""
        if box.init is None and shutil.which("unshare") and os.geteuid() == 0:
            box.init = await asyncio.create_subprocess_exec(
                "unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "--", "sleep", "infinity",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            for _ in range(400):
                box.init_pid = _first_child(box.init.pid)
                if box.init_pid:
                    break
                await asyncio.sleep(0.005)
        return box.init_pid

    async def _kill_all(self, box: Box) -> None:
        for cmds in box.sessions.values():
            for c in cmds.values():
                killpg(c)
        box.sessions.clear()
        if box.init is not None and box.init.returncode is None:
            for pid in (box.init_pid, box.init.pid):  # pid 1 first: the kernel ends the namespace
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            await box.init.wait()

    async def create_session(self, request: web.Request) -> web.Response:
        box = self._box(request, toolbox=True)
        box.sessions.setdefault((await request.json())["sessionId"], {})
        return web.Response(status=201)

    async def delete_session(self, request: web.Request) -> web.Response:
        box = self._box(request, toolbox=True)
        for c in box.sessions.pop(request.match_info["session"], {}).values():
            killpg(c)
        return web.Response(status=204)

    async def session_exec(self, request: web.Request) -> web.Response:
        box = self._box(request, toolbox=True)
        session = box.sessions.get(request.match_info["session"])
        if session is None:
            raise Fail(404, "session not found")
        body = await request.json()
        cmd = await self._spawn(box, body["command"])
        session[cmd.id] = cmd
        if body.get("runAsync") or body.get("async"):
            return web.json_response({"cmdId": cmd.id})
        await cmd.done.wait()
        out = cmd.output.decode("utf-8", "replace")
        return web.json_response(
            {"cmdId": cmd.id, "exitCode": cmd.exit_code, "output": out, "stdout": out, "stderr": ""}
        )

    def _cmd(self, request: web.Request) -> Cmd:
        box = self._box(request, toolbox=True)
        cmd = box.sessions.get(request.match_info["session"], {}).get(request.match_info["cmd"])
        if cmd is None:
            raise Fail(404, "command not found")
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
            killpg(cmd)
            raise Fail(408, "command execution timeout") from None
        return web.json_response({"exitCode": cmd.exit_code, "result": cmd.output.decode("utf-8", "replace")})

    # ---- toolbox: files -------------------------------------------------------------------
    def _path(self, box: Box, path: str) -> str:
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
                err = {
                    "message": f"{p}: {e.strerror}",
                    "statusCode": 404,
                    "code": code,
                    "source": "DAYTONA_DAEMON",
                }
                part = mp.append(json.dumps(err), {"Content-Type": "application/json"})
                name = "error"
            part.set_content_disposition("form-data", quote_fields=False, name=name, filename=p)
        resp = web.Response(status=200)
        resp.body = mp
        return resp

    def add_toolbox_routes(self, router: web.UrlDispatcher, prefix: str) -> None:
        router.add_post(prefix + "/process/session", self.create_session)
        router.add_delete(prefix + "/process/session/{session}", self.delete_session)
        router.add_post(prefix + "/process/session/{session}/exec", self.session_exec)
        router.add_get(prefix + "/process/session/{session}/command/{cmd}", self.get_command)
        router.add_get(prefix + "/process/session/{session}/command/{cmd}/logs", self.command_logs)
        router.add_post(prefix + "/process/execute", self.execute)
        router.add_post(prefix + "/files/bulk-upload", self.upload)
        router.add_post(prefix + "/files/bulk-download", self.download)
