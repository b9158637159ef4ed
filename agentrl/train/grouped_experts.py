"""A rank's routed experts as two grouped GEMMs (torch's grouped matmul) instead of the loop over
experts that megatron-core 0.19.2 falls back to without TransformerEngine (SequentialMLP: one fc1,
activation and fc2 launch per local expert, 3 x 16-32 small GEMMs per MoE layer at the recipe's
EP8 with 256 experts).

Weights are stored stacked per rank: `weight1` [E_local, 2I, H] (each expert's fc1 rows [gate; up],
Megatron's GLU layout) and `weight2` [E_local, H, I]. The module's state dict presents them as
SequentialMLP does (`local_experts.{e}.linear_fc1.weight` / `linear_fc2.weight`, views of the
stacked tensors), so the HF mapping, sharding, converted checkpoints and export are unchanged.
Arithmetic per token is SequentialMLP's (MLP.forward without fusion): fc1, silu(gate) * up,
times the routing prob (cast back to the activation dtype), fc2.

Expert tensor parallelism (etp > 1) is not supported here (capabilities refuses it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows offsets[e-1]:offsets[e] of x times weight[e].T, for every expert e (one launch)."""
    return F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)


class GroupedExperts(torch.nn.Module):
    """Drop-in for SequentialMLP in megatron's MoELayer (same constructor and forward)."""

    def __init__(self, num_local_experts: int, config: Any, pg_collection: Any = None, name: str | None = None,
                 **_: Any):
        super().__init__()
        if pg_collection is not None and pg_collection.expt_tp.size() > 1:
            raise ValueError("train.parallel.etp > 1: grouped experts keep each expert whole on its EP rank; set etp=1")
        if not config.gated_linear_unit or config.add_bias_linear or config.moe_apply_probs_on_input:
            raise ValueError("grouped experts implement GLU experts without bias, probs applied after the activation")
        self.config = config
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep if pg_collection is not None else None
        self.expert_dp_group = pg_collection.expt_dp if pg_collection is not None else None
        hidden, inner = config.hidden_size, config.moe_ffn_hidden_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, 2 * inner, hidden, dtype=config.params_dtype,
                                                      device=device))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, hidden, inner, dtype=config.params_dtype,
                                                      device=device))
        if config.perform_initialization:
            with torch.no_grad():
                for e in range(num_local_experts):
                    config.init_method(self.weight1[e])
                    config.output_layer_init_method(self.weight2[e])
        for p in (self.weight1, self.weight2):
            p.allreduce = False  # megatron's marker: reduced over expert-DP, not DP
        self.register_state_dict_post_hook(_as_sequential_mlp_keys)
        self.register_load_state_dict_pre_hook(_from_sequential_mlp_keys)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        x = permuted_local_hidden_states
        offsets = torch.cumsum(torch.as_tensor(tokens_per_expert, device=x.device), 0).to(torch.int32)
        h = grouped_linear(x, self.weight1, offsets)
        gate, up = torch.chunk(h, 2, dim=-1)
        act = self.config.activation_func(gate) * (up + self.config.glu_linear_offset)
        act = (act * permuted_probs.unsqueeze(-1)).to(h.dtype)
        return grouped_linear(act, self.weight2, offsets), None

    def backward_dw(self) -> None:  # MoELayer calls it with delayed wgrad; nothing is delayed here
        pass

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """dist_checkpointing entries with SequentialMLP's checkpoint keys and global shapes
        (`{prefix}experts.linear_fc1.weight` [E, 2I, H], rows [gate; up]), so checkpoints load
        into either module at any EP; this rank's experts are rows ep_rank * E_local onwards."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
        prepend = len(sharded_offsets)
        out = {}
        for stacked, linear in (("weight1", "linear_fc1"), ("weight2", "linear_fc2")):
            out[f"{prefix}{stacked}"] = ShardedTensor.from_rank_offsets(
                f"{prefix}experts.{linear}.weight", getattr(self, stacked), *sharded_offsets,
                (prepend, ep_rank, ep_size), replica_id=(0, 0, self.expert_dp_group.rank()),
                prepend_axis_num=prepend)
        return out


def _as_sequential_mlp_keys(module: GroupedExperts, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for stacked, linear in (("weight1", "linear_fc1"), ("weight2", "linear_fc2")):
        tensor = state_dict.pop(prefix + stacked)
        for e in range(module.num_local_experts):
            state_dict[f"{prefix}local_experts.{e}.{linear}.weight"] = tensor[e]


def _from_sequential_mlp_keys(module: GroupedExperts, state_dict: dict, prefix: str, local_metadata: Any,
                              strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    for stacked, linear in (("weight1", "linear_fc1"), ("weight2", "linear_fc2")):
        keys = [f"{prefix}local_experts.{e}.{linear}.weight" for e in range(module.num_local_experts)]
        if all(k in state_dict for k in keys):
            state_dict[prefix + stacked] = torch.stack([state_dict.pop(k) for k in keys])
