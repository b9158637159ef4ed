"""Checks of the trainer's process groups (the coordinates and groups themselves come from
agentrl.config.layout.Layout, the one layout type). Pure arithmetic: no Ray, no torch; the
rehearsal compares it with what actors report."""

from __future__ import annotations

from agentrl.config.layout import Layout, LayoutError

RankLayoutError = LayoutError  # the rehearsal's name for a layout that groups or placement contradict


def check_groups(groups: dict[str, list[list[int]]], layout: Layout) -> None:
    """Each kind must partition the world into groups of its dimension's size."""
    world = set(range(layout.world))
    for kind, gs in groups.items():
        size = getattr(layout, kind)
        bad = [g for g in gs if len(g) != size or len(set(g)) != size]
        if bad:
            raise RankLayoutError(f"{kind} group {bad[0]} does not have {size} distinct ranks")
        seen = [r for g in gs for r in g]
        if len(seen) != len(set(seen)) or set(seen) != world:
            dup = sorted({r for r in seen if seen.count(r) > 1})[:5]
            missing = sorted(world - set(seen))[:5]
            raise RankLayoutError(f"{kind} groups do not partition ranks 0..{layout.world - 1} "
                                  f"(in two groups: {dup}, in none: {missing})")


def check_groups_in_node(groups: list[list[int]], node_of_rank: dict[int, int], kind: str) -> None:
    """Every group of `kind` must sit inside one node (TP all-reduces every layer over NVLink)."""
    for g in groups:
        nodes = sorted({node_of_rank[r] for r in g})
        if len(nodes) > 1:
            raise RankLayoutError(
                f"{kind} group of ranks {g} spans nodes {nodes}; a {kind} group must stay inside one node "
                f"(its ranks must be placed on the same node's GPUs)")


def group_index(groups: list[list[int]]) -> dict[int, int]:
    """rank -> index of the group holding it."""
    return {r: i for i, g in enumerate(groups) for r in g}
