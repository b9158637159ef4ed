"""The report's per-episode sections: the staleness swimlane and the episode list with
transcripts. Transcript text is model output: it only ever enters the page through `esc`."""

from __future__ import annotations

from typing import Any

from agentrl.view.format import cut, esc, fmt, outcome_class
from agentrl.view.load import RunData
from agentrl.view.svg import Lane, ink_on, swimlane, version_color
from agentrl.view.turns import lane_turns, row_versions

_OUTCOME_KEY = ", ".join(
    f"<span class='badge {c}'>{t}</span>"
    for c, t in (
        ("pass", "reward 1"),
        ("fail", "reward < 1"),
        ("limit", "timeout / truncated"),
        ("infra", "infra error"),
    )
)


def _lane_label(e: dict[str, Any]) -> str:
    """Task, then the group's tail and the sample index: `count-lines · 1f9078/2`, or `eval v5/2`."""
    group, _, k = str(e.get("episode_id", "?")).rpartition("-")
    where = f"eval v{min(row_versions(e))}" if e.get("evaluate") and row_versions(e) else group[-6:]
    return f"{str(e.get('task_id', '?'))[:24]} \u00b7 {where}/{k}"


def lanes_section(run: RunData, max_lanes: int) -> str:
    eps = [e for e in run.episodes if row_versions(e)]
    if not eps:
        return "<section><h2>Staleness swimlane</h2><p class='small'>No transcripts with weight versions.</p></section>"
    eps.sort(key=lambda e: (min(row_versions(e)), str(e.get("episode_id", ""))))
    shown = eps[-max_lanes:]
    all_v = [v for e in shown for v in row_versions(e)]
    lo, hi = min(all_v), max(all_v)
    lanes = []
    for e in shown:
        turns = lane_turns(e)
        label = _lane_label(e)
        tip = (
            f"{e.get('episode_id')} task {e.get('task_id')} outcome {e.get('outcome')} reward {e.get('reward')} "
            f"versions {row_versions(e)}" + ("" if turns is not None else " (per-turn versions not recorded)")
        )
        n = e.get("turns") if isinstance(e.get("turns"), int) else len(turns or [])
        lanes.append(Lane(label, tip, outcome_class(e), turns, row_versions(e), n))
    missing = sum(1 for la in lanes if la.turns is None)
    note = (
        f" {missing} of {len(lanes)} lanes have no per-turn versions (older transcripts): they show the "
        "episode's versions as hatched stripes across its turns."
        if missing
        else ""
    )
    return (
        f"<section><h2>Staleness swimlane</h2><p class='small'>One lane per episode (the {len(shown)} newest "
        f"with sampled tokens, ordered by their oldest version), one cell per turn, coloured by the weight version "
        f"that generated it; label colour is the outcome ({_OUTCOME_KEY}).{esc(note)}</p>"
        f"<div class='scroll'>{swimlane(lanes, lo, hi)}</div></section>"
    )


def _chip(version: int, lo: int, hi: int) -> str:
    color = version_color(version, lo, hi)
    return f"background:{color};color:{ink_on(color)}"


def _version_chips(e: dict[str, Any], lo: int, hi: int) -> str:
    turns = lane_turns(e)
    if turns is None:
        vs = row_versions(e)
        return (
            "versions "
            + " ".join(f"<span class='chip' style='{_chip(v, lo, hi)}'>v{v}</span>" for v in vs)
            + " <span class='small'>(per turn not recorded)</span>"
        )
    return " ".join(
        f"<span class='chip' title='turn {i + 1}' style='{_chip(t[0] if t else lo, lo, hi)}'>"
        f"{i + 1}:v{'/'.join(map(str, t)) or '?'}</span>"
        for i, t in enumerate(turns)
    )


def _episode(e: dict[str, Any], lo: int, hi: int, max_text: int) -> str:
    vs = row_versions(e)
    versions = "\u2013" if not vs else (f"v{vs[0]}" if len(vs) == 1 else f"v{vs[0]}\u2013v{vs[-1]}")
    info = e.get("info") if isinstance(e.get("info"), dict) else {}
    timings = e.get("timings") if isinstance(e.get("timings"), dict) else {}
    facts = [
        ("episode", e.get("episode_id")),
        ("group", e.get("group_id")),
        ("worker", e.get("worker")),
        ("eval", "yes" if e.get("evaluate") else "no"),
        ("stop", info.get("stop")),
        ("finish reasons", ", ".join(map(str, info.get("finish_reasons") or [])) or None),
        ("parse errors", info.get("parse_errors")),
        ("actions", info.get("actions")),
        ("error", info.get("error")),
        ("close error", info.get("close_error")),
        (
            "timings",
            ", ".join(f"{k} {v:.2f}" for k, v in timings.items() if isinstance(v, (int, float))) or None,
        ),
    ]
    kv = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts if v not in (None, ""))
    text = e.get("text") if isinstance(e.get("text"), str) else ""
    reward = e.get("reward")
    return (
        f"<details class='ep'><summary class='row'><span>{esc(e.get('task_id', '?'))}</span>"
        f"<span><span class='badge {outcome_class(e)}'>{esc(e.get('outcome', '?'))}</span>"
        f"{' <span class="badge eval">eval</span>' if e.get('evaluate') else ''}</span>"
        f"<span class='num'>{fmt(reward, 2)}</span><span class='num'>{fmt(e.get('turns'), 0)}</span>"
        f"<span class='num'>{fmt(e.get('generated'), 0)} / {fmt(e.get('tokens'), 0)}</span>"
        f"<span class='num'>{fmt(e.get('duration_s'), 1)}</span><span>{esc(versions)}</span></summary>"
        f"<div class='body'><table class='kv'>{kv}</table><p>{_version_chips(e, lo, hi)}</p>"
        f"<pre class='transcript'>{esc(cut(text, max_text)) or '(no text)'}</pre></div></details>"
    )


def episodes_section(run: RunData, max_episodes: int, max_text: int) -> str:
    if not run.episodes:
        return "<section><h2>Episodes</h2><p class='small'>No transcripts (logging.transcripts is off, or none finished yet).</p></section>"
    shown = run.episodes[-max_episodes:]
    all_v = [v for e in shown for v in row_versions(e)] or [0]
    lo, hi = min(all_v), max(all_v)
    total = max(run.episodes_total, len(run.episodes))
    note = f"newest {len(shown)} of {total} episodes" if len(shown) < total else f"{len(shown)} episodes"
    head = (
        "<div class='row head'><span>task</span><span>outcome</span><span class='num'>reward</span>"
        "<span class='num'>turns</span><span class='num'>generated / tokens</span><span class='num'>seconds</span>"
        "<span>versions</span></div>"
    )
    items = "".join(_episode(e, lo, hi, max_text) for e in reversed(shown))
    return f"<section><h2>Episodes</h2><p class='small'>{note}, newest first; click one for its transcript.</p>{head}{items}</section>"
