"""Pipeline splits that respect DeepSeek Sparse Attention's index sharing.

With index sharing only some layers compute their own top-k; the others reuse the latest
computing layer's indices. A pipeline stage cannot reach back into the previous stage for them,
so every stage must start on a computing layer (GLM-5.2, PP4: starts 1, 19, 39, 59).
Megatron splits as first / uniform middle / last, so a split is (first, middle, last).
"""

from __future__ import annotations

from agentrl.models.arch import ModelArch


class PipelineSplitError(ValueError):
    pass


def stage_sizes(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Layers per stage from first/last sizes (middle stages share the rest evenly)."""
    if pp == 1:
        return [num_layers]
    if first is None and last is None:
        raise PipelineSplitError("stage_sizes needs first or last; use auto_split to choose them")
    if pp == 2:
        f = first if first is not None else num_layers - last  # type: ignore[operator]
        l_ = last if last is not None else num_layers - f
        if f + l_ != num_layers or f < 1 or l_ < 1:
            raise PipelineSplitError(f"PP2 split {f} + {l_} does not sum to the model's {num_layers} layers")
        return [f, l_]
    f = first if first is not None else 0
    l_ = last if last is not None else 0
    rest_stages = pp - 2 + (first is None) + (last is None)
    rest = num_layers - f - l_
    if rest <= 0 or rest % rest_stages:
        raise PipelineSplitError(
            f"first={first}, last={last} leave {rest} layers for {rest_stages} stages of PP{pp} "
            f"(a {num_layers}-layer model); they must divide evenly"
        )
    m = rest // rest_stages
    return [first or m] + [m] * (pp - 2) + [last or m]


def stage_starts(sizes: list[int]) -> list[int]:
    starts, at = [], 1
    for s in sizes:
        starts.append(at)
        at += s
    return starts


def check_split(arch: ModelArch, sizes: list[int]) -> list[int]:
    """Validate a split; returns the 1-indexed first layer of each stage."""
    if any(s < 1 for s in sizes):
        raise PipelineSplitError(f"every pipeline stage needs at least one layer, got {sizes}")
    if sum(sizes) != arch.num_layers:
        raise PipelineSplitError(f"stage sizes {sizes} sum to {sum(sizes)}, but {arch.name} has {arch.num_layers} layers")
    starts = stage_starts(sizes)
    bad = [s for s in starts if not arch.computes_index(s)]
    if bad:
        valid = arch.computing_layers()
        raise PipelineSplitError(
            f"pipeline stage would start on layer {bad[0]}, which reuses the DSA index of an earlier layer "
            f"({arch.name}: index_topk_freq={arch.index_topk_freq}, offset={arch.index_skip_topk_offset}); "
            f"every stage must start on an indexer-computing layer. Valid starts: {valid}"
        )
    return starts


def auto_split(arch: ModelArch, pp: int) -> list[int]:
    """The DSA-valid (first, uniform middle, last) split with the smallest most-loaded stage.

    Cost is layers per stage, plus the MTP layers on the last stage (the LM head and embedding
    are left out: counting the head as ~2 layers would move GLM-5.2's PP4 split off the recipe's
    18-20-20-20 for a 1-layer gain). Ties go to the split with the most even stages."""
    n = arch.num_layers
    if pp > n:
        raise PipelineSplitError(f"PP{pp} needs at least {pp} layers; {arch.name} has {n}")
    if pp == 1:
        return [n]
    best: tuple[tuple[int, int], list[int]] | None = None
    for first in range(1, n):
        for last in range(1, n - first + 1):
            try:
                sizes = stage_sizes(n, pp, first, last)
                check_split(arch, sizes)
            except PipelineSplitError:
                continue
            costs = sizes[:-1] + [sizes[-1] + arch.num_mtp_layers]
            key = (max(costs), max(costs) - min(costs))
            if best is None or key < best[0]:
                best = (key, sizes)
    if best is None:
        raise PipelineSplitError(
            f"no DSA-valid PP{pp} split of {arch.name}: stages must start on {arch.computing_layers()}"
        )
    return best[1]
