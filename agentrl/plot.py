"""A PNG of a run's learning curves: train reward, eval pass rate and staleness per step."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def collect_evals(run_dir: str | Path, rows: list[dict], evals: dict[int, float] | None = None) -> dict[int, float]:
    """Eval pass rate by weight version from summary.json, the metrics rows and `evals` (later wins)."""
    found: dict[int, float] = {}
    summary = Path(run_dir) / "summary.json"
    if summary.exists():
        for e in json.loads(summary.read_text()).get("evals", []):
            if e.get("eval_pass_rate") is not None:
                found[e["eval_version"]] = e["eval_pass_rate"]
    for r in rows:
        if r.get("eval_pass_rate") is not None:
            found[r["eval_version"]] = r["eval_pass_rate"]
    found.update({v: p for v, p in (evals or {}).items() if p is not None})
    return found


def plot_run(run_dir: str | Path, out: str | Path | None = None, evals: dict[int, float] | None = None) -> Path | None:
    """Write run_dir/curves.png (or `out`); None when the run has no metrics yet. `evals` (weight
    version -> pass rate) adds evals not in metrics.jsonl, e.g. the one after the last step;
    summary.json's evals are read too when it exists."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(steps, [r["reward_mean"] for r in rows], marker="o", label="train reward (batch mean)")
    found = collect_evals(run_dir, rows, evals)
    if found:
        versions = sorted(found)
        ax1.plot(versions, [found[v] for v in versions], marker="s", label="eval pass rate (at weight version)")
    ax1.set_ylim(-0.05, 1.05)
    ax1.set_ylabel("reward / pass rate")
    ax1.legend(loc="upper left")
    ax2.plot(steps, [r["staleness_max"] for r in rows], marker="^", label="max staleness (versions)")
    ax2.plot(steps, [r["staleness_mean"] for r in rows], linestyle="--", label="mean staleness")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("version lag")
    ax2.legend(loc="upper left")
    fig.suptitle(f"agentrl run: {Path(run_dir).name}")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
