"""Trajectories -> THD micro-batches for the Megatron backend: the data-parallel split, the packing
under a token budget, padding for sequence / context parallelism and the zigzag CP slice.

- Every trajectory of a step is known to every rank; the split is deterministic, so each rank
  computes its own share without communication. DP ranks get disjoint trajectories; the CP ranks
  (and TP ranks, and pipeline stages) of one DP rank get the same ones.
- A micro-batch packs trajectories back to back as one THD sequence (cu_seqlens, positions
  restarting per trajectory). Position t holds the log-prob of token t+1 of its own trajectory; the
  last real position of a trajectory and every padding position have loss mask 0.
- Context parallelism (cp > 1): each trajectory is padded at its end to a multiple of 2 x CP (x TP
  with sequence parallelism) and cut into 2 x CP chunks; CP rank r holds chunks r and 2CP-1-r of
  every trajectory (the zigzag that balances causal attention work), in that order, which is the
  layout Megatron's DSA all-gather CP path undoes (dsa_layout.build_packed_allgather_cp_local_
  positions). Padding at a trajectory's end is never attended to by its real tokens (causal).
- Sequence parallelism without CP: the pack's total length is made a multiple of TP with one masked
  filler sequence (the SP scatter splits the tokens evenly over TP).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from agentrl.agent.trajectory import Trajectory

MIN_TOKENS = 2  # a trajectory needs a token and its successor to carry one log-prob


@dataclass
class PackedBatch:
    """This rank's tokens of one micro-batch. Per-token tensors are local (the CP slice);
    `cu_seqlens` / `max_seqlen` describe the whole padded pack, as Megatron's THD CP expects."""

    input_ids: torch.Tensor  # [1, T_local]
    position_ids: torch.Tensor  # [1, T_local], position within its trajectory
    cu_seqlens: torch.Tensor  # [n + 1] int32, padded lengths of the whole pack
    max_seqlen: int
    targets: torch.Tensor  # [T_local]
    loss_mask: torch.Tensor  # [T_local] float
    rollout_logp: torch.Tensor  # [T_local]
    advantages: torch.Tensor  # [T_local]
    indices: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()})

    def packed_seq_params(self):
        """A new PackedSeqParams. Use one per forward and keep it until that forward's backward:
        Megatron 0.19.2's DSA keeps the shared top-k on it (megatron_builder.build_gpt_model)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)


@dataclass(frozen=True)
class PackShape:
    """How this rank's packs are padded and sliced (from the layout)."""

    cp_size: int = 1
    cp_rank: int = 0
    sp_size: int = 1  # TP size when sequence parallelism splits tokens, else 1

    @property
    def seq_multiple(self) -> int:
        """Each trajectory's padded length is a multiple of this (2 x CP x SP under CP)."""
        return 2 * self.cp_size * self.sp_size if self.cp_size > 1 else 1

    @property
    def total_multiple(self) -> int:
        """The pack's total length is a multiple of this (SP without CP: a filler sequence pads it)."""
        return self.sp_size if self.cp_size == 1 else 1

    def padded(self, n: int) -> int:
        m = self.seq_multiple
        return -(-n // m) * m


def plan_packs(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so each pack's token sum stays within `max_tokens` (first-fit decreasing);
    a trajectory longer than the budget gets a pack of its own (its context cannot be split here)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    packs: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for p, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                packs[p].append(i)
                loads[p] += lengths[i]
                break
        else:
            packs.append([i])
            loads.append(lengths[i])
    return [sorted(p) for p in packs]


def split_for_data_parallel(lengths: list[int], dp: int) -> list[list[int]]:
    """Trajectory indices per DP rank, balanced by tokens (longest first onto the lightest rank);
    deterministic, so every rank computes the same split."""
    shares: list[list[int]] = [[] for _ in range(dp)]
    loads = [0] * dp
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp), key=lambda r: (loads[r], r))
        shares[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shares]


