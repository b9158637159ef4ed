"""An event simulation of the run loop's scheduling, the time half of the capacity model.

It replays what agentrl/orchestrator.py does with groups, without the model: async mode admits
groups whenever AdmissionControl's capacity allows ((max_staleness + version + 1) * B groups ever
started, at most `in_flight` episodes running) and the trainer takes the first B complete groups
as soon as it is free; sync mode starts one step's B groups, waits for all of them, trains, repeats.
A group completes when its slowest episode does. Episode durations are drawn from `draw()`, so
the same simulation takes measured durations (validation against the local runs) or an assumed
distribution (the 16-node plan). Staleness of a group = trainer version when trained - version
when it started (single-turn view: the first turn's tokens are the oldest).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoopShape:
    groups_per_step: int
    group_size: int
    max_staleness: int
    in_flight: int
    step_s: float  # trainer busy time per step: train step + weight sync
    steps: int


def simulate(mode: str, shape: LoopShape, draw: Callable[[], float]) -> dict:
    """Wall clock, trainer idle ratio and staleness of `shape.steps` steps in `mode`; `draw()`
    gives one episode's duration in seconds (it owns its random generator)."""
    if mode not in ("async", "sync"):
        raise ValueError(f"mode must be async or sync, got {mode!r}")
    if shape.in_flight < shape.group_size:
        raise ValueError(f"in_flight ({shape.in_flight}) must hold one group ({shape.group_size})")
    return _sync(shape, draw) if mode == "sync" else _async(shape, draw)


def _group_time(shape: LoopShape, draw: Callable[[], float]) -> float:
    return max(draw() for _ in range(shape.group_size))


def _sync(shape: LoopShape, draw: Callable[[], float]) -> dict:
    t = 0.0
    for _ in range(shape.steps):
        t += max(_group_time(shape, draw) for _ in range(shape.groups_per_step))
        t += shape.step_s
    busy = shape.steps * shape.step_s
    return {"wall_s": t, "trainer_idle_ratio": 1 - busy / t, "staleness": [0] * shape.steps * shape.groups_per_step}


def _async(shape: LoopShape, draw: Callable[[], float]) -> dict:
    p, n = shape.groups_per_step, shape.group_size
    t, version, started, running = 0.0, 0, 0, 0
    events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, start version)
    ready: list[int] = []  # start versions of complete groups, FIFO
    trainer_free_at: float | None = 0.0
    training_batch: list[int] = []
    staleness: list[int] = []
    steps_done, seq, busy, regenerated = 0, 0, 0.0, 0
    while steps_done < shape.steps:
        cap = min((shape.max_staleness + version + 1) * p - started, (shape.in_flight - running) // n)
        for _ in range(max(cap, 0)):
            started += 1
            running += n
            seq += 1
            heapq.heappush(events, (t + _group_time(shape, draw), seq, "group", version))
        if trainer_free_at is not None:
            # The buffer retires groups past the bound (regenerate policy): their slots reopen.
            fresh = [gv for gv in ready if version - gv <= shape.max_staleness]
            regenerated += len(ready) - len(fresh)
            started -= len(ready) - len(fresh)
            ready = fresh
        if trainer_free_at is not None and len(ready) >= p:
            training_batch, ready = ready[:p], ready[p:]
            seq += 1
            heapq.heappush(events, (t + shape.step_s, seq, "step", version))
            busy += shape.step_s
            trainer_free_at = None
        t, _, kind, v = heapq.heappop(events)
        if kind == "group":
            running -= n
            ready.append(v)
        else:
            version += 1
            steps_done += 1
            staleness += [version - 1 - gv for gv in training_batch]
            trainer_free_at = t
    return {"wall_s": t, "trainer_idle_ratio": 1 - busy / t, "staleness": staleness, "regenerated_groups": regenerated}


def lognormal_draw(median_s: float, sigma: float, cap_s: float, overhead_s: float = 0.0,
                   rng: random.Random | None = None) -> Callable[[], float]:
    """Episode durations: a fixed overhead plus lognormal(log median, sigma) capped at cap_s."""
    r = rng or random.Random(0)
    return lambda: overhead_s + min(cap_s, r.lognormvariate(math.log(median_s), sigma))


def empirical_draw(samples: list[float], rng: random.Random | None = None) -> Callable[[], float]:
    """Bootstrap from measured episode durations."""
    if not samples:
        raise ValueError("empirical_draw needs at least one measured duration")
    r = rng or random.Random(0)
    return lambda: r.choice(samples)


def summarize(result: dict, steps: int) -> dict:
    s = sorted(result["staleness"])
    pick = (lambda q: s[min(len(s) - 1, round(q * (len(s) - 1)))]) if s else (lambda q: None)
    return {"wall_s": result["wall_s"], "step_s": result["wall_s"] / steps,
            "trainer_idle_ratio": result["trainer_idle_ratio"], "staleness_p50": pick(0.5),
            "staleness_p95": pick(0.95), "staleness_max": s[-1] if s else None,
            "staleness_mean": statistics.fmean(s) if s else None,
            "regenerated_groups": result.get("regenerated_groups", 0)}
