"""Vocab-parallel log-probs (the Megatron backend's TP > 1 head) on two gloo processes: values and
gradients equal the unsplit definition. (TP > 1 DSA models need TransformerEngine to build; this
checks the log-prob path they would use.)"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, result) -> None:
    try:
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        from megatron.core import parallel_state as ps

        from agentrl.train.megatron_parallel import cpu_megatron, vocab_parallel_logprobs
        from kernels.logprobs_torch import reference_logprobs

        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        g = torch.Generator().manual_seed(0)
        h, w = torch.randn(10, 16, generator=g), torch.randn(50, 16, generator=g)
        y = torch.randint(0, 50, (10,), generator=g)
        h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
        ref = reference_logprobs(h_ref, w_ref, y, temperature=0.7)
        (ref * torch.arange(10)).sum().backward()  # a non-uniform upstream gradient
        h_tp, w_tp = h.clone().requires_grad_(), w.chunk(2)[rank].clone().requires_grad_()
        with cpu_megatron():
            got = vocab_parallel_logprobs(h_tp, w_tp, y, temperature=0.7, chunk_tokens=4,
                                          tp_group=ps.get_tensor_model_parallel_group())
            (got * torch.arange(10)).sum().backward()
        result.put((rank, float((got - ref).abs().max()), float((h_tp.grad - h_ref.grad).abs().max()),
                    float((w_tp.grad - w_ref.grad.chunk(2)[rank]).abs().max())))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result.put((rank, repr(e), None, None))


@pytest.mark.slow
def test_vocab_parallel_logprobs_match_the_unsplit_head():
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, result)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        answers = [result.get(timeout=150) for _ in range(2)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, value_err, hidden_grad_err, weight_grad_err in answers:
        assert isinstance(value_err, float), value_err
        assert value_err < 1e-5 and hidden_grad_err < 1e-4 and weight_grad_err < 1e-4, answers
