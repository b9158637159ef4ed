"""Per-turn weight versions of an episode, for the staleness swimlane.

The episode worker can store `turn_versions(traj.loss_mask, traj.weight_versions)` in each
transcript row as "turn_versions"; the report then colours every turn by the version(s) that
produced it, and falls back to the episode's "versions" when the field is absent.
"""

from __future__ import annotations

from typing import Any


def turn_versions(loss_mask: list[int], weight_versions: list[int]) -> list[list[int]]:
    """Sorted unique versions of each generated turn, in order. A turn is a maximal run of
    sampled positions (loss_mask 1); observations between turns are loss_mask 0. A turn has
    more than one version when a weight update landed while it was being generated."""
    if len(loss_mask) != len(weight_versions):
        raise ValueError(f"loss_mask has {len(loss_mask)} entries, weight_versions {len(weight_versions)}")
    turns: list[list[int]] = []
    current: set[int] | None = None
    for m, v in zip(loss_mask, weight_versions):
        if m:
            if current is None:
                current = set()
            if v >= 0:
                current.add(int(v))
        elif current is not None:
            turns.append(sorted(current))
            current = None
    if current is not None:
        turns.append(sorted(current))
    return turns


def lane_turns(row: dict[str, Any]) -> list[list[int]] | None:
    """A transcript row's per-turn versions, if it recorded them (ints are read as one version)."""
    raw = row.get("turn_versions")
    if not isinstance(raw, list):
        return None
    turns = []
    for t in raw:
        if isinstance(t, bool):
            return None
        if isinstance(t, int):
            turns.append([t])
        elif isinstance(t, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in t):
            turns.append(sorted(set(t)))
        else:
            return None  # malformed: fall back to the episode's versions rather than guess
    return turns


def row_versions(row: dict[str, Any]) -> list[int]:
    raw = row.get("versions")
    if isinstance(raw, list):
        return sorted({int(v) for v in raw if isinstance(v, int) and not isinstance(v, bool) and v >= 0})
    turns = lane_turns(row)
    return sorted({v for t in turns for v in t}) if turns else []
