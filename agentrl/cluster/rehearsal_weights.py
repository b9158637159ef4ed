"""The weight-update schedule: which trainer rank sends which HF-named tensors, in which buckets,
to which engine ranks.

Shape of the update (the NCCL path DESIGN.md describes): one broadcast group per pipeline stage.
Its rank 0 is the stage's sender, the trainer rank with tp = cp = dp = 0 of that stage; it gathers
tensor-parallel pieces over its TP group and routed experts from their owners in its EP group,
converts to HF names, and broadcasts bucket by bucket to every GPU of every engine (each engine
rank receives full tensors and keeps its own shard). So every engine receives every tensor of the
model exactly once: from the one stage that owns it.

Tensors: the HF parameter list of the named model at meta-device size (transformers builds the
module tree without memory), routed experts expanded to the per-expert checkpoint names engines
load, plus the MTP layers transformers does not build (shapes from the last decoder layer, the spec
Megatron copies). The MTP copies of embedding and LM head are aliases of the main ones and are not
sent. Sizes are BF16 except the fp32 router bias (or FP8 for the tensors `fp8` names). Buckets come
from the planner every transport uses (agentrl.sync.buckets.plan_buckets), per stage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from agentrl.cluster.rehearsal_ranks import group_index
from agentrl.config.layout import Layout, RankCoords
from agentrl.sync.buckets import DEFAULT_BUCKET_BYTES, FP8Choice, TensorSpec, plan_buckets

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")
_FP32 = ("mlp.gate.e_score_correction_bias",)


class WeightScheduleError(ValueError):
    pass


@dataclass
class Bucket:
    stage: int
    index: int
    sender: int  # trainer global rank
    sources: list[int]  # trainer ranks the sender gathers pieces from (itself included)
    tensors: list[str]
    nbytes: int

    def to_json(self) -> dict:
        return {"stage": self.stage, "index": self.index, "sender": self.sender, "sources": self.sources,
                "tensors": len(self.tensors), "first": self.tensors[0], "last": self.tensors[-1],
                "bytes": self.nbytes}


@dataclass
class UpdateGroup:
    """One NCCL broadcast group: rank 0 the sender, then every engine GPU in engine order."""

    name: str
    stage: int
    sender: int
    engine_ranks: list[tuple[int, int]]  # (engine index, local rank), group rank = position + 1

    @property
    def world_size(self) -> int:
        return 1 + len(self.engine_ranks)

    def to_json(self) -> dict:
        return {"name": self.name, "stage": self.stage, "sender": self.sender, "world_size": self.world_size,
                "engine_ranks": [f"e{e}:{r}" for e, r in self.engine_ranks]}


def _dtype(name: str) -> str:
    return "float32" if name.endswith(_FP32) else "bfloat16"


@lru_cache(maxsize=4)
def model_tensors(model_name: str) -> tuple[TensorSpec, ...]:
    """Every HF tensor an engine loads for `model_name` (a named GLM model), in checkpoint order.
    Cached: building the meta model and the mapping takes seconds."""
    import torch
    from transformers import GlmMoeDsaForCausalLM

    from agentrl.models.hf_config import glm_model_names, hf_config_for
    from agentrl.models.mapping import mapping_rules

    if model_name not in glm_model_names():
        raise WeightScheduleError(f"the weight schedule is built for GLM models ({', '.join(glm_model_names())}); "
                                  f"got model.name={model_name!r}")
    cfg = hf_config_for(model_name)
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(cfg)
    shapes: dict[str, tuple[int, ...]] = {n: tuple(t.shape) for n, t in model.named_parameters()}
    shapes.update({n: tuple(t.shape) for n, t in model.named_buffers() if n.endswith(_FP32)})
    for name in [n for n in shapes if n.endswith("mlp.experts.gate_up_proj")]:
        e, two_i, h = shapes.pop(name)
        down = shapes.pop(name.replace("gate_up_proj", "down_proj"))
        base = name[: -len("gate_up_proj")]
        for x in range(e):
            shapes[f"{base}{x}.gate_proj.weight"] = (two_i // 2, h)
            shapes[f"{base}{x}.up_proj.weight"] = (two_i // 2, h)
            shapes[f"{base}{x}.down_proj.weight"] = tuple(down[1:])
    n_layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    out, seen = [], set()
    for rule in mapping_rules(cfg, hf_experts="per_expert"):
        if rule.kind == "alias":
            continue
        for name in rule.hf:
            shape = shapes.get(name) or _mtp_shape(name, shapes, n_layers, hidden)
            out.append(TensorSpec(name, _dtype(name), tuple(shape)))
            seen.add(name)
    missing = sorted(set(shapes) - seen)
    if missing:
        raise WeightScheduleError(f"{len(missing)} tensor(s) of {model_name} have no HF<->Megatron mapping rule, "
                                  f"e.g. {missing[:3]}; agentrl.models.mapping must cover them")
    return tuple(out)


def _mtp_shape(name: str, shapes: dict[str, tuple[int, ...]], n_layers: int, hidden: int) -> tuple[int, ...]:
    m = _LAYER.match(name)
    if not m or int(m.group(1)) < n_layers:
        raise WeightScheduleError(f"{name}: not in the model and not an MTP layer tensor")
    rest = m.group(2)
    own = {"enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
           "shared_head.norm.weight": (hidden,)}
    if rest in own:
        return own[rest]
    twin = f"model.layers.{n_layers - 1}.{rest}"  # Megatron builds the MTP layer from the last layer's spec
    if twin not in shapes:
        # the last layer may not compute the DSA index while the MTP layer does: any computing layer
        twin = next((n for n in shapes if n.endswith("." + rest) and n.startswith("model.layers.")), None)
        if twin is None:
            raise WeightScheduleError(f"{name}: no decoder tensor of the same kind to take its shape from")
    return shapes[twin]


def tensor_stage(name: str, stage_first_layers: list[int], n_layers: int) -> int:
    """Pipeline stage that owns an HF tensor (embedding: first; norm, head, MTP: last)."""
    last = len(stage_first_layers) - 1
    if name == "model.embed_tokens.weight":
        return 0
    m = _LAYER.match(name)
    if not m:
        return last  # model.norm.weight, lm_head.weight
    layer = int(m.group(1)) + 1  # 1-indexed
    if layer > n_layers:
        return last
    return max(i for i, start in enumerate(stage_first_layers) if start <= layer)


def _sources(name: str, sender: RankCoords, coords: list[RankCoords], layout: Layout, n_experts: int,
             tp_groups: list[list[int]], ep_groups: list[list[int]]) -> list[int]:
    from agentrl.models.sharding import tp_kind

    m = _LAYER.match(name)
    rest = m.group(2) if m else name
    if (e := _EXPERT.match(rest)) and n_experts:
        owner_ep = int(e.group(1)) // (n_experts // layout.ep)
        ep_group = ep_groups[group_index(ep_groups)[sender.rank]]
        owner = next(r for r in ep_group if coords[r].ep == owner_ep)
        if layout.etp == 1:
            return [owner]
        return sorted(r for r in range(len(coords)) if coords[r].pp == sender.pp and coords[r].ep == owner_ep
                      and coords[r].edp == coords[owner].edp)
    mg = _MG_KIND.get(rest.rsplit(".", 1)[0] if "." in rest else rest)
    kind = tp_kind(mg) if mg else "replicated"
    if kind == "replicated" or layout.tp == 1:
        return [sender.rank]
    return list(tp_groups[group_index(tp_groups)[sender.rank]])


# HF module path (below the layer) -> a Megatron name whose TP layout is the same (sharding.tp_kind).
_MG_KIND = {
    "self_attn.q_b_proj": "self_attention.linear_q_up_proj.weight",
    "self_attn.kv_b_proj": "self_attention.linear_kv_up_proj.weight",
    "self_attn.o_proj": "self_attention.linear_proj.weight",
    "mlp.gate_proj": "mlp.linear_fc1.weight", "mlp.up_proj": "mlp.linear_fc1.weight",
    "mlp.down_proj": "mlp.linear_fc2.weight",
    "mlp.shared_experts.gate_proj": "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.up_proj": "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.down_proj": "mlp.shared_experts.linear_fc2.weight",
    "eh_proj": "eh_proj.weight",
    "model.embed_tokens": "embedding.word_embeddings.weight",
    "lm_head": "output_layer.weight",
}


def build_schedule(tensors: tuple[TensorSpec, ...], plan, coords: list[RankCoords], layout: Layout,
                   groups: dict[str, list[list[int]]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   fp8: FP8Choice | None = None) -> tuple[list[UpdateGroup], list[Bucket]]:
    """Update groups (one per stage) and the buckets each stage's sender broadcasts (the planner of
    agentrl.sync.buckets, over each stage's tensors in order)."""
    from agentrl.models.arch import get_arch

    if bucket_bytes < 1:
        raise WeightScheduleError(f"bucket size must be positive, got {bucket_bytes}")
    arch = get_arch(plan.model)
    engine_ranks = [(e.index, r) for e in plan.engines for r in range(max(int(e.gpus), 1))]
    senders = {c.pp: c.rank for c in coords if c.tp == 0 and c.cp == 0 and c.dp == 0}
    ugroups = [UpdateGroup(f"agentrl-weights-pp{s}", s, senders[s], list(engine_ranks)) for s in range(layout.pp)]
    buckets: list[Bucket] = []
    per_stage: dict[int, list[TensorSpec]] = {s: [] for s in range(layout.pp)}
    for t in tensors:
        per_stage[tensor_stage(t.name, plan.layout.stage_first_layers, arch.num_layers)].append(t)
    for s, specs in per_stage.items():
        sender = coords[senders[s]]
        for planned in plan_buckets(specs, bucket_bytes, fp8):
            sources: set[int] = set()
            for name in planned.tensors:
                sources.update(_sources(name, sender, coords, layout, arch.n_routed_experts, groups["tp"], groups["ep"]))
            buckets.append(Bucket(s, planned.index, sender.rank, sorted(sources), list(planned.tensors), planned.nbytes))
    return ugroups, buckets


