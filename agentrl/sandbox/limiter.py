"""Admission and retry policy for sandbox creation, free of any SDK.

`CreateLimiter` bounds how many creates run at once, how many start per minute, and holds every
caller back while the service is throttling us (one 429 pauses the whole process, not just the
caller that saw it: the quota is shared, so retrying alone would only feed the storm).
`Backoff` is the jittered exponential delay between retries.

One limiter is shared by every provider in one event loop (a Ray actor runs one loop), see
`shared_create_limiter`; asyncio primitives belong to a loop, so a limiter is never shared
across loops.
"""

from __future__ import annotations

import asyncio
import collections
import random
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

WINDOW_S = 60.0  # the per-minute budget is counted over a sliding window of this length


@dataclass(frozen=True)
class Backoff:
    """Jittered exponential backoff: attempt k (0-based) waits uniformly in
    [min_s, min(max_s, min_s * 2**(k+1))]. The first retry is already jittered, so a burst of
    callers throttled together does not come back together."""

    min_s: float
    max_s: float

    def __post_init__(self) -> None:
        if self.min_s < 0 or self.max_s < self.min_s:
            raise ValueError(
                f"backoff needs 0 <= retry_backoff_min_s <= retry_backoff_max_s, got {self.min_s}, {self.max_s}"
            )

    def delay(
        self, attempt: int, *, retry_after_s: float | None = None, rng: random.Random | None = None
    ) -> float:
        cap = min(self.max_s, self.min_s * (2.0 ** (attempt + 1)))
        d = (rng or random).uniform(self.min_s, max(cap, self.min_s))
        if retry_after_s is not None and retry_after_s > d:
            d = min(retry_after_s, self.max_s)  # the server knows best, within our ceiling
        return d


class CreateLimiter:
    """At most `max_concurrent` creates in flight, at most `per_minute` started in any 60 s
    window, and none started before a throttling pause has passed."""

    def __init__(
        self,
        max_concurrent: int,
        per_minute: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        if max_concurrent < 1 or per_minute < 1:
            raise ValueError(
                f"max_concurrent and per_minute must be >= 1, got {max_concurrent}, {per_minute}"
            )
        self.max_concurrent = max_concurrent
        self.per_minute = per_minute
        self._clock, self._sleep = clock, sleep
        self._slots = asyncio.Semaphore(max_concurrent)
        self._admit = asyncio.Lock()  # admission is serialised so the window check is exact
        self._starts: collections.deque[float] = collections.deque()
        self._paused_until = 0.0
        self.in_flight = 0
        self.max_in_flight = 0
        self.throttle_pauses = 0

    def pause(self, seconds: float) -> None:
        """Hold back every create not yet admitted for `seconds` (extends, never shortens)."""
        self._paused_until = max(self._paused_until, self._clock() + seconds)
        self.throttle_pauses += 1

    async def _wait_for_window(self) -> None:
        while True:
            now = self._clock()
            while self._starts and now - self._starts[0] >= WINDOW_S:
                self._starts.popleft()
            waits = [self._paused_until - now]
            if len(self._starts) >= self.per_minute:
                waits.append(self._starts[0] + WINDOW_S - now)
            wait = max(waits)
            if wait <= 0:
                self._starts.append(now)
                return
            await self._sleep(wait)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one create slot for the duration of the block."""
        async with self._slots:
            async with self._admit:
                await self._wait_for_window()
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                yield
            finally:
                self.in_flight -= 1

    def gauges(self) -> dict[str, float]:
        return {
            "creates_in_flight": self.in_flight,
            "creates_in_flight_max": self.max_in_flight,
            "create_throttle_pauses": self.throttle_pauses,
        }


_shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, CreateLimiter]] = (
    weakref.WeakKeyDictionary()
)
_shared_lock = threading.Lock()


def shared_create_limiter(key: str, max_concurrent: int, per_minute: int) -> CreateLimiter:
    """The limiter for `key` (one per service endpoint) in the running event loop, created on
    first use. Every provider of the loop that talks to the same endpoint shares it, so
    `max_concurrent` holds for the process however many providers it builds."""
    loop = asyncio.get_running_loop()
    with _shared_lock:
        per_loop = _shared.setdefault(loop, {})
        lim = per_loop.get(key)
        if lim is None or (lim.max_concurrent, lim.per_minute) != (max_concurrent, per_minute):
            if lim is not None and lim.in_flight:
                raise ValueError(
                    f"sandbox create limits for {key} changed while creates are in flight "
                    f"({lim.max_concurrent}/{lim.per_minute} -> {max_concurrent}/{per_minute}); "
                    "use one sandbox config per process"
                )
            lim = per_loop[key] = CreateLimiter(max_concurrent, per_minute)
        return lim
