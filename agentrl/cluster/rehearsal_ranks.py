"""Rank bookkeeping of the Megatron trainer: every global rank's coordinates and its process groups.

Order: Megatron-core's default `order="tp-cp-ep-dp-pp"` (parallel_state.initialize_model_parallel),
the first dimension varying fastest. Megatron builds two rank generators from it:
- dense (attention, dense MLP, embeddings): ep dropped, rank = tp + TP*(cp + CP*(dp + DP*pp));
- expert (routed experts): tp -> etp, cp dropped, dp -> expert dp,
  rank = etp + ETP*(ep + EP*(edp + EDP*pp)).
Both agree on the pipeline stage (pp is outermost in both). tests/test_rehearsal.py checks these
groups against megatron.core.parallel_state.RankGenerator itself.

Pure arithmetic: no Ray, no torch; the rehearsal compares it with what actors report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import product

MEGATRON_ORDER = "tp-cp-ep-dp-pp"
DENSE_DIMS = ("tp", "cp", "dp", "pp")  # fastest first
EXPERT_DIMS = ("etp", "ep", "edp", "pp")


class RankLayoutError(ValueError):
    """The parallel layout cannot be laid over the world, or groups disagree; the message says how."""


@dataclass(frozen=True)
class RankCoords:
    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Layout:
    """Sizes of every dimension; `sizes()` of the dense and expert decompositions."""

    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int

    @classmethod
    def from_plan(cls, plan) -> Layout:
        p = plan.parallel
        world = plan.train_gpus
        stage = world // p.pp if p.pp else 0
        if p.tp * p.cp * p.dp * p.pp != world:
            raise RankLayoutError(
                f"TP*CP*DP*PP = {p.tp}*{p.cp}*{p.dp}*{p.pp} = {p.tp * p.cp * p.dp * p.pp} but the trainer has "
                f"{world} GPUs; the plan's parallel layout is inconsistent")
        if p.ep * p.etp == 0 or stage % (p.ep * p.etp):
            raise RankLayoutError(f"EP*ETP = {p.ep}*{p.etp} does not divide the {stage} GPUs of a pipeline stage")
        return cls(tp=p.tp, cp=p.cp, dp=p.dp, pp=p.pp, etp=p.etp, ep=p.ep, edp=stage // (p.ep * p.etp))

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def sizes(self, dims: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in dims)


def _decompose(rank: int, sizes: tuple[int, ...]) -> list[int]:
    out = []
    for s in sizes:
        out.append(rank % s)
        rank //= s
    return out


def rank_coords(layout: Layout) -> list[RankCoords]:
    """Coordinates of every global rank, in rank order."""
    out = []
    for r in range(layout.world):
        tp, cp, dp, pp = _decompose(r, layout.sizes(DENSE_DIMS))
        etp, ep, edp, pp_e = _decompose(r, layout.sizes(EXPERT_DIMS))
        if pp != pp_e:  # both decompositions put pp outermost, so this only trips on a bad layout
            raise RankLayoutError(f"rank {r}: dense layout says stage {pp}, expert layout says {pp_e}")
        out.append(RankCoords(r, tp, cp, dp, pp, etp, ep, edp))
    return out


def _groups_along(dims: tuple[str, ...], sizes: tuple[int, ...], along: str) -> list[list[int]]:
    """Rank lists that differ only in `along` (the other coordinates fixed), Megatron's group order."""
    k = dims.index(along)
    others = [range(s) for i, s in enumerate(sizes) if i != k]
    groups = []
    # Megatron enumerates groups with the fastest remaining dimension first; reversing product's
    # order (last varies fastest) gives that.
    for fixed in product(*reversed(others)):
        fixed = list(reversed(fixed))
        members = []
        for x in range(sizes[k]):
            coord = fixed[:k] + [x] + fixed[k:]
            r, stride = 0, 1
            for c, s in zip(coord, sizes, strict=True):
                r += c * stride
                stride *= s
            members.append(r)
        groups.append(members)
    return groups


def process_groups(layout: Layout) -> dict[str, list[list[int]]]:
    """Every group kind Megatron creates for the trainer: tp, cp, dp, pp (dense) and etp, ep, edp."""
    dense, expert = layout.sizes(DENSE_DIMS), layout.sizes(EXPERT_DIMS)
    out = {d: _groups_along(DENSE_DIMS, dense, d) for d in DENSE_DIMS}
    out.update({d: _groups_along(EXPERT_DIMS, expert, d) for d in ("etp", "ep", "edp")})
    return out


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
