"""RunMetrics: what each update records, that updates never raise, and (slow) that the series
reach Ray's Prometheus endpoint from inside an actor."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from agentrl.metrics import RunMetrics

ROW = {
    "step": 7,
    "weight_version": 7,
    "reward_mean": 0.375,
    "staleness_max": 2,
    "staleness_mean": 0.75,
    "staleness": [0, 0, 1, 2],
    "episodes_infra_error": 1,
    "episodes_finished": 40,
    "outcomes": {"scored": 39},
    "episodes_per_s": 1.5,
    "gen_tokens_per_s": 812.0,
    "trainer_idle_ratio": 0.25,
    "sync_s": 0.4,
    "tis_clip_frac": 0.0125,
    "loss": -0.02,
    "grad_norm": 0.9,
    "loss_tokens": 3000,
    "step_time_s": 1.5,
    "eval_pass_rate": 0.5,
    "eval_version": 5,
}


def test_importing_the_module_does_not_import_ray():
    code = "import sys, agentrl.metrics; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_on_step_sets_every_gauge_derivable_from_a_row():
    m = RunMetrics("run-a")
    m.on_step(ROW)
    s = m.snapshot()
    assert s["agentrl_reward_mean"] == 0.375
    assert s["agentrl_tis_clip_frac"] == 0.0125
    assert s["agentrl_trainer_idle_ratio"] == 0.25
    assert s["agentrl_trainer_step_seconds"] == 1.5
    assert s["agentrl_trainer_tokens_per_s"] == 2000.0
    assert s["agentrl_gen_tokens_per_s"] == 812.0
    assert s["agentrl_weight_version"] == 7
    assert s["agentrl_eval_pass_rate"] == 0.5
    assert s["agentrl_staleness_count"] == 4 and s["agentrl_staleness_sum"] == 3


def test_missing_fields_are_skipped_not_zeroed():
    m = RunMetrics("run-b")
    m.on_step({"step": 1, "reward_mean": None, "loss": float("nan")})
    s = m.snapshot()
    assert s == {"agentrl_step": 1.0}


def test_episode_outcomes_are_counted_by_outcome_and_kind():
    m = RunMetrics("run-c")
    m.on_episode({"outcome": "scored", "generated": 100, "duration_s": 3.0})
    m.on_episode({"outcome": "scored", "generated": 50, "duration_s": 5.0})
    m.on_episode({"outcome": "infra_error:create", "generated": 0, "duration_s": 1.0})
    m.on_episode({"outcome": "scored", "generated": 10, "duration_s": 1.0, "evaluate": True})
    m.on_episodes_lost(4)
    s = m.snapshot()
    assert s['agentrl_episodes_finished{kind="train",outcome="scored"}'] == 2
    assert s['agentrl_episodes_finished{kind="train",outcome="infra_error:create"}'] == 1
    assert s['agentrl_episodes_finished{kind="eval",outcome="scored"}'] == 1
    assert s['agentrl_episodes_finished{kind="train",outcome="infra_error:worker"}'] == 4
    assert s['agentrl_generated_tokens{kind="train"}'] == 150
    assert s['agentrl_episode_seconds_sum{kind="train"}'] == 9.0


def test_updates_never_raise_and_warn_once(caplog):
    m = RunMetrics("run-d")
    with caplog.at_level(logging.WARNING, logger="agentrl.metrics"):
        m.on_step({"staleness": 5})  # not a list
        m.on_step({"staleness": 5})
        m.on_episode(None)  # type: ignore[arg-type]
        m.set_engine("x", version="v")  # type: ignore[arg-type]
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("on_step failed" in w for w in warnings) == 1
    assert sum("on_episode failed" in w for w in warnings) == 1


def test_engine_gauges_from_embedded_server_info():
    m = RunMetrics("run-e")

    def info(generated, running, waiting, version):
        return {
            "weight_version": version,
            "internal_states": [
                {"generated_tokens": generated, "num_running": running, "num_waiting": waiting}
            ],
        }

    m.set_engine_from_server_info(0, info(1000, 3, 2, 4), now=10.0)
    s = m.snapshot()
    assert s['agentrl_engine_queue_depth{engine="0"}'] == 5
    assert s['agentrl_engine_weight_version{engine="0"}'] == 4
    assert 'agentrl_engine_tokens_per_s{engine="0"}' not in s  # no rate from one sample
    m.set_engine_from_server_info(0, info(1600, 1, 0, "5"), now=12.0)
    s = m.snapshot()
    assert s['agentrl_engine_tokens_per_s{engine="0"}'] == 300.0
    assert s['agentrl_engine_weight_version{engine="0"}'] == 5
    m.set_engine(1, version=3, tokens_per_s=12.5, queue=0)
    assert m.snapshot()['agentrl_engine_queue_depth{engine="1"}'] == 0


class _Provider:
    def __init__(self, fail: bool):
        self.fail, self.swept = fail, 0

    async def create(self, spec):
        await asyncio.sleep(0.01)
        if self.fail:
            from agentrl.sandbox.base import SandboxError

            raise SandboxError("throttled", "429 from the API")
        return f"box-for-{spec}"

    async def sweep(self):
        self.swept += 1
        return 0

    async def aclose(self):
        return None


async def test_metered_provider_times_creates_and_counts_failures():
    from agentrl.sandbox.base import SandboxError

    m = RunMetrics("run-f")
    ok = m.wrap_provider(_Provider(fail=False))
    assert await ok.create("spec") == "box-for-spec"
    await ok.sweep()
    assert ok.swept == 1  # attribute access reaches the wrapped provider
    bad = m.wrap_provider(_Provider(fail=True))
    with pytest.raises(SandboxError):
        await bad.create("spec")
    s = m.snapshot()
    assert s["agentrl_sandbox_create_seconds_count"] == 1
    assert 0.005 < s["agentrl_sandbox_create_seconds_sum"] < 5
    assert s['agentrl_sandbox_create_failures{error="throttled"}'] == 1


# -- the real thing: Ray's metrics agent exports what an actor recorded -------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sample(body: str, name: str, **labels: str) -> float | None:
    for line in body.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.slow  # a local Ray takes ~5 s to start (30 s on a loaded 2-core machine)
def test_series_reach_the_prometheus_endpoint(monkeypatch):
    import ray

    class MetricsActor:  # defined here so Ray ships it by value to the worker
        def __init__(self, run_id: str):
            self.m = RunMetrics(run_id)

        def record(self, row: dict) -> None:
            self.m.on_step(row)
            self.m.on_episode({"outcome": "infra_error:create", "generated": 0, "duration_s": 2.0})
            self.m.set_engine(1, version=6, tokens_per_s=250.0, queue=3)
            self.m.set_in_flight(12)
            self.m.set_buffer(2)

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # restored (or removed) after the test
    port = _free_port()
    ray.init(
        address="local",  # a new instance even when another `ray start` cluster runs on this machine
        num_cpus=1,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _metrics_export_port=port,
        _system_config={"metrics_report_interval_ms": 500},
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        actor = ray.remote(MetricsActor).options(num_cpus=0).remote("run-ray")
        ray.get(actor.record.remote(ROW), timeout=60)
        recorded, body, deadline = time.monotonic(), "", time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:  # the metrics agent may still be starting
                time.sleep(0.2)
                continue
            if (
                _sample(body, "ray_agentrl_reward_mean", run="run-ray") is not None
                and _sample(body, "ray_agentrl_episodes_finished_total", run="run-ray") is not None
            ):
                break
            time.sleep(0.2)
        print(f"series visible {time.monotonic() - recorded:.1f} s after recording")
        assert _sample(body, "ray_agentrl_reward_mean", run="run-ray") == 0.375
        assert _sample(body, "ray_agentrl_tis_clip_frac", run="run-ray") == 0.0125
        assert _sample(body, "ray_agentrl_trainer_idle_ratio", run="run-ray") == 0.25
        assert _sample(body, "ray_agentrl_engine_weight_version", run="run-ray", engine="1") == 6
        assert _sample(body, "ray_agentrl_engine_queue_depth", run="run-ray", engine="1") == 3
        assert _sample(body, "ray_agentrl_episodes_in_flight", run="run-ray") == 12
        assert (
            _sample(
                body,
                "ray_agentrl_episodes_finished_total",
                run="run-ray",
                outcome="infra_error:create",
                kind="train",
            )
            == 1
        )
        assert _sample(body, "ray_agentrl_staleness_count", run="run-ray") == 4
        assert _sample(body, "ray_agentrl_staleness_bucket", run="run-ray", le="0.5") == 2
        assert re.search(r"^# TYPE ray_agentrl_staleness histogram$", body, re.MULTILINE)
    finally:
        ray.shutdown()
