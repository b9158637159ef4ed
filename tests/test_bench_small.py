"""Buffer, sandbox and weight-sync benches at tiny sizes: they run, count what they did, and clean up."""

import json
import shutil

import pytest

from bench.buffer import run_buffer_bench
from bench.sandbox import run_sandbox_bench


def test_buffer_bench_measures_both_durability_settings(tmp_path):
    out = tmp_path / "buffer.json"
    r = run_buffer_bench(out, groups=4, group_size=2, groups_per_step=2, tokens=64, directory=tmp_path)
    assert json.loads(out.read_text())["benchmark"] == "buffer"
    for key in ("fsync_on", "fsync_off"):
        m = r[key]
        assert m["trajectories"] == 8 and m["serve_steps"] == 2 and m["log_mb"] > 0
        assert m["ingest_traj_per_s"] > 0 and m["recover_s"] > 0
    assert r["fsync_on"]["fsync"] and not r["fsync_off"]["fsync"]
    assert r["durability_cost_x"] > 0
    assert list(tmp_path.iterdir()) == [out]  # its temp log folder is gone


def test_buffer_bench_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="tokens"):
        run_buffer_bench(tmp_path / "x.json", tokens=0)


def test_sandbox_bench_daytona_standin_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.delenv("DAYTONA_API_KEY", raising=False)
    r = run_sandbox_bench(tmp_path / "s.json", rounds=1, execs=1, concurrency=2, backends=("daytona",))
    d = r["backends"]["daytona_standin"]
    assert d["left_behind"] == 0 and d["sequential"]["create_ms_median"] > 0 and d["concurrent"]["sandboxes"] == 2
    import os

    assert "DAYTONA_API_KEY" not in os.environ  # the stand-in's key was put back


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_sandbox_bench_local(tmp_path):
    r = run_sandbox_bench(tmp_path / "s.json", rounds=1, execs=2, concurrency=2, backends=("local",))
    loc = r["backends"]["local"]
    assert loc["sequential"]["exec_ms_median"] > 0 and loc["concurrent"]["sandboxes_per_s"] > 0


def test_sandbox_bench_rejects_unknown_backend(tmp_path):
    with pytest.raises(ValueError, match="backends"):
        run_sandbox_bench(tmp_path / "s.json", backends=("docker",))


@pytest.mark.slow
def test_weight_sync_bench_updates_the_engine(tmp_path):
    from bench.weight_sync import run_weight_sync_bench

    r = run_weight_sync_bench(tmp_path / "w.json", models=("tiny",), rounds=2)
    m = r["models"]["tiny"]
    assert m["engine_weight_version"] == "1001" and m["bytes"] > 1e6 and m["gbps_median"] > 0
