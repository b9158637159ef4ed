"""Micro-batches through Megatron's schedule (`get_forward_backward_func`): the no-pipelining loop
at PP 1, non-interleaved 1F1B at PP > 1, the same code on every layout.

- One PackedSeqParams per micro-batch, created in its forward and kept (in `live`) until the
  schedule returns, i.e. past that micro-batch's backward: Megatron 0.19.2's DSA stores the top-k
  that later layers share on it, and full recompute reads it again in backward.
- Variable sequence lengths: packs differ in length, so the stages exchange each activation's
  shape before it (config.variable_seq_lengths, set by the builder).
- The loss is per token, already divided by the step's global loss-token count, so the schedule
  must not rescale it: the loss function returns (loss, tokens, extra), and the config has
  calculate_per_token_loss (forward_step_calc_loss then leaves the loss alone and no
  finalize_model_grads_func divides the grads; agentrl.train.grads reduces them).
- `forward_only`: the old log-probs pass; the last stage collects each micro-batch's output.
On stages other than the last, `loss` is never called and the outputs list is empty.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from agentrl.train.cpu_shims import cpu_megatron
from agentrl.train.packing import PackedBatch

# forward(pack, packed_seq_params) -> the stage's output: hidden states, or log-probs on the last stage.
Forward = Callable[[PackedBatch, Any], torch.Tensor]
# loss(micro-batch index, pack, log-probs) -> scalar loss (already normalised).
Loss = Callable[[int, PackedBatch, torch.Tensor], torch.Tensor]


def run_micro_batches(model: torch.nn.Module, packs: list[PackedBatch], forward: Forward, loss: Loss | None = None,
                      *, forward_only: bool = False) -> list[torch.Tensor]:
    """Run `packs` through the schedule; with `forward_only` return the last stage's outputs per
    micro-batch (detached), else run backward too (grads land in the params' main_grad)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not forward_only and loss is None:
        raise ValueError("a training pass needs a loss")
    live: list[Any] = []  # PackedSeqParams of every micro-batch, alive until all backwards ran
    batches = iter(enumerate(packs))

    def forward_step(data_iterator, stage_model):
        i, pack = next(data_iterator)
        psp = pack.packed_seq_params()
        live.append(psp)
        output = forward(pack, psp)

        def loss_func(out: torch.Tensor, non_loss_data: bool = False):
            if non_loss_data:
                return out.detach()
            value = loss(i, pack, out)  # type: ignore[misc]
            return value, torch.ones((), dtype=torch.int), {}

        return output, loss_func

    with cpu_megatron():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=batches, model=model, num_microbatches=len(packs),
            seq_length=max(p.num_tokens for p in packs), micro_batch_size=1, forward_only=forward_only,
            collect_non_loss_data=forward_only)
    live.clear()
    return list(outputs) if forward_only else []
