"""HTTP around a weight update: the engines' session (driver side) and the per-bucket calls a
sender makes from its export thread.

`EngineSession` (the driver, one per update): pause (in rollout.pause_mode: `retract` by default,
so no request continues on KV computed with the old weights) -> /begin_weight_update ... ->
/end_weight_update (checking the engine's receipt when it reports one) -> /continue_generation.
An engine that fails any call is dropped from the rest of the update and reported; it stays
paused (its restart resends the weights), with its session closed so a later update can begin.

`EngineLinks` (a sender): its export runs on a worker thread (torch collectives block), while
HTTP runs on the actor's event loop; `post` schedules a call there and returns at once (so a
broadcast can start while the engines' requests are on their way), `collect` (from the worker
thread) or `acollect` (on the loop) waits for answers, each bounded by the call's timeout.

`run_update` is one update's loop over the stages (the driver's and push_weights').
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable
from typing import Any

from agentrl.rollout.client import EngineClient
from agentrl.sync.transport import StageRequest, StageResult

HEALTH_TIMEOUT_S = 5.0  # a live engine answers /health in milliseconds; a dead one refuses the connection
_SLACK_S = 5.0  # over a call's own HTTP timeout before the bridge gives up on its answer
STAGE_ATTEMPTS = 2  # a broken stage is sent once more to the engines that survived


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


class EngineLinks:
    """EngineClients of one sender, called from a worker thread through the actor's loop."""

    def __init__(self, urls: tuple[str, ...] | list[str], timeout_s: float, loop: asyncio.AbstractEventLoop):
        self.loop, self.timeout_s = loop, timeout_s
        self.clients = {u: EngineClient(u, timeout_s=timeout_s, control_timeout_s=timeout_s) for u in urls}
        self.failed: dict[str, str] = {}

    @property
    def live(self) -> list[str]:
        return [u for u in self.clients if u not in self.failed]

    def post(self, urls: list[str], call: Callable[[EngineClient], Awaitable[Any]]) -> dict[str, concurrent.futures.Future]:
        return {u: asyncio.run_coroutine_threadsafe(call(self.clients[u]), self.loop) for u in urls}

    def collect(self, futures: dict[str, concurrent.futures.Future]) -> dict[str, Any]:
        """Answers by url; an engine that errs or does not answer in time goes to `failed`."""
        out = {}
        for u, f in futures.items():
            try:
                out[u] = f.result(timeout=self.timeout_s + _SLACK_S)
            except concurrent.futures.TimeoutError:
                f.cancel()
                self.failed.setdefault(u, f"no answer within {self.timeout_s:g} s")
            except Exception as exc:  # noqa: BLE001 - an engine's error is recorded, never raised
                self.failed.setdefault(u, _why(exc))
        return out

    async def acollect(self, futures: dict[str, concurrent.futures.Future]) -> dict[str, Any]:
        """`collect` for a caller on the actor's loop itself (blocking there would starve the calls)."""
        out = {}
        for u, f in futures.items():
            try:
                out[u] = await asyncio.wait_for(asyncio.wrap_future(f), self.timeout_s + _SLACK_S)
            except TimeoutError:
                self.failed.setdefault(u, f"no answer within {self.timeout_s:g} s")
            except Exception as exc:  # noqa: BLE001 - an engine's error is recorded, never raised
                self.failed.setdefault(u, _why(exc))
        return out

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients.values()), return_exceptions=True)


