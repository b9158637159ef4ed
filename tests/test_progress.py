"""Launcher progress: the status panel's content, the plain path off a terminal, quiet mode."""

from __future__ import annotations

import re
from io import StringIO

from rich.console import Console

from agentrl.progress import Progress, engines_from_snapshot, hms, percentile, render_status, step_line

ANSI = re.compile(r"\x1b\[")


def _row(step: int = 3, **extra) -> dict:
    return {"step": step, "weight_version": step, "reward_mean": 0.125, "staleness_max": 2,
            "staleness_mean": 0.5, "staleness": [0, 1, 2, 0], "episodes_per_s": 0.4,
            "gen_tokens_per_s": 340.0, "episodes_infra_error": 2, "trainer_idle_ratio": 0.31, **extra}


def _terminal(width: int = 120) -> Console:
    return Console(file=StringIO(), force_terminal=True, width=width, highlight=False)


def _plain_text(console: Console) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console.file.getvalue())


class FakeMetrics:
    """What RunMetrics.snapshot() returns for two engines (the real keys' format)."""

    calls = 0

    def snapshot(self) -> dict[str, float]:
        FakeMetrics.calls += 1
        return {'agentrl_engine_weight_version{engine="0"}': 3.0,
                'agentrl_engine_queue_depth{engine="0"}': 4.0,
                'agentrl_engine_tokens_per_s{engine="0"}': 41.2,
                'agentrl_engine_weight_version{engine="1"}': 2.0,
                "agentrl_reward_mean": 0.1}


def test_panel_shows_every_figure():
    state = {"run_id": "local-abc123", "mode": "async", "max_steps": 10, "started": 0.0, "step": 3,
             "version": 3, "in_flight": 12, "buffer": 2,
             "outcomes": {"scored": 30, "agent_timeout": 5, "infra_error:engine": 2},
             "engines": engines_from_snapshot(FakeMetrics().snapshot()), "staleness_p95": 1,
             "dashboard": "http://127.0.0.1:8265",
             "row": _row(eval_pass_rate=0.5, eval_version=2)}
    console = _terminal()
    console.print(render_status(state, now=62.0, eta_s=144.0))
    out = _plain_text(console)
    for want in ["local-abc123", "[async]", "3 / 10 (30%)", "trainer v3", "elapsed 1m02s", "ETA 2m24s",
                 "0: v3 (q 4, 41 tok/s)", "1: v2", "in flight 12", "finished 37",
                 "scored 30, agent_timeout 5, infra_error:engine 2", "2 ready group(s)",
                 "staleness max 2, p95 1", "reward      0.125", "eval pass 0.50 (v2)", "340 tok/s",
                 "0.40 ep/s", "trainer idle 0.31", "http://127.0.0.1:8265"]:
        assert want in out, (want, out)
    assert ANSI.search(console.file.getvalue())  # a terminal gets colours


def test_panel_with_nothing_known_yet_renders_dashes():
    console = _terminal()
    console.print(render_status({"run_id": "r", "mode": "sync", "max_steps": 5}, now=0.0))
    out = _plain_text(console)
    assert "- / 5" in out and "ETA -" in out and "eval pass -" in out and "in flight -" in out
    assert "engines" not in out and "dashboard" not in out  # rows with nothing to say are left out


def test_terminal_run_draws_panel_and_lines_then_erases_it():
    console = _terminal()
    p = Progress(console=console)
    p.begin("local-xyz", "async", 4, "http://127.0.0.1:8265")
    assert p.live
    p.update(step=0, version=0, in_flight=8, buffer=0, outcomes={"scored": 1}, metrics=FakeMetrics())
    p.note("engines at weight version 0")
    p.step(_row(step=1))
    p._live.refresh()
    p.end()
    assert not p.live
    p.end()  # idempotent (called again on error paths)
    out = _plain_text(console)
    assert "agentrl: engines at weight version 0" in out
    assert step_line(_row(step=1)) in out
    assert "local-xyz" in out and "in flight 8" in out and "0: v3 (q 4, 41 tok/s)" in out
    assert "p95 2" in out  # nearest-rank p95 of [0, 1, 2, 0]


def test_update_is_rate_limited_and_free_without_a_panel():
    FakeMetrics.calls = 0
    plain = Progress(console=Console(file=StringIO()))
    plain.begin("r", "async", 2)
    for _ in range(50):
        plain.update(step=0, version=0, in_flight=1, buffer=0, outcomes={}, metrics=FakeMetrics())
    assert FakeMetrics.calls == 0 and not plain.live

    live = Progress(console=_terminal())
    live.begin("r", "async", 2)
    for _ in range(50):
        live.update(step=0, version=0, in_flight=1, buffer=0, outcomes={}, metrics=FakeMetrics())
    live.end()
    assert FakeMetrics.calls == 1  # 50 loop iterations within 0.25 s: one snapshot


def test_not_a_terminal_prints_plain_lines_without_ansi():
    console = Console(file=StringIO(), highlight=False)  # a StringIO is not a terminal
    p = Progress(console=console)
    p.begin("r", "async", 2, "http://127.0.0.1:8265")
    assert not p.live
    long_note = "starting 1 embedded engine(s) " + "x" * 150 + " [bold]literal[/bold]"
    p.note(long_note)
    p.step(_row(step=1))
    p.end()
    out = console.file.getvalue()
    assert not ANSI.search(out)
    assert out.splitlines() == [f"agentrl: {long_note}", step_line(_row(step=1))]  # no wrapping, no markup


def test_quiet_prints_nothing_even_on_a_terminal():
    console = _terminal()
    p = Progress(quiet=True, console=console)
    p.begin("r", "async", 2)
    p.update(step=0, version=0, in_flight=1, buffer=0, outcomes={})
    p.note("hello")
    p.step(_row())
    p.end()
    assert not p.live and console.file.getvalue() == ""


def test_notes_are_redacted_and_not_markup(monkeypatch):
    monkeypatch.setenv("DAYTONA_API_KEY", "dtn_secret_value_123")
    console = _terminal()
    Progress(console=console).note("create failed with key dtn_secret_value_123 [red]x[/red]")
    out = _plain_text(console)
    assert "dtn_secret_value_123" not in out and "***" in out and "[red]x[/red]" in out


def test_step_line_format():
    assert step_line(_row(step=7, eval_pass_rate=0.25)) == (
        "step    7 | reward 0.125 | eval 0.25 | stale max 2 | v7 | 0.40 ep/s | 340 tok/s | infra 2 | idle 0.31")


def test_helpers():
    assert percentile([], 95) is None
    assert percentile([3], 95) == 3
    assert percentile(list(range(100)), 95) == 94 and percentile(list(range(100)), 50) == 49
    assert hms(5.7) == "5s" and hms(62) == "1m02s" and hms(3725) == "1h02m" and hms(-3) == "0s"
    assert engines_from_snapshot({"agentrl_step": 1.0}) == {}
