"""FP8 e4m3 128x128 block quantisation: bitwise equal to the torch reference."""
from __future__ import annotations

import pytest
import torch

from kernels import fp8_quant as fq

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _bits(q):
    return q.view(torch.uint8)


def test_quant_bitwise_on_ragged_shape_with_zero_block_and_wide_range(device):
    w = torch.randn(200, 300, device=device) * torch.logspace(-6, 2, 300, device=device)
    w = w.to(torch.bfloat16)
    w[:128, :128] = 0  # all-zero block -> scale 1, codes 0
    q, s = fq.fp8_block_quant(w)
    rq, rs = fq.reference_fp8_block_quant(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3) and s.dtype == torch.float32
    assert torch.equal(s, rs) and s[0, 0] == 1.0
    assert torch.equal(_bits(q), _bits(rq))


def test_round_to_nearest_even_on_exact_midpoints(device):
    # amax 448 -> scale exactly 1, so x / scale == x and every midpoint is a real tie.
    grid = torch.arange(0, 127, device=device, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[:-1] + grid[1:]) / 2
    vals = torch.cat([grid, mids, -mids, torch.tensor([448.0], device=device)])
    w = torch.zeros(128, 128, device=device)
    w.view(-1)[: vals.numel()] = vals
    q, s = fq.fp8_block_quant(w.to(torch.float32))
    rq, _ = fq.reference_fp8_block_quant(w)
    assert s.item() == 1.0
    assert torch.equal(_bits(q), _bits(rq))


def test_dequant_inverts_and_matches_reference(device):
    w = (torch.randn(130, 260, device=device) * 3).to(torch.bfloat16)
    q, s = fq.fp8_block_quant(w)
    # fp32 output is exact on every backend (the interpreter's bf16 cast truncates)
    y = fq.fp8_block_dequant(q, s, out_dtype=torch.float32)
    assert torch.equal(y, fq.reference_fp8_block_dequant(q, s, out_dtype=torch.float32))
    rel = ((y - w.float()).norm() / w.float().norm()).item()
    assert rel < 0.05  # e4m3 keeps 3 mantissa bits


def test_bad_inputs_are_named(device):
    with pytest.raises(ValueError, match="2-D"):
        fq.fp8_block_quant(torch.zeros(4, device=device))
    q = torch.zeros(130, 10, device=device).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 1\)"):
        fq.fp8_block_dequant(q, torch.ones(1, 1, device=device))


@pytest.mark.gpu
@gpu
def test_gpu_bitwise_large_and_bf16_dequant():
    w = (torch.randn(4096 + 77, 6144 + 5, device="cuda") * 0.02).to(torch.bfloat16)
    q, s = fq.fp8_block_quant(w)
    rq, rs = fq.reference_fp8_block_quant(w)
    assert torch.equal(s, rs) and torch.equal(_bits(q), _bits(rq))
    y = fq.fp8_block_dequant(q, s)
    assert torch.equal(y, fq.reference_fp8_block_dequant(rq, rs))


@pytest.mark.gpu
@gpu
def test_every_gpu_config_is_bitwise(monkeypatch):
    from kernels._tuning import Autotuner
    w = (torch.randn(1000, 777, device="cuda") * 0.3).to(torch.bfloat16)
    rq, rs = fq.reference_fp8_block_quant(w)
    ry = fq.reference_fp8_block_dequant(rq, rs)
    for cfg in fq.QUANT_TUNER.configs:
        monkeypatch.setattr(fq, "QUANT_TUNER", Autotuner("q", [cfg]))
        q, s = fq.fp8_block_quant(w)
        assert torch.equal(s, rs) and torch.equal(_bits(q), _bits(rq)), cfg.describe()
    for cfg in fq.CONFIGS:
        monkeypatch.setattr(fq, "DEQUANT_TUNER", Autotuner("d", [cfg]))
        assert torch.equal(fq.fp8_block_dequant(rq, rs), ry), cfg.describe()
