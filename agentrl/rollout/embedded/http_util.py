"""Small HTTP helpers of the embedded engine: JSON bodies, typed fields, SGLang's error shape, and
blocking calls in daemon threads (a rendezvous stuck on a dead trainer must never keep the
process from exiting on SIGTERM: the default executor's threads are joined at interpreter exit)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

_MISSING = object()


class BadRequest(ValueError):
    """A request the engine refuses (HTTP 400); the message names the field."""


def error(status: int, message: str) -> web.Response:
    """SGLang's error body for /generate and control endpoints."""
    return web.json_response({"error": {"message": message}}, status=status)


def result(success: bool, message: str, **extra: Any) -> web.Response:
    """SGLang's body for weight endpoints: {"success", "message"}; 400 when not successful."""
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


async def json_body(request: web.Request, allow_empty: bool = False) -> dict:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequest("request body must be a JSON object")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def field(body: dict, key: str, kind: type | tuple[type, ...], default: Any = _MISSING, *,
          check: Callable[[Any], bool] | None = None, hint: str = "") -> Any:
    """body[key] of type `kind` (bool is never an int here); `default` when absent or null."""
    v = body.get(key)
    if v is None:
        if default is _MISSING:
            raise BadRequest(f"{key} is required{f' ({hint})' if hint else ''}")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    bad_bool = isinstance(v, bool) and bool not in kinds
    if bad_bool or not isinstance(v, kinds) or (check is not None and not check(v)):
        names = " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"{key}={v!r}: must be {hint or names}")
    return v


async def in_daemon_thread(fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
                           on_late: Callable[[Any], None] | None = None,
                           track: set[threading.Thread] | None = None) -> Any:
    """Run fn(*args) on a new daemon thread and await its result. With `timeout_s`, TimeoutError
    after that long; a result that arrives later is handed to `on_late` (e.g. to close a group
    nobody waits for any more). `track` holds the thread while it runs (see join_threads)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    lock = threading.Lock()
    state = {"abandoned": False}

    def deliver(setter: Callable[[Any], None], value: Any) -> None:
        if not fut.done():
            setter(value)

    def run() -> None:
        try:
            out = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            setter, value, ok = fut.set_exception, exc, False
        else:
            setter, value, ok = fut.set_result, out, True
        with lock:
            late = state["abandoned"]
        if late:
            if ok and on_late is not None:
                on_late(value)
            return
        try:
            loop.call_soon_threadsafe(deliver, setter, value)
        except RuntimeError:  # the loop closed while this thread was blocked: nobody waits any more
            pass

    def tracked() -> None:
        try:
            run()
        finally:
            if track is not None:
                track.discard(thread)

    thread = threading.Thread(target=tracked, name=f"embedded-{getattr(fn, '__name__', 'call')}", daemon=True)
    if track is not None:
        track.add(thread)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
    except TimeoutError:
        with lock:
            state["abandoned"] = True
        if fut.done() and not fut.cancelled() and fut.exception() is None and on_late is not None:
            on_late(fut.result())  # it finished just as the deadline passed
        raise


def join_threads(threads: set[threading.Thread], deadline_s: float) -> None:
    """Wait up to deadline_s for tracked threads (an in-process server's stop: a thread left inside
    torch's store client when the interpreter exits aborts it). The CLI exits with os._exit instead."""
    end = time.monotonic() + deadline_s
    for t in list(threads):
        t.join(max(0.0, end - time.monotonic()))
