"""Buffer, sandbox and weight-sync benches at tiny sizes: the counts match what was run, the rates are\nthe counts over the measured times, and nothing is left behind."""

import json
import shutil

import pytest

from bench.buffer import run_buffer_bench
from bench.sandbox import run_sandbox_bench


def test_buffer_bench_measures_both_durability_settings(tmp_path):
    out = tmp_path / "buffer.json"
    r = run_buffer_bench(out, groups=4, group_size=2, groups_per_step=2, tokens=64, directory=tmp_path)
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    on, off = r["fsync_on"], r["fsync_off"]
    assert on["fsync"] and not off["fsync"]
    for m in (on, off):
        assert m["trajectories"] == m["served_trajectories"] == 8 and m["serve_steps"] == 2  # 4 groups of 2,
        # 2 groups per step: every trajectory ingested was served once
        assert m["groups_ready_after_recovery"] == 0  # everything served was marked trained, durably
        # the rates are the counts over the measured times
        assert m["ingest_traj_per_s"] == pytest.approx(m["trajectories"] / m["ingest_s"])
        assert m["ms_per_add"] == pytest.approx(m["ingest_s"] / m["trajectories"] * 1e3)
        assert m["ingest_mb_per_s"] == pytest.approx(m["log_mb"] / m["ingest_s"])
        assert m["log_mb"] * 1e6 > m["trajectories"] * 64 * 2  # 64 token ids and as many logprobs each
    assert on["log_mb"] == off["log_mb"]  # the same trajectories make the same log, fsync or not
    assert r["durability_cost_x"] == pytest.approx(on["ingest_s"] / off["ingest_s"])
    assert r["fsync_ms_per_add"] == pytest.approx(on["ms_per_add"] - off["ms_per_add"])
    assert list(tmp_path.iterdir()) == [out]  # its temp log folder is gone


def _check_cycles(b: dict, rounds: int, concurrency: int) -> None:
    """The counts match what was run, and the summary statistics are consistent."""
    seq, par = b["sequential"], b["concurrent"]
    assert seq["cycles"] == rounds and par["cycles"] == par["sandboxes"] == concurrency
    for stats in (seq, par):
        for phase in ("create", "exec", "delete"):
            assert 0 < stats[f"{phase}_ms_median"] <= stats[f"{phase}_ms_p90"]
    assert par["sandboxes_per_s"] == pytest.approx(concurrency / par["wall_s"])
    # all sandboxes at once take at least one cycle's create + execs + delete of wall time
    assert par["wall_s"] * 1e3 >= par["create_ms_median"] + par["delete_ms_median"]


def test_buffer_bench_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="tokens"):
        run_buffer_bench(tmp_path / "x.json", tokens=0)


def test_sandbox_bench_daytona_standin_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.delenv("DAYTONA_API_KEY", raising=False)
    r = run_sandbox_bench(tmp_path / "s.json", rounds=1, execs=3, concurrency=2, backends=("daytona",))
    d = r["backends"]["daytona_standin"]
    _check_cycles(d, rounds=1, concurrency=2)
    # what the stand-in saw: every cycle created and deleted one sandbox and ran `execs` commands
    assert d["standin_created"] == d["standin_deleted"] == 1 + 2 and d["left_behind"] == 0
    assert d["standin_commands"] == (1 + 2) * 3
    import os

    assert "DAYTONA_API_KEY" not in os.environ  # the stand-in's key was put back


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_sandbox_bench_local(tmp_path):
    r = run_sandbox_bench(tmp_path / "s.json", rounds=2, execs=2, concurrency=2, backends=("local",))
    loc = r["backends"]["local"]
    _check_cycles(loc, rounds=2, concurrency=2)
    assert loc["left_behind"] == 0  # every sandbox folder removed


def test_sandbox_bench_rejects_unknown_backend(tmp_path):
    with pytest.raises(ValueError, match="backends"):
        run_sandbox_bench(tmp_path / "s.json", backends=("docker",))


@pytest.mark.slow
def test_weight_sync_bench_updates_the_engine(tmp_path):
    from agentrl.models.policy import load_policy
    from bench.weight_sync import run_weight_sync_bench

    r = run_weight_sync_bench(tmp_path / "w.json", models=("tiny",), rounds=2)
    m = r["models"]["tiny"]
    assert m["engine_weight_version"] == "1001" and m["rounds"] == 2  # the second update took effect
    model, _ = load_policy("tiny")
    assert m["bytes"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert m["gbps_median"] == pytest.approx(m["bytes"] / m["sync_s_median"] / 1e9)
    assert m["gbps_best"] >= m["gbps_median"] and m["sync_s_min"] <= m["sync_s_median"]
    assert m["sync_paused_s_median"] <= m["sync_s_median"]  # the engine pauses only within the update


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (the local sandbox)")
def test_episode_host_bench_plays_real_episodes_and_reports_their_phases(tmp_path):
    from bench.episode_host import main

    out = tmp_path / "episode_host.json"
    assert main(["--config", "gpu_smollm2", "--set", "model.name=tiny", "--episodes", "3", "--concurrency", "2",
                 "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["outcomes"] == {"scored": 3}  # played to the tests' verdict: real sandboxes, real scoring
    assert r["tasks"] == 272  # gpu_smollm2's whole training pool
    assert r["episodes_per_s"] == pytest.approx(3 / r["wall_s"], rel=0.02)
    for phase in ("env_s", "score_s", "close_s", "total_s"):
        q = r["phase_s"][phase]
        assert 0 < q["median"] <= q["p90"] <= r["phase_s"]["total_s"]["p90"]
    assert r["children_cpu_ms_per_episode"] > 0  # the sandboxes ran as child processes
