"""Full HF-named tensors out of a sharded Megatron model, streamed one tensor at a time.

`full_megatron_tensor` rebuilds one full (unsharded) Megatron tensor on every rank of the model:
routed-expert tensors are broadcast from the expert-parallel rank that owns the expert (EP rank r
owns experts [r*E/ep, (r+1)*E/ep), numbered from 0 locally, as in agentrl.models.sharding); tensor-
parallel pieces are all-gathered and joined with sharding.join_tensors. `hf_named_weights` walks
mapping.mapping_rules in order and converts each rule's Megatron tensors to HF names, so peak extra
memory is one rule (for fused experts: one layer's stacked experts), never the whole model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def full_megatron_tensor(name: str, local: dict[str, torch.Tensor], config: Any) -> torch.Tensor:
    """The full tensor `name` (global Megatron name, pp=1), assembled by collectives over this rank's
    expert-parallel / tensor-parallel groups. Every rank of those groups must ask for the same names
    in the same order."""
    from megatron.core import parallel_state as ps

    from agentrl.models.sharding import join_tensors, tp_kind

    if m := _LOCAL_EXPERT.match(name):
        ep = ps.get_expert_model_parallel_world_size()
        per_rank = config.n_routed_experts // ep
        expert = int(m.group(2))
        local_name = f"{m.group(1)}{expert % per_rank}{m.group(3)}"
        t = local[local_name]
        if ep > 1:
            owner = expert // per_rank
            buf = t.contiguous() if ps.get_expert_model_parallel_rank() == owner else torch.empty_like(t)
            dist.broadcast(buf, group=ps.get_expert_model_parallel_group(), group_src=owner)
            t = buf
        etp = ps.get_expert_tensor_parallel_world_size()
        if etp > 1:
            kind = "glu" if ".linear_fc1." in name else "row"
            t = join_tensors(_all_gather(t, ps.get_expert_tensor_parallel_group(), etp), kind, name)
        return t
    if name not in local:
        raise KeyError(f"{name}: not a tensor of this rank's Megatron model (pipeline stages other than one "
                       "are not exported by this path)")
    t = local[name]
    tp = ps.get_tensor_model_parallel_world_size()
    kind = tp_kind(name)
    if tp > 1 and kind != "replicated":
        t = join_tensors(_all_gather(t, ps.get_tensor_model_parallel_group(), tp), kind, name)
    return t


def _all_gather(t: torch.Tensor, group: Any, n: int) -> list[torch.Tensor]:
    pieces = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(pieces, t.contiguous(), group=group)
    return pieces


def hf_named_weights(config: Any, fetch: Callable[[str], torch.Tensor], *,
                     hf_experts: str = "fused") -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the model, in mapping-rule order, fetching each Megatron
    tensor by its full name. MTP embed/head aliases are emitted as the shared tensor itself."""
    from agentrl.models.mapping import MegatronNaming, mapping_rules, rule_to_hf

    if hf_experts not in ("fused", "per_expert"):
        raise ValueError(f"hf_experts must be 'fused' or 'per_expert', got {hf_experts!r}")
    for rule in mapping_rules(config, MegatronNaming(), hf_experts):  # type: ignore[arg-type]
        tensors = [fetch(n) for n in rule.mg]
        for hf_name, t in zip(rule.hf, rule_to_hf(rule, tensors), strict=True):
            yield hf_name, t
