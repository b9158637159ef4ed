"""The trainer's parallel layout: resolved once by the planner, then handed to everything that
shards or places (the trainer ranks' process groups, weight sharding and export, the rehearsal,
the memory model). Nobody else re-derives it from train.parallel.

Sizes: TP x CP x DP x PP = world (dense decomposition); ETP x EP x EDP x PP = world (expert
decomposition: routed experts drop CP and split the stage's ranks by EP, the rest is expert DP).
Rank order is Megatron-core's default `order="tp-cp-ep-dp-pp"` (parallel_state.
initialize_model_parallel), the first dimension varying fastest; both decompositions put pp
outermost, so they agree on a rank's stage. tests/test_rehearsal.py checks the groups against
megatron.core.parallel_state.RankGenerator itself.

Pure arithmetic: no Ray, no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import product

MEGATRON_ORDER = "tp-cp-ep-dp-pp"
DENSE_DIMS = ("tp", "cp", "dp", "pp")  # fastest first
EXPERT_DIMS = ("etp", "ep", "edp", "pp")


class LayoutError(ValueError):
    """The sizes cannot be laid over the world or the model; the message names the field to change."""


@dataclass(frozen=True)
class RankCoords:
    """One global rank's coordinates in both decompositions."""

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

    def label(self) -> str:
        return f"tp{self.tp} pp{self.pp} cp{self.cp} ep{self.ep} dp{self.dp}"


@dataclass(frozen=True)
class Layout:
    """The resolved layout of one training run. Build it with `Layout.resolve`, which checks it."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    pp_split: tuple[int, ...]  # decoder layers per pipeline stage (sums to num_layers)
    sequence_parallel: bool = False  # activations split over TP between blocks (only with tp > 1)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def resolve(cls, *, world: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1,
                pp_split: list[int] | tuple[int, ...] | None = None, num_layers: int,
                num_heads: int = 0, n_experts: int = 0, sequence_parallel: bool = True) -> Layout:
        """Every divisibility rule of a layout, checked once. `world` is the trainer's rank count."""
        for name, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", etp)):
            if v < 1:
                raise LayoutError(f"train.parallel.{name}={v} must be >= 1")
        if world < 1:
            raise LayoutError(f"the trainer has {world} ranks; it needs at least one")
        if world % (tp * pp * cp):
            raise LayoutError(f"training world size {world} is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = "
                              f"{tp * pp * cp}; change train.parallel or the number of trainer ranks")
        if num_heads and num_heads % tp:
            raise LayoutError(f"train.parallel.tp={tp} does not divide the model's {num_heads} attention heads")
        stage_ranks = world // pp
        if n_experts:
            if n_experts % ep:
                raise LayoutError(f"train.parallel.ep={ep} does not divide the model's {n_experts} routed experts")
            if stage_ranks % (ep * etp):
                raise LayoutError(f"EP*ETP = {ep}*{etp} must divide the {stage_ranks} ranks of a pipeline stage "
                                  f"(world {world} / PP {pp}); change train.parallel.ep or etp")
            if etp not in (1, tp):
                raise LayoutError(f"train.parallel.etp={etp} must be 1 or equal to tp={tp}")
        elif ep != 1 or etp != 1:
            raise LayoutError(f"the model has no routed experts; train.parallel.ep and etp must be 1 (got {ep}, {etp})")
        split = tuple(pp_split) if pp_split is not None else None
        if split is None:
            if num_layers % pp:
                raise LayoutError(f"PP{pp} does not divide the model's {num_layers} layers evenly; "
                                  "set train.parallel.pp_layer_split or first/last stage sizes")
            split = (num_layers // pp,) * pp
        if len(split) != pp or any(s < 1 for s in split) or sum(split) != num_layers:
            raise LayoutError(f"pipeline split {list(split)} must have {pp} positive stage sizes summing to the "
                              f"model's {num_layers} layers (train.parallel.pp_layer_split)")
        return cls(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=world // (tp * pp * cp), pp_split=split,
                   sequence_parallel=bool(sequence_parallel and tp > 1))

    @classmethod
    def single(cls, num_layers: int) -> Layout:
        """One rank holding the whole model (the torch backend, a one-GPU run)."""
        return cls.resolve(world=1, num_layers=num_layers)

    @classmethod
    def from_json(cls, d: dict) -> Layout:
        d = dict(d)
        d["pp_split"] = tuple(d["pp_split"])
        d.pop("world", None)
        d.pop("edp", None)
        d.pop("stage_first_layers", None)
        return cls(**d)

    def to_json(self) -> dict:
        return {**asdict(self), "pp_split": list(self.pp_split), "world": self.world, "edp": self.edp,
                "stage_first_layers": self.stage_first_layers}

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert data parallel: replicas of each routed expert within a stage."""
        return self.world // (self.pp * self.ep * self.etp)

    @property
    def num_layers(self) -> int:
        return sum(self.pp_split)

    def size(self, dim: str) -> int:
        return getattr(self, dim)

    def sizes(self, dims: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(self.size(d) for d in dims)

    # -- pipeline stages -----------------------------------------------------------------------
    def stages(self) -> list[range]:
        """0-indexed global decoder layers of each stage."""
        out, at = [], 0
        for n in self.pp_split:
            out.append(range(at, at + n))
            at += n
        return out

    @property
    def stage_first_layers(self) -> list[int]:
        """1-indexed first layer of each stage (the DSA rule is stated in these numbers)."""
        return [s.start + 1 for s in self.stages()]

    def stage_of_layer(self, layer: int) -> int:
        """Stage holding 0-indexed global decoder layer `layer`."""
        for i, s in enumerate(self.stages()):
            if layer in s:
                return i
        raise LayoutError(f"layer {layer} is outside the model's {self.num_layers} layers")

    # -- ranks ---------------------------------------------------------------------------------
    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world:
            raise LayoutError(f"rank {rank} is outside the trainer's world of {self.world}")
        tp, cp, dp, pp = _decompose(rank, self.sizes(DENSE_DIMS))
        etp, ep, edp, pp_e = _decompose(rank, self.sizes(EXPERT_DIMS))
        if pp != pp_e:  # both put pp outermost; only an inconsistent layout can trip this
            raise LayoutError(f"rank {rank}: dense layout says stage {pp}, expert layout says {pp_e}")
        return RankCoords(rank, tp, cp, dp, pp, etp, ep, edp)

    def all_coords(self) -> list[RankCoords]:
        return [self.coords(r) for r in range(self.world)]

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group kind Megatron creates: tp, cp, dp, pp (dense) and etp, ep, edp (experts),
        each a list of rank lists in Megatron's enumeration order."""
        dense, expert = self.sizes(DENSE_DIMS), self.sizes(EXPERT_DIMS)
        out = {d: _groups_along(DENSE_DIMS, dense, d) for d in DENSE_DIMS}
        out.update({d: _groups_along(EXPERT_DIMS, expert, d) for d in ("etp", "ep", "edp")})
        return out

    def describe(self) -> str:
        return (f"TP{self.tp} PP{self.pp} CP{self.cp} EP{self.ep} ETP{self.etp} DP{self.dp} "
                f"(expert DP {self.edp}; {self.world} ranks; stages {list(self.pp_split)})")


def _decompose(rank: int, sizes: tuple[int, ...]) -> list[int]:
    out = []
    for s in sizes:
        out.append(rank % s)
        rank //= s
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
