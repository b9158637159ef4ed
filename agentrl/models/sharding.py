"""Tensor-level TP / EP / PP shard and unshard of a full Megatron GPTModel state dict, on CPU.

No Megatron process is needed: this is the pure layout arithmetic the Megatron modules apply, used
to hand each trainer rank its slice, to gather a full state dict for export, and to test both.

Tensor parallel kinds (read from megatron-core 0.19.2's DSA spec, experimental_attention_variant_
module_specs.py): column-parallel (dim 0) for linear_q_up_proj, linear_kv_up_proj (per-head rows,
so a TP slice is whole heads), output_layer and MTP eh_proj; vocab-parallel (dim 0) for the
embedding; row-parallel (dim 1) for linear_proj and every linear_fc2; GLU fc1 (dense, shared and
routed experts) is column-parallel per half: rank r holds [gate_r; up_r], as Megatron's
apply_swiglu_sharded_factory lays it out. q/kv down projections, the DSA indexer (parallel_mode
"duplicated"), norms and the router are replicated.
Experts: EP rank r owns global experts [r*E/ep, (r+1)*E/ep), renumbered from 0; expert tensor
parallelism (etp) is supported for etp == 1 (experts whole on every TP rank) or etp == tp.
Pipeline: stage s owns its decoder layers renumbered from 0; the embedding lives on the first stage
(and on the last when there is MTP, which embeds the shifted tokens); final norm, output layer and
MTP layers on the last (with tied weights and no MTP, the last stage's output_layer.weight is a
copy of the embedding). Every stage must start on a DSA index-computing layer.
"""

from __future__ import annotations

import re
from typing import Any, Literal, NamedTuple

import torch

from agentrl.config.layout import Layout, RankCoords
from agentrl.models.mapping import arch_from_hf, num_mtp_layers

