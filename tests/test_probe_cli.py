"""bench/gpu/probe_cli.py: the report row each GPU probe writes per schedule (timed here with do_bench
replaced, since do_bench needs CUDA)."""
from __future__ import annotations

import triton.testing

from bench.gpu.probe_cli import schedule_row


def test_a_schedule_row_checks_then_times_and_reports_its_rate(monkeypatch):
    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep: (fn(), 2.0)[1])
    row = schedule_row({"STAGES": 2}, lambda **s: calls.append(s), lambda: {"max_abs_diff": 0.0}, flops=4e12,
                       baseline_ms=3.0, warmup=1, rep=1)
    assert calls == [{"STAGES": 2}, {"STAGES": 2}]  # once to check, once timed
    assert row == {"schedule": {"STAGES": 2}, "max_abs_diff": 0.0, "ms": 2.0, "tflops": 2000.0,
                   "speedup_over_triton": 1.5}


def test_a_schedule_that_fails_is_a_row_with_its_error_not_a_crash():
    def run(**schedule):
        raise RuntimeError("out of resource: shared memory\nRequired: 240000")
    row = schedule_row({"STAGES": 4}, run, lambda: {}, flops=1.0, baseline_ms=1.0, warmup=1, rep=1)
    assert row == {"schedule": {"STAGES": 4}, "error": "RuntimeError: Required: 240000"}


def test_schedules_on_the_command_line_replace_the_probes_list_and_bad_ones_are_named(tmp_path, capsys):
    import pytest

    from bench.gpu.probe_cli import run_probe
    own = [{}, {"STAGES": 3}]
    seen = []
    assert run_probe("probe", ["--out", str(tmp_path / "r.json"), "--schedules", '[{"kernel": "pair"}]'],
                     lambda: 0, lambda: seen.append(list(own)) or {}, own) == 0
    assert seen == [[{"kernel": "pair"}]] and own == [{"kernel": "pair"}]
    with pytest.raises(SystemExit):
        run_probe("probe", ["--out", str(tmp_path / "r.json"), "--schedules", '{"kernel": "pair"}'], lambda: 0,
                  lambda: {}, own)
    assert "--schedules must be a JSON list of objects" in capsys.readouterr().err
