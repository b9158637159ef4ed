"""`cpu_megatron`: the few CUDA-only calls of megatron-core 0.19.2 answered for the CPU, so the same
model builds and trains (TP / PP / CP / EP on gloo, full recompute) on a CPU for CI. On a CUDA
machine it does nothing.

What it covers, and why each is safe on CPU (REFERENCE section 9):
- `torch.cuda.current_device()`: the DSA indexer's rotary table, router buffers and p2p shape
  buffers are allocated there; it answers "cpu".
- `torch.cuda.random.get_rng_state`: full recompute saves the CUDA RNG around each layer; the model
  has no dropout, so there is no CUDA RNG to keep in step (megatron's restore is a lazy no-op).
- the CUDA RNG tracker's `fork()`: the embedding and the transformer block fork the model-parallel
  CUDA RNG under sequence parallelism (for dropout, which is 0 here); on CPU no tracker state exists,
  so fork is a no-op context.
- pipeline schedules allocate their token counter with `device="cuda"`; the module's `torch` is
  seen through a proxy that puts those tensors on the CPU.
- p2p communication calls `torch.cuda.synchronize()` after batched send/recv; gloo ops are
  complete when waited on, so it is a no-op.
- `Tensor.cuda()`: with PP > 1 and MTP (or tied embeddings) the last stage's embedding copy is
  moved to the GPU before the all-reduce that initialises it; on CPU it stays where it is.
- the alltoall MoE dispatcher (the one GPUs use) copies its split sizes to the host on a side CUDA
  stream; streams become one stand-in object, so there is no side stream and nothing to record.
  Its `maybe_move_tensor_to_cpu` converts split sizes to numpy only for CUDA tensors, and gloo's
  all_to_all wants sequences; on CPU the conversion is done for CPU tensors too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class _CpuTorch:
    """`torch` as megatron's schedules see it inside cpu_megatron: tensor factories asked for
    device="cuda" get the CPU; everything else is torch itself."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device=_cpu_if_cuda(device), **kwargs)


class _NoStream:
    """One object for every CUDA stream: waiting on it or entering it does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoStream:  # an event that is always complete
        return self


_NO_STREAM = _NoStream()


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """moe_utils.maybe_move_tensor_to_cpu for tensors that are on the CPU already."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _cpu_if_cuda(device: Any) -> Any:
    return "cpu" if device is not None and str(device).startswith("cuda") else device


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Let megatron-core's CUDA-only calls mean the CPU when there is no GPU."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.moe import token_dispatcher

    if isinstance(schedules.torch, _CpuTorch):  # nested: the outer context holds the shims
        yield
        return
    original_device, original_rng = torch.cuda.current_device, torch.cuda.random.get_rng_state
    original_sync, original_torch = torch.cuda.synchronize, schedules.torch
    original_streams = torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream
    original_to_cuda = torch.Tensor.cuda
    original_to_host = token_dispatcher.maybe_move_tensor_to_cpu
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    schedules.torch = _CpuTorch()  # type: ignore[assignment]
    torch.cuda.Stream = lambda *a, **k: _NO_STREAM  # type: ignore[assignment, misc]
    torch.cuda.current_stream = lambda device=None: _NO_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    tracker.fork = lambda name=None: contextlib.nullcontext()  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    try:
        yield
    finally:
        torch.cuda.current_device = original_device  # type: ignore[assignment]
        torch.cuda.random.get_rng_state = original_rng  # type: ignore[assignment]
        torch.cuda.synchronize = original_sync  # type: ignore[assignment]
        schedules.torch = original_torch  # type: ignore[assignment]
        torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream = original_streams  # type: ignore[misc]
        del tracker.fork
        torch.Tensor.cuda = original_to_cuda  # type: ignore[method-assign]
        token_dispatcher.maybe_move_tensor_to_cpu = original_to_host
