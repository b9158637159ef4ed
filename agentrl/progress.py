"""Live progress of a run in the launcher.

Three behaviours, picked once from where stderr goes:
- a terminal: one line per step (and notes) scrolling above a live status panel (rich.live,
  redrawn at most twice a second, erased when the run ends);
- not a terminal (a log file, CI): the same lines as plain text, no panel, no ANSI codes;
- quiet: nothing at all.

The orchestrator feeds the panel from state it already holds: `begin` once, `update` from its
loop (cheap: a time check, and a copy only when the panel will show it), `step` with each
metrics row. Everything runs on the orchestrator's event loop thread except rich's refresh
thread, which only reads `self._state`, a dict replaced whole on every change, never mutated.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from agentrl.secrets import redact

REFRESH_PER_SECOND = 2  # the panel changes at most once per loop step anyway; 2 Hz costs nothing
UPDATE_EVERY_S = 0.25  # `update` copies the orchestrator's state at most this often
STALENESS_WINDOW = 256  # trained groups the staleness p95 is taken over
_ENGINE_KEY = re.compile(r'^agentrl_engine_(weight_version|queue_depth|tokens_per_s)\{engine="(\d+)"\}$')


class Progress:
    def __init__(self, quiet: bool = False, console: Console | None = None):
        self.console = console or Console(stderr=True, highlight=False)
        self.quiet = quiet
        self._live: Live | None = None
        self._state: dict[str, Any] = {}
        self._lags: deque[int] = deque(maxlen=STALENESS_WINDOW)
        self._last_update = 0.0
        self._eta_base: tuple[float, int] | None = None  # (monotonic s, step) when steps were first seen

    @property
    def live(self) -> bool:
        """Whether the status panel is showing."""
        return self._live is not None

    # -- lines -----------------------------------------------------------------------------------
    def note(self, text: str) -> None:
        if self.quiet:
            return
        if self.console.is_terminal:
            self.console.print(f"[dim]agentrl:[/dim] {escape(redact(text))}")
        else:
            self._plain(f"agentrl: {redact(text)}")

    def step(self, row: dict) -> None:
        """One metrics.jsonl row: a line, and the panel's reward/staleness/throughput figures."""
        if self.quiet:
            return
        self._lags.extend(int(lag) for lag in row.get("staleness") or [])
        if self._live is not None:
            self._set(step=row.get("step"), version=row.get("weight_version"), row=dict(row),
                      staleness_p95=percentile(list(self._lags), 95))
        line = step_line(row)
        if self.console.is_terminal:
            self.console.print(line, markup=False)
        else:
            self._plain(line)

    def _plain(self, line: str) -> None:
        print(line, file=self.console.file, flush=True)

    # -- the panel -------------------------------------------------------------------------------
    def begin(self, run_id: str, mode: str, max_steps: int, dashboard_url: str | None = None) -> None:
        """Show the status panel (on a terminal only; otherwise, or when quiet, a no-op)."""
        if self.quiet or not self.console.is_terminal or self._live is not None:
            return
        self._set(run_id=run_id, mode=mode, max_steps=max_steps, dashboard=dashboard_url,
                  started=time.monotonic())
        self._live = Live(console=self.console, get_renderable=self._render_now, transient=True,
                          refresh_per_second=REFRESH_PER_SECOND)
        self._live.start(refresh=True)

    def update(self, *, step: int, version: int, in_flight: int, buffer: int,
               outcomes: dict[str, int], metrics: Any = None) -> None:
        """The loop's state. `metrics` is the RunMetrics whose snapshot holds per-engine figures;
        it is read only when the panel is showing and at most every UPDATE_EVERY_S."""
        if self._live is None:
            return
        now = time.monotonic()
        if now - self._last_update < UPDATE_EVERY_S:
            return
        self._last_update = now
        if self._eta_base is None:
            self._eta_base = (now, step)
        engines = engines_from_snapshot(metrics.snapshot()) if metrics is not None else {}
        self._set(step=step, version=version, in_flight=in_flight, buffer=buffer,
                  outcomes=dict(outcomes), engines=engines)

    def end(self) -> None:
        """Erase the panel (idempotent; called on success and on errors)."""
        live, self._live = self._live, None
        if live is not None:
            live.stop()

    def _set(self, **changes: Any) -> None:
        self._state = {**self._state, **changes}

    def _render_now(self) -> Panel:
        state, now = self._state, time.monotonic()
        eta = None
        if self._eta_base is not None and state.get("step") is not None:
            t0, s0 = self._eta_base
            done = state["step"] - s0
            if done > 0:
                eta = (now - t0) / done * max(state.get("max_steps", 0) - state["step"], 0)
        return render_status(state, now=now, eta_s=eta)