def zigzag_indices(cu_seqlens: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions (into the whole pack) of CP rank `cp_rank`'s tokens: for every sequence, chunk
    cp_rank then chunk 2*cp_size-1-cp_rank of its 2*cp_size equal chunks."""
    if cp_size == 1:
        return torch.arange(cu_seqlens[-1])
    parts = []
    for start, end in itertools.pairwise(cu_seqlens):
        n = end - start
        if n % (2 * cp_size):
            raise ValueError(f"sequence of {n} tokens is not padded to a multiple of 2 x CP = {2 * cp_size}")
        c = n // (2 * cp_size)
        parts += [torch.arange(start + cp_rank * c, start + (cp_rank + 1) * c),
                  torch.arange(end - (cp_rank + 1) * c, end - cp_rank * c)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def pack_thd(trajs: list[Trajectory], advantages: list[float], indices: list[int],
             shape: PackShape = PackShape()) -> PackedBatch:
    """Pack `indices` of `trajs` (padded and CP-sliced as `shape` says)."""
    ids, pos, tgt, lmask, rlp, adv, cu = [], [], [], [], [], [], [0]

    def add(tokens: list[int], mask: list[float], logp: list[float], a: float, length: int) -> None:
        n = len(tokens)
        fill = length - n
        ids.extend(tokens + [0] * fill)
        pos.extend(range(length))
        tgt.extend(tokens[1:] + [0] * (fill + 1))
        lmask.extend(mask + [0.0] * fill)
        rlp.extend(logp + [0.0] * fill)
        adv.extend([a] * length)
        cu.append(cu[-1] + length)

    for i in indices:
        t = trajs[i]
        n = len(t.token_ids)
        if n < MIN_TOKENS:
            raise ValueError(f"trajectory {t.episode_id} has {n} tokens; training needs at least {MIN_TOKENS}")
        add(list(t.token_ids), [float(m) for m in t.loss_mask[1:]] + [0.0], list(t.rollout_logprobs[1:]) + [0.0],
            advantages[i], shape.padded(n))
    if (rem := cu[-1] % shape.total_multiple):
        fill = shape.total_multiple - rem
        add([0] * fill, [0.0] * fill, [0.0] * fill, 0.0, fill)
    lengths = [b - a for a, b in itertools.pairwise(cu)]
    local = zigzag_indices(cu, shape.cp_size, shape.cp_rank)
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long)[:, local],
        position_ids=torch.tensor([pos], dtype=torch.long)[:, local],
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=max(lengths),
        targets=torch.tensor(tgt, dtype=torch.long)[local],
        loss_mask=torch.tensor(lmask, dtype=torch.float32)[local],
        rollout_logp=torch.tensor(rlp, dtype=torch.float32)[local],
        advantages=torch.tensor(adv, dtype=torch.float32)[local], indices=list(indices))


def filler_pack(shape: PackShape) -> PackedBatch:
    """A masked micro-batch for a rank that has fewer packs than the others (EP dispatch, the
    pipeline schedule and CP gathers are collectives: every rank runs the same count)."""
    n = max(MIN_TOKENS, shape.seq_multiple, shape.total_multiple)
    filler = Trajectory(episode_id="filler", task_id="", group_id="", prompt_len=n, token_ids=[0] * n,
                        loss_mask=[0] * n, rollout_logprobs=[0.0] * n, weight_versions=[-1] * n,
                        outcome="truncated", reward=0.0)
    return pack_thd([filler], [0.0], [0], shape)


def my_packs(trajs: list[Trajectory], advantages: list[float], dp_size: int, dp_rank: int, max_tokens_per_gpu: int,
             shape: PackShape) -> list[PackedBatch]:
    """This DP rank's share of the step, packed: each pack holds at most max_tokens_per_gpu tokens
    per CP rank (a longer trajectory gets a pack of its own)."""
    lengths = [shape.padded(len(t.token_ids)) for t in trajs]
    mine = split_for_data_parallel(lengths, dp_size)[dp_rank]
    budget = max_tokens_per_gpu * shape.cp_size
    return [pack_thd(trajs, advantages, [mine[i] for i in p], shape)
            for p in plan_packs([lengths[i] for i in mine], budget)]
