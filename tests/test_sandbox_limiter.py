"""Create limiter and backoff policy (agentrl/sandbox/limiter.py): pure asyncio, no SDK."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from agentrl.sandbox.limiter import Backoff, CreateLimiter, shared_create_limiter


def test_backoff_bounds_grow_and_cap():
    b = Backoff(2.0, 30.0)
    rng = random.Random(0)
    for attempt, cap in [(0, 4.0), (1, 8.0), (2, 16.0), (3, 30.0), (10, 30.0)]:
        ds = [b.delay(attempt, rng=rng) for _ in range(200)]
        assert min(ds) >= 2.0 and max(ds) <= cap
        assert max(ds) > cap * 0.8  # really spread over the range: jitter, not a constant
    assert len({round(b.delay(0, rng=rng), 6) for _ in range(20)}) > 10


def test_backoff_honours_retry_after_within_ceiling():
    b = Backoff(0.1, 5.0)
    assert b.delay(0, retry_after_s=3.0) == 3.0
    assert b.delay(0, retry_after_s=100.0) == 5.0
    assert b.delay(0, retry_after_s=0.0) >= 0.1  # a smaller hint never shortens our own delay


def test_backoff_rejects_inverted_range():
    with pytest.raises(ValueError, match="retry_backoff_min_s"):
        Backoff(5.0, 1.0)


async def test_concurrency_never_exceeds_limit():
    lim = CreateLimiter(3, 10_000)
    inside = peak = 0

    async def one():
        nonlocal inside, peak
        async with lim.slot():
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0.01)
            inside -= 1

    await asyncio.gather(*(one() for _ in range(20)))
    assert peak == 3 and lim.max_in_flight == 3 and lim.in_flight == 0


async def test_per_minute_window_with_fake_clock():
    now = [1000.0]
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    lim = CreateLimiter(100, 3, clock=lambda: now[0], sleep=fake_sleep)
    for _ in range(3):
        async with lim.slot():
            now[0] += 1.0
    assert slept == []
    async with lim.slot():  # the 4th start waits until the first leaves the 60 s window
        pass
    assert slept and abs(now[0] - 1060.0) < 1e-6


async def test_pause_holds_back_new_creates():
    lim = CreateLimiter(8, 10_000)
    lim.pause(0.3)
    lim.pause(0.1)  # a shorter pause never shortens the current one
    t0 = time.monotonic()
    async with lim.slot():
        pass
    assert time.monotonic() - t0 >= 0.28
    assert lim.gauges()["create_throttle_pauses"] == 2


async def test_shared_limiter_is_one_per_endpoint_in_a_loop():
    a = shared_create_limiter("http://x", 4, 60)
    assert shared_create_limiter("http://x", 4, 60) is a
    assert shared_create_limiter("http://y", 4, 60) is not a


def test_shared_limiter_differs_across_loops():
    async def get():
        return shared_create_limiter("http://z", 2, 60)

    assert asyncio.run(get()) is not asyncio.run(get())