class EngineSession:
    """Driver side of one update over `urls` (module docstring)."""

    def __init__(self, urls: list[str], *, pause_mode: str, timeout_s: float):
        self.pause_mode, self.timeout_s = pause_mode, timeout_s
        self.clients = {u: EngineClient(u, timeout_s=timeout_s, control_timeout_s=timeout_s) for u in urls}
        self.failed: dict[str, str] = {}
        self._begun: set[str] = set()

    @property
    def live(self) -> list[str]:
        return [u for u in self.clients if u not in self.failed]

    def fail(self, failed: dict[str, str]) -> None:
        for u, why in failed.items():
            if u in self.clients:
                self.failed.setdefault(u, why)

    async def _on_live(self, call: Callable[[EngineClient], Awaitable[Any]]) -> dict[str, Any]:
        urls = self.live
        answers = await asyncio.gather(*(call(self.clients[u]) for u in urls), return_exceptions=True)
        out = {}
        for u, a in zip(urls, answers, strict=True):
            if isinstance(a, BaseException):
                self.failed.setdefault(u, _why(a))
            else:
                out[u] = a
        return out

    async def open(self) -> None:
        await self._on_live(lambda c: c.pause_generation(self.pause_mode))
        self._begun = set(await self._on_live(lambda c: c.begin_weight_update()))

    async def alive(self, urls: list[str]) -> dict[str, bool]:
        """Whether each engine answers /health: tells an engine cut off by a broken transfer from a dead one."""
        async def probe(u: str) -> bool:
            async with EngineClient(u, timeout_s=HEALTH_TIMEOUT_S, control_timeout_s=HEALTH_TIMEOUT_S) as c:
                return await c.health()
        return dict(zip(urls, await asyncio.gather(*(probe(u) for u in urls)), strict=True))

    async def close(self, expect_tensors: int | None = None, expect_digest: str | None = None,
                    duplicates_allowed: bool = False) -> None:
        """End the session (checking receipts), continue the engines that took the update."""
        try:
            ends = await self._on_live(lambda c: c.end_weight_update())
            for u, body in ends.items():
                why = receipt_problem(body, expect_tensors, expect_digest, duplicates_allowed)
                if why:
                    self.failed.setdefault(u, why)
            # An engine dropped mid-update stays paused, but its session is closed.
            stranded = [u for u in self._begun if u in self.failed]
            await asyncio.gather(*(self.clients[u].end_weight_update() for u in stranded), return_exceptions=True)
            await self._on_live(lambda c: c.continue_generation())
        finally:
            await asyncio.gather(*(c.aclose() for c in self.clients.values()), return_exceptions=True)


def receipt_problem(body: Any, tensors: int | None, digest: str | None, duplicates_allowed: bool) -> str | None:
    """Why an engine's /end_weight_update receipt shows an incomplete update (None: complete, or
    the engine keeps no receipt, as SGLang does not)."""
    got = body.get("received") if isinstance(body, dict) else None
    if not isinstance(got, dict) or tensors is None:
        return None
    if got.get("distinct") != tensors or (digest is not None and got.get("names_digest") != digest):
        return (f"incomplete update: the engine received {got.get('distinct')} distinct tensors of the {tensors} "
                "sent (or other names)")
    if not duplicates_allowed and got.get("tensors") != tensors:
        return f"the engine received {got.get('tensors')} tensors for {tensors} distinct: some arrived twice"
    return None


def _xor_digests(digests: list[str]) -> str:
    acc = 0
    for d in digests:
        acc ^= int(d, 16)
    return f"{acc:032x}"


async def run_update(session: EngineSession, stages: int, request: Callable[[int, list[str]], StageRequest],
                     send: Callable[[StageRequest], Awaitable[StageResult]]) -> dict[str, Any]:
    """One update: open `session`, send stage 0..stages-1 in turn (`request(stage, live urls)`,
    `send(request)` -> the sender's StageResult), a broken stage once more to the survivors, close.
    Returns the run loop's keys (sync_s, sync_paused_s, sync_bytes, sync_buckets, sync_gbps,
    failed_engines) and sync_tensors, sync_retries."""
    t0 = time.perf_counter()
    t_paused, total_bytes, buckets, tensors, retries = t0, 0, 0, 0, 0
    digests: list[str] = []
    try:
        await session.open()
        t_paused = time.perf_counter()
        for stage in range(stages):
            for attempt in range(STAGE_ATTEMPTS):
                if not session.live:
                    break
                res = await send(request(stage, session.live))
                total_bytes, buckets = total_bytes + res.bytes, buckets + res.buckets
                if res.broken and attempt + 1 < STAGE_ATTEMPTS:
                    alive = await session.alive(list(res.failed))
                    session.fail({u: why for u, why in res.failed.items() if not alive[u]})
                    retries += 1
                    continue
                session.fail(res.failed)
                tensors += res.tensors
                digests.append(res.names_digest)
                break
    finally:
        complete = len(digests) == stages
        await session.close(tensors if complete else None, _xor_digests(digests) if complete else None,
                            duplicates_allowed=retries > 0)
    t1 = time.perf_counter()
    return {"sync_s": t1 - t0, "sync_paused_s": t1 - t_paused, "sync_bytes": total_bytes, "sync_buckets": buckets,
            "sync_gbps": total_bytes / max(t1 - t0, 1e-9) / 1e9, "sync_tensors": tensors, "sync_retries": retries,
            "failed_engines": dict(session.failed)}
