"""Reading a run dir for the report: config.json, metrics.jsonl, summary.json, transcripts/.

A run may still be writing: a torn last line of a .jsonl file is skipped and counted, never an
error. A run dir without config.json and metrics.jsonl is not a run dir, and says so.
Transcripts of a long run are large (text of every episode): they are streamed, and only the
newest `keep_episodes` rows of each worker file stay in memory.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunData:
    run_dir: Path
    config: dict[str, Any]
    steps: list[dict[str, Any]]
    summary: dict[str, Any]
    episodes: list[dict[str, Any]]  # newest transcript rows, oldest first, each with "worker" (file index)
    episodes_total: int = 0  # transcript rows in all files (episodes may hold fewer)
    transcript_outcomes: Counter[str] = field(default_factory=Counter)  # over all rows
    skipped_lines: dict[str, int] = field(default_factory=dict)  # file -> unreadable lines

    def cfg(self, dotted: str, default: Any = None) -> Any:
        """config.json value at a dotted path (e.g. "algorithm.group_size"), or default."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


def iter_jsonl(path: Path, skipped: dict[str, int]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a .jsonl file; unreadable lines are counted in skipped[path.name]."""
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1  # a line being written right now, or a crash mid-write
                continue
            if isinstance(row, dict):
                yield row
            else:
                bad += 1
    if bad:
        skipped[path.name] = bad


def _age(row: dict[str, Any]) -> tuple[float, int]:
    """Sort key, oldest first: the row's end time when it has one ("time"), else its newest
    weight version (rows of different worker files carry no common clock otherwise)."""
    t = row.get("time")
    versions = [v for v in row.get("versions") or [] if isinstance(v, int)]
    return (float(t) if isinstance(t, (int, float)) else float("-inf"), max(versions, default=-1))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); fix or remove the file") from None
    return data if isinstance(data, dict) else {}


def _worker_index(path: Path) -> int | None:
    tail = path.stem.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


def load_run(run_dir: str | Path, keep_episodes: int | None = None) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is a file, not a folder" if run_dir.exists() else "does not exist"
        raise FileNotFoundError(f"run dir {run_dir} {what} (pass the folder given as logging.run_dir)")
    if not (run_dir / "config.json").exists() and not (run_dir / "metrics.jsonl").exists():
        raise FileNotFoundError(
            f"{run_dir} has neither config.json nor metrics.jsonl: not an agentrl run dir "
            "(pass the folder given as logging.run_dir)"
        )
    skipped: dict[str, int] = {}
    metrics = run_dir / "metrics.jsonl"
    steps = list(iter_jsonl(metrics, skipped)) if metrics.exists() else []
    episodes: list[dict[str, Any]] = []
    total, outcomes = 0, Counter()
    for path in sorted((run_dir / "transcripts").glob("*.jsonl")):
        worker = _worker_index(path)
        newest: deque[dict[str, Any]] = deque(maxlen=keep_episodes)
        for row in iter_jsonl(path, skipped):
            total += 1
            outcomes[str(row.get("outcome"))] += 1
            row.setdefault("worker", worker)
            newest.append(row)
        episodes.extend(newest)
    episodes.sort(key=_age)  # stable: within one file, the file's own order
    if keep_episodes is not None:
        episodes = episodes[-keep_episodes:]
    return RunData(
        run_dir=run_dir,
        config=_read_json(run_dir / "config.json"),
        steps=steps,
        summary=_read_json(run_dir / "summary.json"),
        episodes=episodes,
        episodes_total=total,
        transcript_outcomes=outcomes,
        skipped_lines=skipped,
    )