def check_schedule(tensors: tuple[TensorSpec, ...], plan, ugroups: list[UpdateGroup], buckets: list[Bucket],
                   coords: list[RankCoords]) -> None:
    """Every engine rank receives every tensor exactly once; senders and sources sit in the right stage."""
    by_stage: dict[int, list[str]] = {}
    for b in buckets:
        if coords[b.sender].pp != b.stage or any(coords[r].pp != b.stage for r in b.sources):
            raise WeightScheduleError(f"bucket {b.stage}.{b.index}: sender {b.sender} or sources {b.sources} "
                                      f"are not in pipeline stage {b.stage}")
        by_stage.setdefault(b.stage, []).extend(b.tensors)
    want = [t.name for t in tensors]
    want_set = set(want)
    if len(want_set) != len(want):
        raise WeightScheduleError("the model's tensor list names a tensor twice")
    members: dict[tuple[int, int], list[int]] = {}
    for g in ugroups:
        if len(set(g.engine_ranks)) != len(g.engine_ranks):
            raise WeightScheduleError(f"update group {g.name} lists an engine rank twice")
        for er in g.engine_ranks:
            members.setdefault(er, []).append(g.stage)
    expected = {(e.index, r) for e in plan.engines for r in range(max(int(e.gpus), 1))}
    if set(members) != expected:
        raise WeightScheduleError(f"update groups reach engine ranks {sorted(set(members) ^ expected)[:5]} "
                                  f"wrongly (missing or unknown)")
    checked: dict[tuple[int, ...], None] = {}
    for (e, r), stages in members.items():
        key = tuple(sorted(stages))
        if key in checked:
            continue
        got = [n for s in key for n in by_stage.get(s, [])]
        if len(got) != len(set(got)) or set(got) != want_set:
            dup = len(got) - len(set(got))
            missing = sorted(want_set - set(got))[:3]
            raise WeightScheduleError(f"engine {e} rank {r} would receive {dup} tensor(s) twice and miss "
                                      f"{len(want_set - set(got))} (e.g. {missing}); every tensor must arrive once")
        checked[key] = None
