"""Full HF-named tensors out of a Megatron model sharded over TP / PP / EP, one tensor at a time.

`model_hf_weights` walks mapping.mapping_rules in order and, for each Megatron tensor a rule needs
(its global name: global layer numbers, global expert numbers), assembles the full tensor on the
pipeline stage that holds it and broadcasts it over the pipeline group, so EVERY rank receives
every tensor (every rank must iterate: the assembly is collective):
- routed experts: broadcast from the expert-parallel rank that owns the expert (EP rank r owns
  experts [r*E/ep, (r+1)*E/ep), numbered from 0 locally, as agentrl.models.sharding lays them);
- tensor-parallel pieces: all-gathered and joined with sharding.join_tensors;
- pipeline stages: decoder layers renumbered from each stage's first layer; the embedding comes
  from the first stage (the last stage's MTP copy is equal to it), the final norm, the output layer
  and MTP layers from the last.
Peak extra memory is one rule's tensors (for fused HF experts: one layer's stacked experts).
What each stage holds (global name, stage, shape, dtype) is exchanged once per exporter, so the
receiving stages can allocate without asking.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agentrl.config.layout import Layout

_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class Held:
    """Where one global Megatron tensor lives and what it looks like assembled."""

    stage: int
    local_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _global_name(local_name: str, stage_start: int, ep_rank: int, per_rank: int) -> str:
    name = local_name
    if m := _LAYER.match(name):
        name = f"decoder.layers.{int(m.group(1)) + stage_start}.{m.group(2)}"
    if m := _LOCAL_EXPERT.match(name):
        name = f"{m.group(1)}{ep_rank * per_rank + int(m.group(2))}{m.group(3)}"
    return name


def _full_shape(local_name: str, t: torch.Tensor, tp: int) -> tuple[int, ...]:
    from agentrl.models.sharding import tp_kind

    shape = list(t.shape)
    if tp > 1 and not _LOCAL_EXPERT.match(local_name):
        kind = tp_kind(local_name)
        if kind in ("column", "glu"):
            shape[0] *= tp
        elif kind == "row":
            shape[1] *= tp
    return tuple(shape)


class MegatronExporter:
    """HF weights of one rank's Megatron model; build it on every rank (its constructor is a
    collective) and iterate `hf_weights` on every rank in step."""

    def __init__(self, model: torch.nn.Module, config: Any, layout: Layout):
        from megatron.core import parallel_state as ps

        self.model, self.config, self.layout = model, config, layout
        self.stage = ps.get_pipeline_model_parallel_rank()
        start = layout.stages()[self.stage].start
        per_rank = (config.n_routed_experts // layout.ep) if config.n_routed_experts else 0
        ep_rank, tp = ps.get_expert_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        mine: dict[str, Held] = {}
        for local_name, t in self._local().items():
            if local_name == _EMBEDDING and self.stage != 0:
                continue  # the MTP stage's copy; the first stage's is exported
            name = _global_name(local_name, start, ep_rank, per_rank)
            mine[name] = Held(self.stage, local_name, _full_shape(local_name, t, tp), t.dtype)
        everyone: list[dict[str, Held]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
        self.table: dict[str, Held] = {}
        for held in everyone:
            self.table.update(held)

    def _local(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict(keep_vars=True).items()
                if not k.endswith("_extra_state")}

    def full_tensor(self, name: str, local: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full tensor `name` (global Megatron name) on every rank; `dtype`: that of `local`'s
        tensors when they are not the model's (gradients)."""
        from megatron.core import parallel_state as ps

        held = self.table.get(name)
        if held is None:
            raise KeyError(f"{name}: no rank of this model holds it (was the model built from this config?)")
        dtype = dtype or held.dtype
        t = self._assemble(name, held, local, dtype) if held.stage == self.stage else None
        if self.layout.pp > 1:
            buf = t.contiguous() if t is not None else torch.empty(held.shape, dtype=dtype, device=self._device(local))
            dist.broadcast(buf, group=ps.get_pipeline_model_parallel_group(), group_src=held.stage)
            t = buf
        return t

    @staticmethod
    def _device(local: dict[str, torch.Tensor]) -> torch.device:
        return next(iter(local.values())).device

    def _assemble(self, name: str, held: Held, local: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Collective over this stage's EP / TP groups."""
        from megatron.core import parallel_state as ps

        from agentrl.models.sharding import join_tensors, tp_kind

        if m := _LOCAL_EXPERT.match(name):
            ep = ps.get_expert_model_parallel_world_size()
            per_rank = self.config.n_routed_experts // ep
            expert = int(m.group(2))
            local_name = _LOCAL_EXPERT.sub(lambda x: f"{x.group(1)}{expert % per_rank}{x.group(3)}", held.local_name)
            t = local[local_name]
            if ep > 1:
                owner = expert // per_rank
                buf = t.contiguous() if ps.get_expert_model_parallel_rank() == owner else torch.empty(
                    held.shape, dtype=dtype, device=t.device)
                dist.broadcast(buf, group=ps.get_expert_model_parallel_group(), group_src=owner)
                t = buf
            return t
        t = local[held.local_name]
        tp = ps.get_tensor_model_parallel_world_size()
        kind = tp_kind(held.local_name)
        if tp > 1 and kind != "replicated":
            pieces = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(pieces, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            t = join_tensors(pieces, kind, name)
        return t

    def hf_weights(self, hf_experts: str = "fused", local: dict[str, torch.Tensor] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """`local`: fp32 tensors in the place of the model's own (same names and shapes): gradients."""
        dtype = None if local is None else torch.float32
        local = self._local() if local is None else local
        yield from hf_named_weights(self.config, lambda n: self.full_tensor(n, local, dtype), hf_experts=hf_experts)


def grads_like_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict names mapped to fp32 gradients (`main_grad`; zeros for frozen
    params and buffers), with grouped experts' stacked grads seen as per-expert views."""
    grads = {n: p.main_grad for n, p in model.named_parameters() if getattr(p, "main_grad", None) is not None}
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        m = re.match(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.linear_fc([12])\.weight$", name)
        if m and f"{m.group(1)}weight{m.group(3)}" in grads:
            out[name] = grads[f"{m.group(1)}weight{m.group(3)}"][int(m.group(2))]
        else:
            out[name] = grads.get(name, torch.zeros(t.shape, dtype=torch.float32, device=t.device))
    return out


def hf_named_weights(config: Any, fetch: Callable[[str], torch.Tensor], *,
                     hf_experts: str = "fused") -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the model, in mapping-rule order, fetching each Megatron
    tensor by its full name. MTP embed/head aliases are emitted as the shared tensor itself."""
    from agentrl.models.mapping import MegatronNaming, mapping_rules, rule_to_hf

    if hf_experts not in ("fused", "per_expert"):
        raise ValueError(f"hf_experts must be 'fused' or 'per_expert', got {hf_experts!r}")
    for rule in mapping_rules(config, MegatronNaming(), hf_experts):  # type: ignore[arg-type]
        tensors = [fetch(n) for n in rule.mg]
        yield from zip(rule.hf, rule_to_hf(rule, tensors), strict=True)


# ---------------------------------------------------------------- weight updates: one stage, to its sender

EXPERT_WINDOW = 4  # expert messages the sender has posted receives for ahead of use (bounded buffers)


@dataclass(frozen=True)
class StageItem:
    """One mapping rule of a stage: its HF tensors, its Megatron tensors and who holds them."""

    rule: Any  # agentrl.models.mapping.Rule
    hf: list[Any]  # agentrl.sync.buckets.TensorSpec per HF tensor
    local: list[str]  # the rule's Megatron tensors by their name on the holding rank
    kind: str  # "local": the sender has it whole; "tp": TP shards gathered to the sender; "expert"
    owner: int  # global rank holding it (an expert's EP owner; else the sender)
    tp_kind: str = "replicated"


class StageExport:
    """The HF tensors of one pipeline stage, assembled on the stage's sender only (the tp = cp = dp
    = 0 rank): TP shards gathered to it over its TP group, routed experts sent to it point to point
    by their owner in its EP group (EXPERT_WINDOW messages in flight; FP8 conversion done by the
    owner), layer names made global (the MTP layer included). Ranks outside the sender's TP and EP
    groups take no part. Every participant calls `run` with the same arguments.

    `specs()` (the same on every rank of the stage, from local shapes alone) is what the bucket
    planner plans with; `run(emit, fp8)` calls emit(wire_name, tensor) on the sender for every wire
    tensor in spec order (FP8 weights as e4m3 + `_scale_inv`)."""

    def __init__(self, model: torch.nn.Module, config: Any, layout: Layout, rank: int):
        from agentrl.models.mapping import MegatronNaming, mapping_rules
        from agentrl.models.sharding import tp_kind
        from agentrl.sync.buckets import TensorSpec, dtype_name

        self.model, self.config, self.layout, self.rank = model, config, layout, rank
        coords = layout.all_coords()
        me = coords[rank]
        self.stage = me.pp
        self.sender = next(c.rank for c in coords if c.pp == me.pp and c.tp == 0 and c.cp == 0 and c.dp == 0)
        groups = layout.groups()
        self.tp_ranks = next(g for g in groups["tp"] if self.sender in g)
        self.ep_ranks = next(g for g in groups["ep"] if self.sender in g)
        self.participates = rank in self.tp_ranks or rank in self.ep_ranks
        n_exp = config.n_routed_experts or 0
        per_rank = n_exp // layout.ep if n_exp else 0
        start = layout.stages()[self.stage].start
        local = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
        held: dict[str, tuple[str, torch.Tensor]] = {}  # global Megatron name -> (local name, local tensor)
        for name, t in local.items():
            if name == _EMBEDDING and self.stage != 0:
                continue  # the MTP stage's copy; the first stage's is exported
            if m := _LOCAL_EXPERT.match(name):
                for owner in range(layout.ep):  # every EP rank's experts look like this rank's own
                    held[_global_name(name, start, owner, per_rank)] = (name, t)
            else:
                held[_global_name(name, start, 0, per_rank)] = (name, t)
        tp = layout.tp
        self.items: list[StageItem] = []
        for rule in mapping_rules(config, MegatronNaming(), "per_expert"):
            if rule.kind == "alias" or not all(n in held for n in rule.mg):
                continue
            locs = [held[n][0] for n in rule.mg]
            t0 = held[rule.mg[0]][1]
            shape = _full_shape(locs[0], t0, tp)
            hf_shapes = [(shape[0] // 2, *shape[1:])] * 2 if rule.kind == "glu" else [shape]
            hf = [TensorSpec(n, dtype_name(t0.dtype), tuple(s)) for n, s in zip(rule.hf, hf_shapes, strict=True)]
            if m := _LOCAL_EXPERT.match(rule.mg[0]):
                owner = self.ep_ranks[int(m.group(2)) // per_rank]
                self.items.append(StageItem(rule, hf, locs, "expert", owner))
                continue
            kind = tp_kind(locs[0])
            sharded = tp > 1 and kind != "replicated"
            self.items.append(StageItem(rule, hf, locs, "tp" if sharded else "local", self.sender, kind))
        self._local = local

    def specs(self) -> list[Any]:
        return [s for it in self.items for s in it.hf]

    def _wire(self, item: StageItem, tensors: list[torch.Tensor], fp8: frozenset[str]) -> list[tuple[str, torch.Tensor]]:
        from agentrl.models.mapping import rule_to_hf
        from agentrl.sync.fp8 import to_wire

        out = []
        for spec, t in zip(item.hf, rule_to_hf(item.rule, tensors), strict=True):
            out += to_wire(spec.name, t.contiguous(), spec.name in fp8)
        return out

    @staticmethod
    def _wire_order(item: StageItem, fp8: frozenset[str]) -> list[Any]:
        from agentrl.sync.buckets import wire_entries

        return [e for s in item.hf for e in wire_entries(s, s.name in fp8)]

    @staticmethod
    def _message(item: StageItem, fp8: frozenset[str]):
        from agentrl.sync.buckets import aligned

        return aligned(StageExport._wire_order(item, fp8))

    def run(self, emit: Callable[[str, torch.Tensor], None], fp8: frozenset[str] = frozenset()) -> None:
        from megatron.core import parallel_state as ps

        from agentrl.models.sharding import join_tensors
        from agentrl.sync.buckets import fill

        if not self.participates:
            return
        device = next(iter(self._local.values())).device
        sender = self.rank == self.sender
        remote = [i for i, it in enumerate(self.items) if it.kind == "expert" and it.owner != self.sender]
        posted: dict[int, tuple[Any, torch.Tensor]] = {}
        next_post = 0

        def post(i: int) -> None:
            """Receives posted for the next remote experts, at least up to item i, at most
            EXPERT_WINDOW ahead of it (per owner, messages match in order)."""
            nonlocal next_post
            while next_post < len(remote) and (len(posted) < EXPERT_WINDOW or remote[next_post] <= i):
                j = remote[next_post]
                _, _, nbytes = self._message(self.items[j], fp8)
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
                posted[j] = (dist.irecv(buf, src=self.items[j].owner), buf)
                next_post += 1

        for i, it in enumerate(self.items):
            if it.kind == "expert":
                if it.owner == self.rank:
                    wire = self._wire(it, [self._local[n] for n in it.local], fp8)
                    if sender:
                        for name, t in wire:
                            emit(name, t)
                        continue
                    entries, offsets, nbytes = self._message(it, fp8)
                    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
                    by_name = dict(wire)
                    for e, off in zip(entries, offsets, strict=True):
                        fill(flat, off, by_name[e.name])
                    dist.send(flat, dst=self.sender)
                elif sender:
                    post(i)
                    work, buf = posted.pop(i)
                    work.wait()
                    entries, offsets, _ = self._message(it, fp8)
                    at = {e.name: (e, off) for e, off in zip(entries, offsets, strict=True)}
                    for e in self._wire_order(it, fp8):  # emitted in spec order, FP8 pairs in place
                        off = at[e.name][1]
                        emit(e.name, buf[off:off + e.nbytes].view(getattr(torch, e.dtype)).reshape(e.shape))
                    post(i + 1)
                continue
            if it.kind == "tp":
                if self.rank not in self.tp_ranks:
                    continue
                group = ps.get_tensor_model_parallel_group()
                parts = []
                for n in it.local:
                    t = self._local[n].contiguous()
                    pieces = [torch.empty_like(t) for _ in self.tp_ranks] if sender else None
                    dist.gather(t, pieces, group=group, group_dst=0)
                    if sender:
                        parts.append(join_tensors(pieces, it.tp_kind, n))
                if sender:
                    for name, t in self._wire(it, parts, fp8):
                        emit(name, t)
                continue
            if sender:
                for name, t in self._wire(it, [self._local[n] for n in it.local], fp8):
                    emit(name, t)
