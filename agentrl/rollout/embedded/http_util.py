"""Small HTTP helpers of the embedded engine: JSON bodies, typed fields, SGLang's error shape, and
blocking calls in daemon threads (a rendezvous stuck on a dead trainer must never keep the
process from exiting on SIGTERM: the default executor's threads are joined at interpreter exit)."""

from __future__ import annotations

import asyncio
import json
import threading
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


async def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run fn(*args) on a new daemon thread and await its result."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def deliver(setter: Callable[[Any], None], value: Any) -> None:
        if not fut.done():
            setter(value)

    def run() -> None:
        try:
            out = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            setter, value = fut.set_exception, exc
        else:
            setter, value = fut.set_result, out
        try:
            loop.call_soon_threadsafe(deliver, setter, value)
        except RuntimeError:  # the loop closed while this thread was blocked: nobody waits any more
            pass

    threading.Thread(target=run, name=f"embedded-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await fut