TpKind = Literal["replicated", "column", "row", "glu"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_SEQ_EXPERT = re.compile(r"^(.*mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"^(.*mlp\.experts\.)(linear_fc[12])\.weight(\d+)$")

_COLUMN_SUFFIXES = ("self_attention.linear_q_up_proj.weight", "self_attention.linear_kv_up_proj.weight",
                    "eh_proj.weight")
_ROW_SUFFIXES = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight",
                 "mlp.shared_experts.linear_fc2.weight")
_GLU_SUFFIXES = ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight")


class RankCoord(NamedTuple):
    """The coordinates that decide what a rank holds: its stage, TP rank and EP rank (CP and DP
    ranks hold copies)."""

    pp: int
    tp: int
    ep: int


def shard_keys(layout: Layout) -> list[RankCoord]:
    """Every distinct shard of `layout`, in (pp, tp, ep) order."""
    return [RankCoord(p, t, e) for p in range(layout.pp) for t in range(layout.tp) for e in range(layout.ep)]


def shard_key(coords: RankCoords) -> RankCoord:
    return RankCoord(coords.pp, coords.tp, coords.ep)


def tp_kind(name: str) -> TpKind:
    """Tensor-parallel layout of a non-expert Megatron parameter (full or stage-local name)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "column"
    if name.endswith(_GLU_SUFFIXES):
        return "glu"
    if name.endswith(_COLUMN_SUFFIXES):
        return "column"
    if name.endswith(_ROW_SUFFIXES):
        return "row"
    return "replicated"


def split_tensor(t: torch.Tensor, n: int, kind: TpKind, name: str) -> list[torch.Tensor]:
    if n == 1 or kind == "replicated":
        return [t] * n
    dim = 1 if kind == "row" else 0
    size = t.shape[dim] // 2 if kind == "glu" else t.shape[dim]
    if size % n:
        raise ValueError(f"{name}: dim {dim} of shape {tuple(t.shape)} does not split {n} ways ({kind} parallel); "
                         "pick a tensor/expert-tensor parallel size that divides it")
    if kind == "glu":
        gates, ups = (h.chunk(n, dim=0) for h in t.chunk(2, dim=0))
        return [torch.cat([g, u], dim=0) for g, u in zip(gates, ups, strict=True)]
    return [p.clone() for p in t.chunk(n, dim=dim)]


def join_tensors(pieces: list[torch.Tensor], kind: TpKind, name: str) -> torch.Tensor:
    if kind == "replicated" or len(pieces) == 1:
        for p in pieces[1:]:
            if not torch.equal(p, pieces[0]):
                raise ValueError(f"{name}: replicated copies differ between ranks; the shards are inconsistent")
        return pieces[0]
    if kind == "glu":
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(pieces, dim=1 if kind == "row" else 0)


def check_layout(config: Any, layout: Layout) -> list[range]:
    """The layout's stages, after checking that it fits this model config (the same rules the
    planner applied to the named model: a checkpoint's config may differ)."""
    if layout.etp not in (1, layout.tp):
        raise ValueError(f"expert tensor parallel size {layout.etp} must be 1 or tp={layout.tp}")
    if config.n_routed_experts % layout.ep:
        raise ValueError(f"ep={layout.ep} does not divide {config.n_routed_experts} routed experts")
    if layout.num_layers != config.num_hidden_layers:
        raise ValueError(f"the layout splits {layout.num_layers} layers but the model has {config.num_hidden_layers}")
    stages = layout.stages()
    arch = arch_from_hf(config)
    bad = [s.start + 1 for s in stages if not arch.computes_index(s.start + 1)]
    if bad:
        raise ValueError(
            f"pipeline stages starting at layers {bad} (1-indexed) begin on a layer that reuses another "
            f"layer's DSA top-k; every stage must start on one of {arch.computing_layers()}"
        )
    return stages


def _expert_parts(rest: str) -> tuple[str, int, str, bool] | None:
    """(prefix, expert, linear, grouped) of an expert parameter name tail, else None."""
    if m := _SEQ_EXPERT.match(rest):
        return m.group(1), int(m.group(2)), m.group(3), False
    if m := _GROUPED_EXPERT.match(rest):
        return m.group(1), int(m.group(3)), m.group(2), True
    return None


def _expert_name(prefix: str, expert: int, linear: str, grouped: bool) -> str:
    return f"{prefix}{linear}.weight{expert}" if grouped else f"{prefix}local_experts.{expert}.{linear}.weight"


class _Placement(NamedTuple):
    stages: tuple[int, ...]  # pipeline stages holding the tensor
    local_name: str  # name on those stages (layer renumbered)
    ep_rank: int | None  # None: not an expert tensor
    local_expert_name: str  # name with the expert renumbered (== local_name for non-experts)
    kind: TpKind  # split over tp (non-expert) or etp (expert)


def _place(name: str, stages: list[range], n_experts: int, layout: Layout, has_mtp: bool) -> _Placement:
    last = len(stages) - 1
    if m := _LAYER.match(name):
        layer, rest = int(m.group(1)), m.group(2)
        stage = next((i for i, s in enumerate(stages) if layer in s), None)
        if stage is None:
            raise ValueError(f"{name}: layer {layer} outside the model's {stages[-1].stop} layers")
        stage_ids, prefix = (stage,), f"decoder.layers.{layer - stages[stage].start}."
    elif m := _MTP.match(name):
        rest, stage_ids, prefix = m.group(2), (last,), f"mtp.layers.{m.group(1)}."
    elif name == "embedding.word_embeddings.weight":
        return _Placement((0, last) if has_mtp and last else (0,), name, None, name, "column")
    elif name in ("decoder.final_layernorm.weight", "output_layer.weight"):
        return _Placement((last,), name, None, name, tp_kind(name))
    else:
        raise ValueError(f"{name}: not a GPTModel parameter name this sharder knows")
    local = prefix + rest
    expert = _expert_parts(rest)
    if expert is None:
        return _Placement(stage_ids, local, None, local, tp_kind(rest))
    eprefix, e, linear, grouped = expert
    per_rank = n_experts // layout.ep
    kind: TpKind = "glu" if linear == "linear_fc1" else "row"
    local_expert = prefix + _expert_name(eprefix, e % per_rank, linear, grouped)
    return _Placement(stage_ids, local, e // per_rank, local_expert, kind)


def shard_state_dict(state_dict: dict[str, torch.Tensor], config: Any,
                     layout: Layout) -> dict[RankCoord, dict[str, torch.Tensor]]:
    """Full Megatron state dict -> one state dict per (pp, tp, ep) rank coordinate."""
    stages = check_layout(config, layout)
    has_mtp = num_mtp_layers(config) > 0
    shards: dict[RankCoord, dict[str, torch.Tensor]] = {c: {} for c in shard_keys(layout)}
    for name, tensor in state_dict.items():
        p = _place(name, stages, config.n_routed_experts, layout, has_mtp)
        if p.ep_rank is None:
            pieces = split_tensor(tensor, layout.tp, p.kind, name)
            for coord, shard in shards.items():
                if coord.pp in p.stages:
                    shard[p.local_name] = pieces[coord.tp]
        else:
            pieces = split_tensor(tensor, layout.etp, p.kind, name)
            for coord, shard in shards.items():
                if coord.pp in p.stages and coord.ep == p.ep_rank:
                    shard[p.local_expert_name] = pieces[coord.tp % layout.etp]
    if config.tie_word_embeddings and layout.pp > 1 and not has_mtp:
        # Megatron's last stage holds the tied head as its own output_layer.weight, a copy of the
        # embedding kept equal by the embedding-group all-reduce (export reads the first stage's).
        pieces = split_tensor(state_dict["embedding.word_embeddings.weight"], layout.tp, "column", "output_layer.weight")
        for coord, shard in shards.items():
            if coord.pp == layout.pp - 1:
                shard["output_layer.weight"] = pieces[coord.tp]
    return shards


def _global_name(local: str, stage: int, ep_rank: int, stages: list[range], per_rank: int) -> tuple[str, bool]:
    """Inverse of _place for one rank: (full name, is_expert)."""
    if m := _LAYER.match(local):
        prefix, rest = f"decoder.layers.{int(m.group(1)) + stages[stage].start}.", m.group(2)
    elif m := _MTP.match(local):
        prefix, rest = f"mtp.layers.{m.group(1)}.", m.group(2)
    else:
        return local, False
    expert = _expert_parts(rest)
    if expert is None:
        return prefix + rest, False
    eprefix, e, linear, grouped = expert
    return prefix + _expert_name(eprefix, ep_rank * per_rank + e, linear, grouped), True


def unshard_state_dict(shards: dict[RankCoord, dict[str, torch.Tensor]], config: Any,
                       layout: Layout) -> dict[str, torch.Tensor]:
    """Inverse of shard_state_dict; replicated copies must agree bitwise."""
    stages = check_layout(config, layout)
    expected = set(shard_keys(layout))
    if set(shards) != expected:
        raise ValueError(f"shards cover ranks {sorted(shards)}, the layout needs {sorted(expected)}")
    per_rank = config.n_routed_experts // layout.ep
    # full name -> {split index: [copies]}, plus its kind
    pieces: dict[str, dict[int, list[torch.Tensor]]] = {}
    kinds: dict[str, TpKind] = {}
    tied_copy = config.tie_word_embeddings and layout.pp > 1 and not num_mtp_layers(config)
    for coord in sorted(shards):
        for local, tensor in shards[coord].items():
            if tied_copy and local == "output_layer.weight":
                continue  # the last stage's copy of the tied embedding
            name, is_expert = _global_name(local, coord.pp, coord.ep, stages, per_rank)
            if is_expert:
                kinds[name] = "glu" if ".linear_fc1." in name or "linear_fc1.weight" in name else "row"
                index = coord.tp % layout.etp
            else:
                kinds[name] = tp_kind(name)
                index = coord.tp
            pieces.setdefault(name, {}).setdefault(index, []).append(tensor)
    out: dict[str, torch.Tensor] = {}
    for name, by_index in pieces.items():
        n = len(by_index)
        if sorted(by_index) != list(range(n)):
            raise ValueError(f"{name}: shards {sorted(by_index)} are missing tensor-parallel pieces")
        firsts = [join_tensors(by_index[i], "replicated", name) for i in range(n)]
        out[name] = join_tensors(firsts, kinds[name], name)
    return out
