"""`render_report(run_dir)`: one self-contained HTML page about a run (no scripts, no external
assets). Sections: header and config, learning curves, outcomes, staleness swimlane, steps
table, episodes with their transcripts. Every string from the run dir is escaped: transcripts
are model output and task ids come from task folders."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from agentrl.view.episodes import episodes_section, lanes_section
from agentrl.view.format import esc, fmt, fmt_duration
from agentrl.view.load import RunData, load_run
from agentrl.view.style import CSS
from agentrl.view.svg import Chart, Series, line_chart

CONFIG_FIELDS = [
    ("mode", "mode"),
    ("model", "model.name"),
    ("env", "env.name"),
    ("train backend", "train.backend"),
    ("engine", "rollout.engine"),
    ("sandbox", "sandbox.backend"),
    ("nodes", "cluster.num_nodes"),
    ("GPUs / node", "cluster.gpus_per_node"),
    ("group size", "algorithm.group_size"),
    ("prompts / step", "algorithm.prompts_per_step"),
    ("max staleness", "buffer.max_staleness"),
    ("stale policy", "buffer.stale_policy"),
    ("episodes in flight", "buffer.max_episodes_in_flight"),
    ("lr", "train.optimizer.lr"),
    ("TIS", "algorithm.use_tis"),
    ("temperature", "rollout.temperature"),
    ("max new tokens", "rollout.max_new_tokens"),
    ("max turns", "agent.max_turns"),
    ("action format", "agent.action_format"),
    ("eval every", "env.eval_every"),
    ("seed", "seed"),
]
STEP_COLUMNS = [
    ("step", "step", 0),
    ("version", "weight_version", 0),
    ("reward", "reward_mean", 3),
    ("eval", "eval_pass_rate", 2),
    ("stale max", "staleness_max", 0),
    ("stale mean", "staleness_mean", 2),
    ("episodes", "episodes_finished", 0),
    ("infra", "episodes_infra_error", 0),
    ("ep/s", "episodes_per_s", 2),
    ("gen tok/s", "gen_tokens_per_s", 0),
    ("idle", "trainer_idle_ratio", 2),
    ("step s", "step_time_s", 2),
    ("sync s", "sync_s", 2),
    ("TIS clip", "tis_clip_frac", 4),
    ("loss", "loss", 4),
    ("grad norm", "grad_norm", 3),
]


def _cfg_value(value: Any) -> str:
    if value is None:
        return "\u2013"
    return f"{value:g}" if isinstance(value, float) else esc(value)


# -- sections ----------------------------------------------------------------------------------
def _header(run: RunData) -> str:
    steps, last = run.steps, (run.steps[-1] if run.steps else {})
    wall = run.summary.get("wall_s", last.get("wall_s"))
    max_steps = run.cfg("train.max_steps")
    evals = [r for r in steps if r.get("eval_pass_rate") is not None]
    cards = [
        ("steps", f"{len(steps)}" + (f" / {max_steps}" if max_steps else "")),
        ("wall time", fmt_duration(wall)),
        ("weight version", fmt(last.get("weight_version"), 0)),
        ("last reward", fmt(last.get("reward_mean"), 3)),
        (
            "last eval",
            f"{fmt(evals[-1]['eval_pass_rate'], 2)} @ v{fmt(evals[-1].get('eval_version'), 0)}"
            if evals
            else "\u2013",
        ),
        ("episodes", fmt(last.get("episodes_finished"), 0)),
        ("infra errors", fmt(last.get("episodes_infra_error"), 0)),
        ("transcripts", f"{run.episodes_total:,}"),
    ]
    state = "finished" if run.summary else "running or stopped early (no summary.json)"
    when = ""
    if isinstance(last.get("time"), (int, float)):
        when = f" \u00b7 last step {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(last['time']))}"
    rows = "".join(
        f"<div><span class='k'>{esc(k)}</span><span class='v'>{_cfg_value(run.cfg(p))}</span></div>"
        for k, p in CONFIG_FIELDS
    )
    full = json.dumps(run.config, indent=2, sort_keys=True) if run.config else "(no config.json)"
    return (
        f"<header><h1>agentrl run <code>{esc(run.run_dir.name)}</code></h1>"
        f"<p class='sub'>recipe <b>{esc(run.cfg('recipe', '?'))}</b> \u00b7 model <b>{esc(run.cfg('model.name', '?'))}</b>"
        f" \u00b7 {esc(state)}{esc(when)} \u00b7 <span class='path'>{esc(run.run_dir)}</span></p></header>"
        "<section class='cards'>"
        + "".join(
            f"<div class='card'><div class='k'>{esc(k)}</div><div class='v'>{v}</div></div>" for k, v in cards
        )
        + "</section>"
        f"<section><h2>Config</h2><div class='kvgrid'>{rows}</div>"
        f"<details><summary>full config.json</summary><pre>{esc(full)}</pre></details></section>"
    )


def _curves(run: RunData) -> str:
    s = run.steps

    def pts(key: str, x: str = "step") -> list[tuple[float, float]]:
        return [
            (r[x], r[key])
            for r in s
            if isinstance(r.get(key), (int, float)) and isinstance(r.get(x), (int, float))
        ]

    evals: dict[float, float] = {}
    for r in s:
        if isinstance(r.get("eval_pass_rate"), (int, float)) and isinstance(
            r.get("eval_version"), (int, float)
        ):
            evals[r["eval_version"]] = r["eval_pass_rate"]
    charts = [
        Chart(
            "Reward and eval pass rate",
            [
                Series("train reward (batch mean)", pts("reward_mean"), "#1f77b4"),
                Series("eval pass rate (at version)", sorted(evals.items()), "#d62728", dashed=True),
            ],
            y_label="reward / pass rate",
            y_min=0.0,
            y_max=1.0,
        ),
        Chart(
            "Staleness (versions behind the trainer)",
            [
                Series("max", pts("staleness_max"), "#9467bd"),
                Series("mean", pts("staleness_mean"), "#8c564b", dashed=True),
            ],
            y_label="version lag",
            y_min=0.0,
        ),
        Chart(
            "Throughput",
            [Series("gen tokens/s", pts("gen_tokens_per_s"), "#2ca02c")],
            y_label="tokens / s",
            y_min=0.0,
        ),
        Chart(
            "Trainer",
            [
                Series("idle ratio", pts("trainer_idle_ratio"), "#ff7f0e"),
                Series("TIS clip frac", pts("tis_clip_frac"), "#17becf", dashed=True),
            ],
            y_label="fraction",
            y_min=0.0,
        ),
    ]
    return (
        "<section><h2>Learning curves</h2><div class='charts'>"
        + "".join(f"<div class='panel'>{line_chart(c)}</div>" for c in charts)
        + "</div></section>"
    )


def _outcomes(run: RunData) -> str:
    last = run.steps[-1] if run.steps else {}
    counts = last.get("outcomes") if isinstance(last.get("outcomes"), dict) else None
    source = "metrics.jsonl (all episodes so far)"
    if not counts:
        counts, source = run.transcript_outcomes, "transcripts"
    total = sum(v for v in counts.values() if isinstance(v, (int, float)))
    if not total:
        return ""
    bars = []
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        cls = (
            "infra"
            if name.startswith("infra_error")
            else "limit"
            if name in ("agent_timeout", "truncated")
            else "ok"
        )
        bars.append(
            f"<div class='obar {cls}' style='width:{100 * n / total:.2f}%' title='{esc(name)}: {n}'></div>"
        )
    legend = " \u00b7 ".join(
        f"<span class='tag'>{esc(k)}</span> {fmt(v, 0)} ({100 * v / total:.1f}%)"
        for k, v in sorted(counts.items(), key=lambda kv: -kv[1])
    )
    return (
        f"<section><h2>Outcomes</h2><div class='stack'>{''.join(bars)}</div>"
        f"<p class='small'>{legend} \u2014 from {esc(source)}</p></section>"
    )


def _steps_table(run: RunData, max_rows: int) -> str:
    rows = run.steps[-max_rows:]
    note = (
        f"<p class='small'>last {len(rows)} of {len(run.steps)} steps</p>"
        if len(rows) < len(run.steps)
        else ""
    )
    head = "".join(f"<th>{esc(h)}</th>" for h, _, _ in STEP_COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{fmt(r.get(k), d)}</td>" for _, k, d in STEP_COLUMNS) + "</tr>"
        for r in reversed(rows)
    )
    return (
        f"<section><h2>Steps</h2>{note}<div class='scroll tall'><table class='data'><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table></div></section>"
    )


def render_report(
    run_dir: str | Path,
    *,
    max_episodes: int = 300,
    max_lanes: int = 80,
    max_steps: int = 1000,
    max_text_chars: int = 8000,
) -> str:
    """The HTML report of a run dir as one string."""
    run = load_run(run_dir, keep_episodes=max(max_episodes, max_lanes))
    skipped = ""
    if run.skipped_lines:
        skipped = (
            "<p class='small warn'>Unreadable lines skipped (a run still writing, or a crash mid-line): "
            + ", ".join(f"{esc(k)}: {v}" for k, v in sorted(run.skipped_lines.items()))
            + "</p>"
        )
    body = (
        _header(run)
        + skipped
        + _curves(run)
        + _outcomes(run)
        + lanes_section(run, max_lanes)
        + _steps_table(run, max_steps)
        + episodes_section(run, max_episodes, max_text_chars)
    )
    made = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>agentrl \u00b7 {esc(run.run_dir.name)}</title><style>{CSS}</style></head>"
        f"<body>{body}<footer>made by <code>agentrl view</code> at {made}</footer></body></html>"
    )


def write_report(run_dir: str | Path, out: str | Path | None = None, **kw: Any) -> Path:
    """Render and write the report (default RUN_DIR/report.html); returns its path."""
    path = Path(out) if out else Path(run_dir) / "report.html"
    html = render_report(run_dir, **kw)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(path)  # a reader never sees half a page
    return path
