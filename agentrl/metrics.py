"""Live run metrics for the Ray dashboard / Prometheus, through `ray.util.metrics`.

`RunMetrics` is built inside an actor or the driver after `ray.init` (importing this module
imports no Ray). Ray exports every series with its own `ray_` prefix, so `agentrl_reward_mean`
is scraped as `ray_agentrl_reward_mean` and a Counter `agentrl_episodes_finished` as
`ray_agentrl_episodes_finished_total`. Every series carries the tag `run` (the run id) so
that runs sharing a cluster stay apart.

Each update is one method, cheap (a few dict look-ups and Cython calls) and never raises into
the caller: metrics must not take a run down. A failed update is logged once per method.
`snapshot()` returns the values this process last recorded, for tests and debugging.
Measured with Ray 2.60: series recorded in an actor or in the driver reach the metrics export
port within ~1 s at metrics_report_interval_ms=500. Ray exports a histogram's `_sum` from
bucket midpoints, not the observed values (7.3 s and 100 s observed -> `_sum` 97.5): use its
buckets and `_count`; `snapshot()` keeps the exact sums.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# Staleness is a whole number of versions; half-integer bucket edges make each bucket hold
# exactly one lag value (le="0.5" counts lag 0, le="1.5" lag 1, ...).
STALENESS_BOUNDARIES = [0.5, 1.5, 2.5, 3.5, 4.5, 6.5, 8.5, 16.5, 32.5]
# Sandbox start-up: local bubblewrap boxes take well under a second, Daytona sandboxes from a
# cached image a few seconds, a fresh image build minutes.
SANDBOX_CREATE_BOUNDARIES = [0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0]
EPISODE_BOUNDARIES = [1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0]

# metrics.jsonl row key -> gauge name (set as-is by on_step).
STEP_GAUGES = {
    "step": "agentrl_step",
    "weight_version": "agentrl_weight_version",
    "reward_mean": "agentrl_reward_mean",
    "eval_pass_rate": "agentrl_eval_pass_rate",
    "staleness_max": "agentrl_staleness_max",
    "staleness_mean": "agentrl_staleness_mean",
    "step_time_s": "agentrl_trainer_step_seconds",
    "trainer_idle_ratio": "agentrl_trainer_idle_ratio",
    "gen_tokens_per_s": "agentrl_gen_tokens_per_s",
    "episodes_per_s": "agentrl_episodes_per_s",
    "tis_clip_frac": "agentrl_tis_clip_frac",
    "sync_s": "agentrl_weight_sync_seconds",
    "loss": "agentrl_loss",
    "grad_norm": "agentrl_grad_norm",
}


def _num(value: Any) -> float | None:
    """A finite float, or None for anything that is not a number (missing, None, NaN, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _never_raises(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self: RunMetrics, *args, **kwargs) -> None:
        try:
            method(self, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - a metric update must never break the run loop
            if method.__name__ not in self._warned:
                self._warned.add(method.__name__)
                log.warning(
                    "agentrl metrics: %s failed (%s: %s); further failures of it are not logged",
                    method.__name__,
                    type(err).__name__,
                    err,
                )

    return wrapper


class RunMetrics:
    """The run's Prometheus series. Construct once per process (actor or driver) after ray.init."""

    def __init__(self, run_id: str = "") -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.run_id = run_id
        self._warned: set[str] = set()
        self._values: dict[str, float] = {}
        self._engine_prev: dict[int, tuple[float, float]] = {}  # index -> (monotonic s, generated tokens)
        run = {"run": run_id}

        def gauge(name: str, doc: str, *tags: str) -> Any:
            return Gauge(name, doc, tag_keys=("run", *tags)).set_default_tags(run)

        self._gauges: dict[str, Any] = {
            name: gauge(name, f"metrics.jsonl field {key}") for key, name in STEP_GAUGES.items()
        }
        self._gauges.update(
            {
                "agentrl_trainer_tokens_per_s": gauge(
                    "agentrl_trainer_tokens_per_s", "loss tokens per second of a step"
                ),
                "agentrl_episodes_in_flight": gauge(
                    "agentrl_episodes_in_flight", "episodes admitted and not finished"
                ),
                "agentrl_tokens_in_flight": gauge(
                    "agentrl_tokens_in_flight", "tokens of running episodes (budget)"
                ),
                "agentrl_buffer_ready_groups": gauge(
                    "agentrl_buffer_ready_groups", "complete groups in the buffer"
                ),
                "agentrl_engine_tokens_per_s": gauge(
                    "agentrl_engine_tokens_per_s", "generated tokens/s", "engine"
                ),
                "agentrl_engine_queue_depth": gauge(
                    "agentrl_engine_queue_depth", "running + waiting requests", "engine"
                ),
                "agentrl_engine_weight_version": gauge(
                    "agentrl_engine_weight_version", "engine weights", "engine"
                ),
            }
        )
        self._episodes = Counter(
            "agentrl_episodes_finished",
            "episodes by outcome; kind is train or eval",
            tag_keys=("run", "outcome", "kind"),
        ).set_default_tags(run)
        self._generated = Counter(
            "agentrl_generated_tokens", "tokens sampled by the policy", tag_keys=("run", "kind")
        ).set_default_tags(run)
        self._sandbox_failures = Counter(
            "agentrl_sandbox_create_failures", "sandbox creations that failed", tag_keys=("run", "error")
        ).set_default_tags(run)
        self._sandbox_latency = Histogram(
            "agentrl_sandbox_create_seconds",
            "time to create a sandbox",
            SANDBOX_CREATE_BOUNDARIES,
            tag_keys=("run",),
        ).set_default_tags(run)
        self._staleness = Histogram(
            "agentrl_staleness",
            "per trained group: trainer version minus its oldest token's version",
            STALENESS_BOUNDARIES,
            tag_keys=("run",),
        ).set_default_tags(run)
        self._episode_s = Histogram(
            "agentrl_episode_seconds", "episode wall time", EPISODE_BOUNDARIES, tag_keys=("run", "kind")
        ).set_default_tags(run)

    # -- recording helpers (every value also lands in the snapshot) ----------------------------
    def _set(self, name: str, value: Any, tags: dict[str, str] | None = None) -> None:
        v = _num(value)
        if v is None:
            return
        self._gauges[name].set(v, tags=tags)
        self._values[_key(name, tags)] = v

    def _inc(self, counter: Any, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        if value > 0:
            counter.inc(value, tags=tags)
            key = _key(name, tags)
            self._values[key] = self._values.get(key, 0.0) + value

    def _observe(self, hist: Any, name: str, value: Any, tags: dict[str, str] | None = None) -> None:
        v = _num(value)
        if v is None:
            return
        hist.observe(v, tags=tags)
        for suffix, inc in (("_count", 1.0), ("_sum", v)):
            key = _key(name + suffix, tags)
            self._values[key] = self._values.get(key, 0.0) + inc

    def snapshot(self) -> dict[str, float]:
        """What this process recorded: gauges' last values, counters' and histograms' totals
        (`name_count`, `name_sum`); keys look like `agentrl_engine_queue_depth{engine="0"}`."""
        return dict(self._values)

    # -- updates -------------------------------------------------------------------------------
    @_never_raises
    def on_step(self, row: dict) -> None:
        """Everything derivable from one metrics.jsonl row (the orchestrator's `_record`)."""
        for key, name in STEP_GAUGES.items():
            self._set(name, row.get(key))
        tokens, seconds = _num(row.get("loss_tokens")), _num(row.get("step_time_s"))
        if tokens is not None and seconds:
            self._set("agentrl_trainer_tokens_per_s", tokens / seconds)
        for lag in row.get("staleness") or []:
            self._observe(self._staleness, "agentrl_staleness", lag)

    @_never_raises
    def on_episode(self, summary: dict) -> None:
        """One finished episode (the summary dict EpisodeWorker returns)."""
        kind = {"kind": "eval" if summary.get("evaluate") else "train"}
        self._inc(
            self._episodes,
            "agentrl_episodes_finished",
            1.0,
            {"outcome": str(summary.get("outcome", "unknown")), **kind},
        )
        generated = _num(summary.get("generated"))
        if generated:
            self._inc(self._generated, "agentrl_generated_tokens", generated, kind)
        self._observe(self._episode_s, "agentrl_episode_seconds", summary.get("duration_s"), kind)

    @_never_raises
    def on_episodes_lost(self, count: int, outcome: str = "infra_error:worker") -> None:
        """Episodes that ended without a summary (their worker died)."""
        self._inc(
            self._episodes, "agentrl_episodes_finished", float(count), {"outcome": outcome, "kind": "train"}
        )

    @_never_raises
    def set_in_flight(self, episodes: int, tokens: int | None = None) -> None:
        self._set("agentrl_episodes_in_flight", episodes)
        self._set("agentrl_tokens_in_flight", tokens)

    @_never_raises
    def set_buffer(self, ready_groups: int) -> None:
        self._set("agentrl_buffer_ready_groups", ready_groups)

    @_never_raises
    def on_sandbox_create(self, seconds: float | None, error: str | None = None) -> None:
        """One sandbox creation: its latency when it worked, its SandboxError kind when not."""
        if error is not None:
            self._inc(self._sandbox_failures, "agentrl_sandbox_create_failures", 1.0, {"error": str(error)})
        else:
            self._observe(self._sandbox_latency, "agentrl_sandbox_create_seconds", seconds)

    @_never_raises
    def set_engine(
        self,
        index: int,
        version: int | None = None,
        tokens_per_s: float | None = None,
        queue: int | None = None,
    ) -> None:
        tags = {"engine": str(index)}
        self._set("agentrl_engine_weight_version", version, tags)
        self._set("agentrl_engine_tokens_per_s", tokens_per_s, tags)
        self._set("agentrl_engine_queue_depth", queue, tags)

    @_never_raises
    def set_engine_from_server_info(self, index: int, info: dict, now: float | None = None) -> None:
        """Engine gauges from its `/server_info` JSON. The embedded engine reports cumulative
        `generated_tokens` and `num_running`/`num_waiting` in internal_states[0]; tokens/s is the
        rate between two calls for the same engine. SGLang's `last_gen_throughput` and
        `num_running_reqs`/`num_queue_reqs` are used when present instead."""
        now = time.monotonic() if now is None else now
        states = info.get("internal_states") or [{}]
        st = states[0] if isinstance(states[0], dict) else {}
        version = info.get("weight_version", st.get("weight_version"))
        version = (
            int(version) if isinstance(version, (int, str)) and str(version).lstrip("-").isdigit() else None
        )
        rate = _num(st.get("last_gen_throughput"))
        generated = _num(st.get("generated_tokens"))
        if rate is None and generated is not None:
            prev = self._engine_prev.get(index)
            if prev is not None and now > prev[0] and generated >= prev[1]:
                rate = (generated - prev[1]) / (now - prev[0])
            self._engine_prev[index] = (now, generated)
        parts = [
            _num(st.get(k)) for k in ("num_running", "num_waiting", "num_running_reqs", "num_queue_reqs")
        ]
        queue = sum(p for p in parts if p is not None) if any(p is not None for p in parts) else None
        self.set_engine(index, version, rate, queue)

    def wrap_provider(self, provider: Any) -> MeteredProvider:
        """`provider` (a SandboxProvider) with every `create` timed and its failures counted."""
        return MeteredProvider(provider, self)


class MeteredProvider:
    """A SandboxProvider that reports each `create` to RunMetrics and otherwise delegates."""

    def __init__(self, provider: Any, metrics: RunMetrics) -> None:
        self._provider, self._metrics = provider, metrics

    async def create(self, spec: Any) -> Any:
        start = time.perf_counter()
        try:
            box = await self._provider.create(spec)
        except Exception as err:
            self._metrics.on_sandbox_create(None, error=getattr(err, "kind", type(err).__name__))
            raise
        self._metrics.on_sandbox_create(time.perf_counter() - start)
        return box

    async def sweep(self) -> int:
        return await self._provider.sweep()

    async def aclose(self) -> None:
        await self._provider.aclose()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._provider, name)


def _key(name: str, tags: dict[str, str] | None) -> str:
    if not tags:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(tags.items())) + "}"
