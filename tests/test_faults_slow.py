"""Fault scenarios that need full local training runs (minutes each; `-m slow`). The engine killed
mid-run is tests/test_local_run.py::test_engine_killed_mid_run_is_restarted_and_never_rewarded,
which `agentrl bench faults` also runs as engine_killed_mid_generation; it is not repeated here."""

from __future__ import annotations

import shutil

import pytest

from bench.faults import run_scenario, select

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="local runs need bubblewrap")]


@pytest.mark.parametrize("name", ["worker_episode_worker_killed", "worker_trainer_killed_then_resumed",
                                  "worker_launcher_ctrl_c", "security_secret_scan_of_a_run"])
def test_full_run_scenario(name):
    (s,) = select([name])
    e = run_scenario(s)
    assert e["passed"], (e["observed"], {k: v for k, v in e["details"].items() if "stderr" in k})
    assert e["trajectories_lost"] == 0
