"""Process groups, THD packing and gradient reduction for the Megatron trainer backend.

Kept apart from the backend class so each piece is small and testable on CPU:
- `init_megatron_parallel`: torch.distributed (NCCL on GPU, gloo on CPU) + megatron parallel_state
  with the sizes of the plan's Layout, joined at the address the TrainerGroup passes (DistInit).
- `cpu_megatron`: megatron-core 0.19.2 builds a few tensors on `torch.cuda.current_device()` (the
  DSA indexer's rotary table, router buffers) and full recompute saves the CUDA RNG state; without a
  GPU those calls raise. Inside this context they answer for the CPU, so the same model builds and
  trains (with recompute) on a CPU for CI. On a CUDA machine it does nothing.
- `pack_thd` / `plan_packs`: trajectories packed back to back into one THD sequence per micro-batch,
  the dynamic batch filled up to train.parallel.max_tokens_per_gpu tokens (no padding).
- `reduce_gradients` / `clip_grad_norm`: data-parallel all-reduce of fp32 master gradients (dense
  params over DP x CP, expert params over expert-DP) and the global norm over every shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agentrl.agent.trajectory import Trajectory
from agentrl.config.layout import Layout, RankCoords


@contextmanager
def cpu_megatron() -> Iterator[None]:
    """Let megatron-core's `torch.cuda.current_device()` calls mean the CPU when there is no GPU."""
    if torch.cuda.is_available():
        yield
        return
    original, original_rng = torch.cuda.current_device, torch.cuda.random.get_rng_state
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # Full recompute saves and restores the CUDA RNG around each layer; the model has no dropout, so
    # on CPU there is no CUDA RNG to keep in step (megatron's restore is a lazy no-op without CUDA).
    torch.cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]
        torch.cuda.random.get_rng_state = original_rng  # type: ignore[assignment]


@dataclass(frozen=True)
class DistInit:
    """How this process joins the trainer's torch.distributed world. The TrainerGroup passes it to
    every rank as arguments: rank 0's node IP and a port that was free there, this rank's global and
    node-local rank. Nothing is read from the environment."""

    rank: int
    world: int
    master_addr: str
    master_port: int
    local_rank: int = 0
    timeout_s: float = 600.0  # a rank that never arrives fails the others instead of hanging them

    @classmethod
    def single(cls) -> DistInit:
        """A world of one on a free loopback port (tests, one-rank tools)."""
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return cls(0, 1, "127.0.0.1", s.getsockname()[1])


def init_megatron_parallel(layout: Layout, dist_init: DistInit | None = None, *, seed: int = 0) -> RankCoords:
    """torch.distributed (NCCL on GPU, gloo on CPU) and megatron parallel_state for `layout`;
    returns this rank's coordinates. Already initialised (e.g. by a test harness): the world size
    and megatron's sizes must match `layout`. `dist_init` None means a world of one."""
    import datetime

    from megatron.core import parallel_state, tensor_parallel

    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        d = dist_init or DistInit.single()
        if d.world != layout.world:
            raise ValueError(f"the trainer world has {d.world} ranks but the layout needs {layout.world}: "
                             f"{layout.describe()}")
        if cuda:
            torch.cuda.set_device(d.local_rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{d.master_addr}:{d.master_port}",
                                rank=d.rank, world_size=d.world, timeout=datetime.timedelta(seconds=d.timeout_s))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world:
        raise ValueError(f"torch.distributed has {world} ranks but the layout needs {layout.world}: {layout.describe()}")
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_context_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (layout.tp, layout.pp, layout.cp, layout.ep):
            raise RuntimeError(f"megatron parallel_state is initialised with tp/pp/cp/ep {have}, the layout "
                               f"asks for {(layout.tp, layout.pp, layout.cp, layout.ep)}")
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp)
    coords = layout.coords(rank)
    got = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
           parallel_state.get_expert_model_parallel_rank())
    if got != (coords.tp, coords.pp, coords.ep):
        raise RuntimeError(f"rank {rank}: megatron placed it at tp/pp/ep {got}, the layout at "
                           f"{(coords.tp, coords.pp, coords.ep)}; the two rank orders disagree")
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return coords


# ---------------------------------------------------------------- THD packing

