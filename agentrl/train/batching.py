"""Turning trajectories into padded micro-batches under a token budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrl.agent.trajectory import Trajectory


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L] right-padded with pad_id
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1] = input_ids[:, 1:]
    loss_mask: torch.Tensor  # [B, L-1] float, 1 on sampled tokens
    rollout_logp: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor  # [B, L-1]
    versions: torch.Tensor  # [B, L-1] weight version of each sampled token (-1 elsewhere)
    indices: list[int]  # positions of these trajectories in the step's batch

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device) -> MicroBatch:
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        return MicroBatch(**moved)


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group trajectory indices so that (batch size x longest length) stays within the budget.

    Sorting by length first keeps padding small; a trajectory longer than the budget gets a
    micro-batch of its own (it cannot be split without breaking its causal context)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > token_budget:
            batches.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


def collate(trajs: list[Trajectory], advantages: list[float], indices: list[int], pad_id: int) -> MicroBatch:
    chosen = [trajs[i] for i in indices]
    L = max(len(t.token_ids) for t in chosen)
    B = len(chosen)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    lmask = torch.zeros((B, L), dtype=torch.float32)
    rlp = torch.zeros((B, L), dtype=torch.float32)
    ver = torch.full((B, L), -1, dtype=torch.long)
    adv = torch.zeros((B, L), dtype=torch.float32)
    for b, (t, i) in enumerate(zip(chosen, indices)):
        n = len(t.token_ids)
        ids[b, :n] = torch.tensor(t.token_ids, dtype=torch.long)
        attn[b, :n] = 1
        lmask[b, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        rlp[b, :n] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
        ver[b, :n] = torch.tensor(t.weight_versions, dtype=torch.long)
        adv[b, :n] = advantages[i]
    # Position t's token is predicted from position t-1: shift everything about targets by one.
    return MicroBatch(
        input_ids=ids, attention_mask=attn, targets=ids[:, 1:], loss_mask=lmask[:, 1:] * attn[:, 1:],
        rollout_logp=rlp[:, 1:], advantages=adv[:, 1:], versions=ver[:, 1:], indices=list(indices),
    )
