"""Async vs sync, side by side: the same workload through the real run loop in both modes.

Workload: the tiny GLM, the `lognormal` env (each episode sleeps a lognormal time inside a real
local bubblewrap sandbox; reward is a learnable rule on the reply), the same number of optimizer
steps of the same batch size in both modes, so both train the same number of trajectories.

Why async should win here: a sync step waits for the slowest of its B episodes (with sigma = 1 the
maximum of 32 lognormal draws is ~8x the median) and generation stops while the trainer works;
async keeps up to `in_flight` episodes running and the trainer takes the first complete groups.
Async is bounded by max_staleness (AReaL's capacity formula), so its episodes see older weights:
the report gives the staleness distribution and final reward next to the speedup.

Measured over the loop only (after Ray, engine and trainer are up, which both modes pay alike):
wall clock to the last optimizer step, trained samples/hour, trainer idle ratio (1 - time in
train step + weight sync / wall), rollout occupancy (time-averaged episodes in flight /
in_flight), engine busy ratio (sampled: a generate request running or queued while the engine is not
paused) and its complement the engine (rollout) idle ratio, staleness p50/p95/max.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.lognormal_env import ENV_NAME
from bench.machine import machine

GOAL_SPEEDUP = 2.5
GOAL_TRAINER_IDLE = 0.10
SAMPLE_EVERY_S = 0.25


@dataclass(frozen=True)
class Workload:
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 4
    median_s: float = 2.0  # episode duration: lognormal median
    sigma: float = 1.0  # lognormal shape; 1.0 puts the max of 32 draws at ~8x the median
    max_s: float = 30.0  # the episode time limit
    max_staleness: int = 4
    in_flight: int = 96  # async: episodes at once (sync runs one step's batch at a time)
    max_new_tokens: int = 4  # the reward reads the first letter; the engine is 1 CPU thread
    lr: float = 2e-2
    context_words: int = 0  # per-task prompt text: makes the trainer's step longer, like long trajectories
    seed: int = 0

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.group_size

    def check(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "in_flight", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload.{name} must be >= 1, got {getattr(self, name)}")
        if self.median_s <= 0 or self.max_s <= 0 or self.sigma < 0 or self.max_staleness < 0:
            raise ValueError("workload: need median_s > 0, max_s > 0, sigma >= 0, max_staleness >= 0")
        if self.in_flight < self.group_size:
            raise ValueError(f"workload.in_flight ({self.in_flight}) must hold one group ({self.group_size})")


def overrides(w: Workload, mode: str, run_dir: Path) -> list[str]:
    """The `--set` list that turns the local recipe into this workload in `mode`."""
    kwargs = {"median_s": w.median_s, "sigma": w.sigma, "max_s": w.max_s, "num_tasks": 8, "seed": w.seed,
              "context_words": w.context_words}
    return [
        f"mode={mode}", f"seed={w.seed}", f"logging.run_dir={run_dir}", "cluster.dashboard=false",
        f"env.name={ENV_NAME}", f"env.kwargs={json.dumps(kwargs)}", "env.eval_every=0",
        "agent.action_format=text", "agent.max_turns=1", f"agent.episode_timeout_s={w.max_s + 120}",
        f"rollout.max_new_tokens={w.max_new_tokens}", "rollout.embedded.max_batch_size=64",
        f"algorithm.group_size={w.group_size}", f"algorithm.prompts_per_step={w.prompts_per_step}",
        f"train.max_steps={w.steps}", f"train.checkpoint_every={w.steps}", f"train.optimizer.lr={w.lr}",
        "train.optimizer.weight_decay=0.0", f"buffer.max_staleness={w.max_staleness}",
        f"buffer.max_episodes_in_flight={w.in_flight}",
    ]


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def _run_mode(w: Workload, mode: str, run_dir: Path, recipe: str = "local",
                    extra: tuple[str, ...] = ()) -> dict[str, Any]:
    from agentrl.config.loader import load_config

    cfg = load_config(recipe, overrides(w, mode, run_dir) + list(extra))
    orch, rows, samples, summary = await timed_run(cfg, run_dir)
    return _summarize(w, mode, orch, rows, samples, summary)


async def timed_run(cfg: Any, run_dir: Path) -> tuple[Any, list[dict], list[dict], dict]:
    """The real run loop on `cfg`, timed from the end of start-up to the last recorded step, with a
    load sampler (episodes in flight, engine 0 busy, a train step in flight) every SAMPLE_EVERY_S.
    Returns (orchestrator, metrics rows, samples, summary)."""
    from agentrl.config.plan import resolve_plan
    from agentrl.orchestrator import Orchestrator

    plan = resolve_plan(cfg)
    samples: list[dict[str, float]] = []

    class Timed(Orchestrator):
        """The run loop, timed from the end of start-up to the last recorded step, with a load sampler."""

        async def _start(self) -> None:
            await super()._start()
            self.loop_started = time.perf_counter()
            self.loop_ended = self.loop_started
            self.load_sampler = asyncio.create_task(self._sample())

        def _record(self, metrics: dict, started: float) -> dict:
            row = super()._record(metrics, started)
            self.loop_ended = time.perf_counter()
            self.step_ends.append(self.loop_ended - self.loop_started)
            return row

        async def _sample(self) -> None:
            while True:
                info = {}
                try:
                    info = (await self.engines.server_info(0))["internal_states"][0]
                except Exception as err:  # noqa: BLE001 - an engine between restarts counts as idle
                    info = {"error": str(err)}
                # busy: requests to run and not paused for a weight update (paused, they only wait)
                queued = info.get("num_running", 0) + info.get("num_waiting", 0) > 0
                samples.append({"t": time.perf_counter(), "running": self.admission.running_episodes,
                                "engine_busy": float(queued and not info.get("paused")),
                                "training": float(self._training is not None)})
                await asyncio.sleep(SAMPLE_EVERY_S)

    orch = Timed(cfg, plan)
    orch.step_ends = []
    orch.run_began = time.perf_counter()
    try:
        summary = await orch.run()
    finally:
        if getattr(orch, "load_sampler", None):  # absent when start-up failed
            orch.load_sampler.cancel()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return orch, rows, samples, summary


def _summarize(w: Workload, mode: str, orch: Any, rows: list[dict], samples: list[dict], summary: dict) -> dict:
    wall = orch.loop_ended - orch.loop_started
    in_loop = [s for s in samples if orch.loop_started <= s["t"] <= orch.loop_ended]
    staleness = [int(x) for r in rows for x in r.get("staleness", [])]
    episodes = _transcripts(Path(orch.run_dir))
    durations = [float(e["duration_s"]) for e in episodes]
    rewards = [r["reward_mean"] for r in rows]
    tail = max(1, len(rewards) // 4)
    trained = len(rows) * w.batch
    return {
        "mode": mode, "steps": len(rows), "trained_samples": trained, "wall_s": wall,
        "startup_s": orch.loop_started - orch.run_began,
        "trained_samples_per_hour": trained / wall * 3600 if wall > 0 else None,
        "step_s_mean": wall / len(rows) if rows else None,
        "trainer_busy_s": orch.trainer_busy_s, "trainer_idle_ratio": max(0.0, 1 - orch.trainer_busy_s / wall),
        "trainer_idle_ratio_after_first_step": _idle_after_first(rows, orch.step_ends),
        "train_step_s_mean": statistics.fmean(r["step_time_s"] for r in rows if "step_time_s" in r),
        "weight_sync_s_mean": statistics.fmean(r["sync_s"] for r in rows if "sync_s" in r),
        "rollout_occupancy": (statistics.fmean(s["running"] for s in in_loop) / w.in_flight) if in_loop else None,
        "episodes_in_flight_mean": statistics.fmean(s["running"] for s in in_loop) if in_loop else None,
        "engine_busy_ratio": statistics.fmean(s["engine_busy"] for s in in_loop) if in_loop else None,
        # verl's pair: the trainer's idle share and the rollout engines' (engine 0 with nothing to run)
        "engine_idle_ratio": 1 - statistics.fmean(s["engine_busy"] for s in in_loop) if in_loop else None,
        "staleness_p50": _percentile(staleness, 50), "staleness_p95": _percentile(staleness, 95),
        "staleness_max": max(staleness) if staleness else None,
        "staleness_histogram": {str(k): staleness.count(k) for k in sorted(set(staleness))},
        "reward_first": rewards[0] if rewards else None, "reward_final": statistics.fmean(rewards[-tail:]),
        "rewards": rewards, "episode_s_median": _percentile(durations, 50), "episode_s_p95": _percentile(durations, 95),
        "episode_s_max": max(durations) if durations else None, "episodes_finished": len(durations),
        "episode_phase_s_mean": _episode_timings(episodes),
        "episode_durations_s": [round(d, 3) for d in durations],
        "buffer": summary.get("buffer", {}).get("counters", summary.get("buffer")),
        "step_ends_s": orch.step_ends,
    }


def _idle_after_first(rows: list[dict], step_ends: list[float]) -> float | None:
    """Idle ratio from the end of step 1 on (steady state, without the pipeline's fill-up). Busy is
    the training stage's own clock (the rows' cumulative `trainer_busy_s`: batch, step, weight push,
    checkpoint), the one `trainer_idle_ratio` uses; rows without it (runs before 2026-12-01) fall
    back to train step + weight sync as the trainer reports them, a narrower busy."""
    if len(rows) < 2 or len(step_ends) < 2:
        return None
    if all("trainer_busy_s" in r for r in rows):
        busy = rows[-1]["trainer_busy_s"] - rows[0]["trainer_busy_s"]
    else:
        busy = sum(r.get("step_time_s", 0.0) + r.get("sync_s", 0.0) for r in rows[1:])
    return max(0.0, 1 - busy / (step_ends[-1] - step_ends[0]))


def _transcripts(run_dir: Path) -> list[dict]:
    out = []
    for f in sorted((run_dir / "transcripts").glob("*.jsonl")):
        out += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return out


def _episode_timings(episodes: list[dict]) -> dict[str, float]:
    """Mean seconds per episode in each phase the agent times (generate, env incl. reset, score)."""
    keys = sorted({k for e in episodes for k in e.get("timings", {})})
    return {k: statistics.fmean(e.get("timings", {}).get(k, 0.0) for e in episodes) for k in keys} if episodes else {}


def run_async_vs_sync(out_path: str | Path, workload: Workload = Workload(), work_dir: str | Path | None = None,
                      modes: tuple[str, ...] = ("sync", "async"), recipe: str = "local",
                      extra: tuple[str, ...] = (), what: str | None = None) -> dict:
    """Run every mode of `modes` one after the other on `workload`; write the JSON report and PNG.
    `recipe` and `extra` (--set items after the workload's) place the run elsewhere (bench/gpu/async_vs_sync_gpu.py)."""
    workload.check()
    if set(modes) - {"sync", "async"} or not modes:
        raise ValueError(f"modes must be among sync, async; got {modes}")
    out_path = Path(out_path)
    report: dict[str, Any] = {"benchmark": "async_vs_sync", "machine": machine(), "workload": asdict(workload),
                              "goal": {"speedup": GOAL_SPEEDUP, "trainer_idle_ratio_async": GOAL_TRAINER_IDLE},
                              "recipe": recipe, "overrides": list(extra), "modes": {}}
    if what:
        report["what"] = what
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agentrl-async-vs-sync-", dir=work_dir) as tmp:
        for mode in modes:
            t0 = time.perf_counter()
            result = asyncio.run(_run_mode(workload, mode, Path(tmp) / mode, recipe, extra))
            result["total_s"] = time.perf_counter() - t0
            report["modes"][mode] = result
            report.update(_headline(report["modes"]))
            # Written after every mode: a run cut short by a time limit keeps the modes it finished.
            out_path.write_text(json.dumps(report, indent=2) + "\n")
            print(f"{mode}: {result['wall_s']:.1f} s loop, {result['total_s']:.1f} s with start-up", flush=True)
    try:
        plot_async_vs_sync(report, out_path.with_suffix(".png"))
    except ImportError as err:  # the GPU machine has no matplotlib; the JSON is the result
        print(f"no plot: {err}", flush=True)
    return report


def _headline(modes: dict[str, dict]) -> dict:
    a, s = modes.get("async"), modes.get("sync")
    head: dict[str, Any] = {}
    if a:
        head.update(trainer_idle_ratio_async=a["trainer_idle_ratio"], staleness_p95=a["staleness_p95"],
                    staleness_p50=a.get("staleness_p50"),
                    trainer_idle_ratio_async_after_first_step=a["trainer_idle_ratio_after_first_step"],
                    reward_final_async=a["reward_final"], engine_idle_ratio_async=a.get("engine_idle_ratio"),
                    episodes_in_flight_mean_async=a.get("episodes_in_flight_mean"))
        idle = [x for x in (a["trainer_idle_ratio"], a.get("engine_idle_ratio")) if x is not None]
        # The bottleneck stage is the less idle one: the trainer when rollouts keep ahead, the engines
        # when training is the slower side.
        head["bottleneck_idle_ratio_async"] = min(idle)
    if s:
        head.update(trainer_idle_ratio_sync=s["trainer_idle_ratio"], reward_final_sync=s["reward_final"])
    if a and s:
        head["speedup"] = s["wall_s"] / a["wall_s"]
        head["goal_met"] = head["speedup"] >= GOAL_SPEEDUP and a["trainer_idle_ratio"] <= GOAL_TRAINER_IDLE
        head["goal_met_bottleneck"] = head["speedup"] >= GOAL_SPEEDUP and head["bottleneck_idle_ratio_async"] <= GOAL_TRAINER_IDLE
    return head


def plot_async_vs_sync(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4))
    for mode, r in report["modes"].items():
        steps = list(range(1, len(r["step_ends_s"]) + 1))
        ax1.plot(r["step_ends_s"], steps, marker="o", label=mode)
        ax2.plot(steps, r["rewards"], marker="o", label=mode)
    ax1.set(xlabel="seconds since the loop started", ylabel="optimizer step", title="progress")
    ax2.set(xlabel="optimizer step", ylabel="mean reward", title="reward")
    names = list(report["modes"])
    ax3.bar([f"{m}\nidle" for m in names], [report["modes"][m]["trainer_idle_ratio"] for m in names])
    ax3.set(ylim=(0, 1), title=f"trainer idle ratio (speedup {report.get('speedup', float('nan')):.2f}x)")
    for ax in (ax1, ax2):
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