@dataclass
class PackedBatch:
    """Trajectories back to back as one THD sequence. Position t holds the log-prob of token t+1 of
    its own trajectory; the last position of each trajectory has no target (mask 0)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 per trajectory
    cu_seqlens: torch.Tensor  # [n + 1] int32
    max_seqlen: int
    targets: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T] float
    rollout_logp: torch.Tensor  # [T]
    advantages: torch.Tensor  # [T]
    indices: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()})

    def packed_seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        # One object per forward: Megatron 0.19.2's DSA keeps the shared top-k on it, and full
        # recompute needs it to survive until backward (see megatron_builder.build_gpt_model).
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)


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


def pack_thd(trajs: list[Trajectory], advantages: list[float], indices: list[int], pad_to: int = 1) -> PackedBatch:
    """Pack `indices` of `trajs`. `pad_to` > 1 appends one masked filler sequence so the total is a
    multiple of it (sequence parallelism needs T divisible by TP)."""
    ids, pos, tgt, lmask, rlp, adv, cu = [], [], [], [], [], [], [0]
    for i in indices:
        t = trajs[i]
        n = len(t.token_ids)
        if n < 2:
            raise ValueError(f"trajectory {t.episode_id} has {n} tokens; training needs at least 2")
        ids += t.token_ids
        pos += range(n)
        tgt += t.token_ids[1:] + [0]
        lmask += [float(m) for m in t.loss_mask[1:]] + [0.0]
        rlp += list(t.rollout_logprobs[1:]) + [0.0]
        adv += [advantages[i]] * n
        cu.append(cu[-1] + n)
    if (rem := len(ids) % pad_to):
        fill = pad_to - rem
        ids += [0] * fill
        pos += range(fill)
        tgt += [0] * fill
        lmask += [0.0] * fill
        rlp += [0.0] * fill
        adv += [0.0] * fill
        cu.append(cu[-1] + fill)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long), position_ids=torch.tensor([pos], dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=max(lengths),
        targets=torch.tensor(tgt, dtype=torch.long), loss_mask=torch.tensor(lmask, dtype=torch.float32),
        rollout_logp=torch.tensor(rlp, dtype=torch.float32), advantages=torch.tensor(adv, dtype=torch.float32),
        indices=list(indices))


# ---------------------------------------------------------------- log-probs

def vocab_parallel_logprobs(hidden: torch.Tensor, weight_shard: torch.Tensor, targets: torch.Tensor, *,
                            temperature: float, chunk_tokens: int, tp_group: Any,
                            reduce_hidden_grad: bool = True) -> torch.Tensor:
    """Log-probs of `targets` when the LM head is split by vocabulary over `tp_group`: each rank
    computes its [chunk, V/tp] logits; megatron's vocab-parallel cross entropy all-reduces the max,
    the sum of exponentials and the target logit. Chunks are checkpointed, so no [T, V] matrix ever
    exists, not even in backward. `hidden` is the same on every rank; each rank's head shard gives
    only part of its gradient, so the gradient is all-reduced over the group (as megatron's
    column-parallel output layer does), unless the caller's sequence-parallel gather already
    reduce-scatters it (`reduce_hidden_grad=False`)."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, vocab_parallel_cross_entropy
    from torch.utils.checkpoint import checkpoint

    if reduce_hidden_grad:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)

    def chunk(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = (h @ weight_shard.t()).float() / temperature
        return -vocab_parallel_cross_entropy(logits[:, None, :], y[:, None], tp_group=tp_group)[:, 0]

    pieces = []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight_shard.requires_grad)
    for s in range(0, hidden.shape[0], chunk_tokens):
        args = (hidden[s:s + chunk_tokens], targets[s:s + chunk_tokens])
        pieces.append(checkpoint(chunk, *args, use_reentrant=False) if grad else chunk(*args))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


# ---------------------------------------------------------------- gradients

def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


def reduce_gradients(named_masters: list[tuple[str, torch.Tensor]]) -> None:
    """Sum fp32 master grads over data-parallel replicas: dense params over DP x CP, routed-expert
    params over the expert-DP group (each EP rank owns other experts, so EP ranks never mix)."""
    from megatron.core import parallel_state as ps

    groups = ((False, ps.get_data_parallel_group(with_context_parallel=True)),
              (True, ps.get_expert_data_parallel_group(with_gtp_remat=False)))
    for expert, group in groups:
        if dist.get_world_size(group) == 1:
            continue
        grads = [p.grad for n, p in named_masters if is_expert_param(n) == expert and p.grad is not None]
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        at = 0
        for g in grads:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()


def clip_grad_norm(named_masters: list[tuple[str, torch.Tensor]], tp_partitioned: set[str], max_norm: float) -> float:
    """Global L2 norm over every shard of the model, then scale grads to `max_norm` (as torch's
    clip_grad_norm_ does: coefficient min(1, max_norm / (norm + 1e-6))). Replicated tensors count once."""
    from megatron.core import parallel_state as ps

    device = named_masters[0][1].device
    dense_rep = torch.zeros((), dtype=torch.float64, device=device)
    dense_tp = torch.zeros((), dtype=torch.float64, device=device)
    expert = torch.zeros((), dtype=torch.float64, device=device)
    for name, p in named_masters:
        if p.grad is None:
            continue
        sq = p.grad.double().pow(2).sum()
        if is_expert_param(name):
            expert += sq
        elif name in tp_partitioned:
            dense_tp += sq
        else:
            dense_rep += sq
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(dense_tp, group=ps.get_tensor_model_parallel_group())
    if ps.get_expert_tensor_and_model_parallel_world_size() > 1:
        dist.all_reduce(expert, group=ps.get_expert_tensor_and_model_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        both = torch.stack([dense_rep + dense_tp, expert])
        dist.all_reduce(both, group=ps.get_pipeline_model_parallel_group())
        total = both.sum()
    else:
        total = dense_rep + dense_tp + expert
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for _, p in named_masters:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
