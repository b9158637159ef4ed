"""Sparse MLA backward and its autograd wrapper against the torch reference's autograd."""
from __future__ import annotations

import pytest
import torch

from kernels import sparse_mla as sm
from kernels import sparse_mla_bwd as smb
from tests.kernels.mla_grads import config_sweep_case
from tests.kernels.mla_grads import inputs as _inputs
from tests.kernels.mla_grads import reference_grads as _reference_grads
from tests.kernels.mla_grads import rel as _rel

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")








def test_backward_matches_reference_autograd_with_duplicates_padding_and_empty_rows(device):
    T, S, heads, d_v, d_r, K = 5, 24, 16, 32, 16, 20
    q, kv, idx = _inputs(device, T, S, heads, d_v, d_r, K)
    idx[0, 1] = idx[0, 0]  # the same key twice in one row: two adds
    idx[1, :4] = 7  # four times
    idx[3, 12:] = -1  # short row
    idx[4, :] = -1  # no key at all: zero gradients from it
    idx[2, :] = 5  # every slot the same key
    scale = 0.15
    dout = torch.randn(T, heads, d_v, device=device).to(torch.bfloat16)
    out, lse = sm.sparse_mla_forward(q, kv, idx, scale, d_v)
    dq, dkv = smb.sparse_mla_backward(q, kv, idx, out, lse, dout, scale, d_v)
    _, ref_dq, ref_dkv = _reference_grads(q, kv, idx, scale, d_v, dout)
    assert dq.shape == q.shape and dkv.shape == kv.shape and dkv.dtype == torch.float32
    assert _rel(dq, ref_dq) < 2e-2, _rel(dq, ref_dq)
    assert _rel(dkv, ref_dkv) < 2e-2, _rel(dkv, ref_dkv)
    torch.testing.assert_close(dq.float(), ref_dq, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(dkv, ref_dkv, atol=5e-2, rtol=5e-2)
    assert (dq[4] == 0).all()
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[idx[idx >= 0].long().cpu()] = False
    assert (dkv[untouched.to(device)] == 0).all()


def test_autograd_function_gives_the_reference_gradients(device):
    T, S, heads, d_v, d_r, K = 4, 40, 16, 32, 16, 16
    q, kv, idx = _inputs(device, T, S, heads, d_v, d_r, K)
    idx[1, 9:] = -1
    scale = 0.2
    dout = torch.randn(T, heads, d_v, device=device).to(torch.bfloat16)
    qa, kva = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = smb.sparse_mla(qa, kva, idx, scale, d_v, use_triton=True)
    out.backward(dout)
    ref_out, ref_dq, ref_dkv = _reference_grads(q, kv, idx, scale, d_v, dout)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    assert qa.grad.dtype == torch.bfloat16 and kva.grad.dtype == torch.bfloat16
    assert _rel(qa.grad, ref_dq) < 2e-2 and _rel(kva.grad, ref_dkv) < 2e-2


def test_torch_path_is_differentiable_and_is_the_default_off_cuda():
    q, kv, idx = _inputs("cpu", 3, 12, 2, 16, 16, 8)
    q.requires_grad_()
    out = smb.sparse_mla(q, kv, idx, 0.1, d_v=16)
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()


def test_flop_formula():
    assert smb.sparse_mla_bwd_flops(1, 1, 1) == 2 * (3 * 576 + 2 * 512)


def test_grad_out_shape_is_checked(device):
    q, kv, idx = _inputs(device, 2, 8, 16, 16, 16, 4)
    out, lse = sm.sparse_mla_forward(q, kv, idx, 0.1, 16)
    with pytest.raises(ValueError, match="grad_out"):
        smb.sparse_mla_backward(q, kv, idx, out, lse, out[:1], 0.1, 16)


@pytest.mark.gpu
@gpu
def test_backward_gpu_glm_dims():
    T, S, heads, K = 64, 8192, 64, 2048
    q, kv, idx = _inputs("cuda", T, S, heads, 512, 64, K)
    idx = torch.stack([torch.randperm(S, device="cuda")[:K] for _ in range(T)]).to(torch.int32)
    idx[:4, 1000:] = -1
    idx[4, :16] = 3  # duplicates
    scale = sm.default_sm_scale()
    dout = torch.randn(T, heads, 512, device="cuda").to(torch.bfloat16)
    out, lse = sm.sparse_mla_forward(q, kv, idx, scale)
    dq, dkv = smb.sparse_mla_backward(q, kv, idx, out, lse, dout, scale)
    _, ref_dq, ref_dkv = _reference_grads(q, kv, idx, scale, 512, dout)
    assert _rel(dq, ref_dq) < 1e-2 and _rel(dkv, ref_dkv) < 1e-2, (_rel(dq, ref_dq), _rel(dkv, ref_dkv))


@pytest.mark.gpu
@gpu
def test_every_gpu_bwd_config_is_correct(monkeypatch):
    from kernels._tuning import Autotuner
    q, kv, idx, dout, ref_dq, ref_dkv = config_sweep_case()
    out, lse = sm.sparse_mla_forward(q, kv, idx, 0.0625)
    for cfg in smb.BWD_CONFIGS:
        monkeypatch.setattr(smb, "BWD_TUNER", Autotuner("bwd", [cfg]))
        try:
            dq, dkv = smb.sparse_mla_backward(q, kv, idx, out, lse, dout, 0.0625)
        except Exception as exc:  # a config the device cannot run is skipped by the tuner
            if ("resources" in str(exc).lower() or "shared memory" in str(exc).lower()
                    or type(exc).__module__.startswith("triton")):  # the compiler rejects it
                continue
            raise
        assert _rel(dq, ref_dq) < 1e-2 and _rel(dkv, ref_dkv) < 1e-2, cfg.describe()
