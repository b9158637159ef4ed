"""curves.png: every eval is drawn, including the one after the last step."""

from __future__ import annotations

import json

from agentrl.plot import collect_evals, plot_run


def _row(step, **kw):
    return {"step": step, "reward_mean": 0.1 * step, "staleness_max": 1, "staleness_mean": 0.5, **kw}


def test_evals_come_from_rows_summary_and_the_caller(tmp_path):
    rows = [_row(1, eval_version=0, eval_pass_rate=0.0), _row(2, eval_version=0, eval_pass_rate=0.0),
            _row(3, eval_version=2, eval_pass_rate=0.3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert collect_evals(tmp_path, rows) == {0: 0.0, 2: 0.3}
    (tmp_path / "summary.json").write_text(json.dumps({"evals": [{"eval_version": 3, "eval_pass_rate": 0.5},
                                                                  {"eval_version": 4, "eval_pass_rate": None}]}))
    assert collect_evals(tmp_path, rows) == {0: 0.0, 2: 0.3, 3: 0.5}
    assert collect_evals(tmp_path, rows, {3: 0.6, 5: None}) == {0: 0.0, 2: 0.3, 3: 0.6}
    out = plot_run(tmp_path, evals={3: 0.6})
    assert out == tmp_path / "curves.png" and out.stat().st_size > 1000


def test_no_metrics_no_plot(tmp_path):
    assert plot_run(tmp_path) is None
