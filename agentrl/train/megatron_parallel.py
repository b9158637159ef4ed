"""Process groups and the vocab-parallel log-prob head of the Megatron trainer backend.

- `DistInit` / `init_megatron_parallel`: torch.distributed (NCCL on GPU, gloo on CPU) + megatron
  parallel_state with the sizes of the plan's Layout, joined at the address the TrainerGroup passes.
- `vocab_parallel_logprobs`: log-probs when the LM head is split over TP, in checkpointed chunks.
Elsewhere: CPU shims (cpu_shims.py), THD packing (packing.py), the micro-batch schedule
(pipeline.py), gradient reduction (grads.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from agentrl.config.layout import Layout, RankCoords
from agentrl.train.dist_init import DistInit  # noqa: F401 - where the backends import it from


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
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        vocab_parallel_cross_entropy,
    )
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


def head_logprobs(hidden_states: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float,
                  chunk_tokens: int, sequence_parallel: bool) -> torch.Tensor:
    """[T] log-prob of each position's target from the last stage's final hidden states [T(/TP), 1, H]:
    the sequence-parallel shards gathered first; vocab-parallel over TP; the fused Triton kernel on
    one GPU; torch chunks on CPU. The [T, V] logits never exist at once."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    h = hidden_states
    if sequence_parallel and tp > 1:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True,
                                                 group=ps.get_tensor_model_parallel_group())
    h = h[:, 0]  # [T, 1, H] -> [T, H]
    if tp > 1:
        return vocab_parallel_logprobs(h, weight, targets, temperature=temperature, chunk_tokens=chunk_tokens,
                                       tp_group=ps.get_tensor_model_parallel_group(),
                                       reduce_hidden_grad=not sequence_parallel)
    if h.is_cuda:  # the fused Triton kernel (kernels/logprobs.py)
        from kernels.logprobs import fused_logprobs

        return fused_logprobs(h.contiguous(), weight.to(h.dtype), targets, temperature=temperature)
    from kernels.logprobs_torch import chunked_logprobs

    return chunked_logprobs(h, weight, targets, temperature=temperature, chunk_tokens=chunk_tokens)