# -- pure rendering (tested directly) ------------------------------------------------------------
def step_line(row: dict) -> str:
    ev = row.get("eval_pass_rate")
    parts = [
        f"step {row['step']:>4}",
        f"reward {row['reward_mean']:.3f}",
        f"eval {ev:.2f}" if ev is not None else "eval   - ",
        f"stale max {row['staleness_max']}",
        f"v{row['weight_version']}",
        f"{row['episodes_per_s']:.2f} ep/s",
        f"{row['gen_tokens_per_s']:.0f} tok/s",
        f"infra {row['episodes_infra_error']}",
        f"idle {row['trainer_idle_ratio']:.2f}",
    ]
    return " | ".join(parts)


def render_status(state: dict, now: float | None = None, eta_s: float | None = None) -> Panel:
    """The status panel for `state` (keys as Progress sets them; any may be missing)."""
    now = time.monotonic() if now is None else now
    row = state.get("row") or {}
    step, max_steps = state.get("step"), state.get("max_steps")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()

    pct = f" ({100 * step / max_steps:.0f}%)" if step is not None and max_steps else ""
    timing = f"elapsed {hms(now - state['started'])}" if "started" in state else ""
    timing += f"   ETA {hms(eta_s)}" if eta_s is not None else "   ETA -"
    grid.add_row("step", f"{_v(step)} / {_v(max_steps)}{pct}   trainer v{_v(state.get('version'))}   {timing}")

    engines = state.get("engines") or {}
    if engines:
        grid.add_row("engines", "   ".join(_engine(i, engines[i]) for i in sorted(engines)))

    outcomes = state.get("outcomes") or {}
    finished = sum(outcomes.values())
    by_outcome = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: (-kv[1], kv[0])))
    grid.add_row("episodes", f"in flight {_v(state.get('in_flight'))}   finished {finished}"
                 + (f": {by_outcome}" if by_outcome else ""))

    p95 = state.get("staleness_p95")
    grid.add_row("buffer", f"{_v(state.get('buffer'))} ready group(s)   staleness max {_v(row.get('staleness_max'))}"
                 + (f", p95 {p95:g} (last {STALENESS_WINDOW} groups)" if p95 is not None else ""))

    ev = row.get("eval_pass_rate")
    grid.add_row("reward", f"{_num(row.get('reward_mean'), '.3f')}   eval pass "
                 + (f"{ev:.2f} (v{row.get('eval_version', '?')})" if ev is not None else "-"))
    grid.add_row("throughput", f"{_num(row.get('gen_tokens_per_s'), '.0f')} tok/s generated (run avg)   "
                 f"{_num(row.get('episodes_per_s'), '.2f')} ep/s   trainer idle {_num(row.get('trainer_idle_ratio'), '.2f')}")
    if state.get("dashboard"):
        grid.add_row("dashboard", Text(state["dashboard"], style="underline"))

    title = f"agentrl  {state.get('run_id', '')}  [{state.get('mode', '?')}]"
    return Panel(Group(grid), title=Text(title), title_align="left", border_style="blue", expand=False)


def engines_from_snapshot(snapshot: dict[str, float]) -> dict[int, dict[str, float]]:
    """{engine index: {"weight_version", "queue_depth", "tokens_per_s"}} from RunMetrics.snapshot()."""
    out: dict[int, dict[str, float]] = {}
    for key, value in snapshot.items():
        m = _ENGINE_KEY.match(key)
        if m:
            out.setdefault(int(m.group(2)), {})[m.group(1)] = value
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (a value that occurred), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def hms(seconds: float) -> str:
    s = int(max(seconds, 0))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _engine(index: int, fig: dict[str, float]) -> str:
    text = f"{index}: v{int(fig['weight_version'])}" if "weight_version" in fig else f"{index}: v?"
    extra = []
    if "queue_depth" in fig:
        extra.append(f"q {int(fig['queue_depth'])}")
    if "tokens_per_s" in fig:
        extra.append(f"{fig['tokens_per_s']:.0f} tok/s")
    return text + (f" ({', '.join(extra)})" if extra else "")


def _v(value: Any) -> str:
    return "-" if value is None else str(value)


def _num(value: Any, fmt: str) -> str:
    return "-" if not isinstance(value, (int, float)) else format(value, fmt)
