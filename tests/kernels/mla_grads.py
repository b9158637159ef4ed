"""Inputs and fp32 reference gradients shared by the sparse MLA backward tests."""
from __future__ import annotations

import torch

from kernels import sparse_mla as sm
from kernels import sparse_mla_bwd as smb


def inputs(device, T, S, heads, d_v, d_r, K, key_range=None):
    """bf16 q [T, heads, d_v + d_r], kv [S, d_v + d_r] and int32 top-k indices into kv (or its
    first key_range keys, so that the rest are selected by no token)."""
    q = torch.randn(T, heads, d_v + d_r, device=device).to(torch.bfloat16)
    kv = torch.randn(S, d_v + d_r, device=device).to(torch.bfloat16)
    idx = torch.randint(0, key_range or S, (T, K), device=device, dtype=torch.int32)
    return q, kv, idx


def reference_grads(q, kv, idx, scale, d_v, dout):
    """(out, dq, dkv) of the torch reference in fp32: the gradient every kernel is held to."""
    qr = q.detach().float().requires_grad_()
    kvr = kv.detach().float().requires_grad_()
    out, _ = sm.reference_sparse_mla(qr, kvr, idx, scale, d_v)
    out.backward(dout.float())
    return out, qr.grad, kvr.grad


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def backward(q, kv, idx, scale, d_v, dout, impl):
    """The Triton forward, then sparse_mla_backward with the given impl: (dq, dkv)."""
    out, lse = sm.sparse_mla_forward(q, kv, idx, scale, d_v)
    return smb.sparse_mla_backward(q, kv, idx, out, lse, dout, scale, d_v, impl=impl)


def hard_rows(idx):
    """Rows over 6+ tokens and 12+ keys that every backward must get right (idx changed in place)."""
    idx[:, 0] = 11  # a key every token selects: many adds into one row
    idx[1, 5:9] = 11  # ... and four more times in one row
    idx[0, 2] = idx[0, 1]  # the same key twice in one row
    idx[2, :] = 5  # every slot the same key
    idx[3, 12:] = -1  # short row
    idx[4, :] = -1  # no key at all: zero gradients from it
    idx[5, ::2] = -1  # padding between keys
    return idx


def assert_reference_grads(dq, dkv, q, kv, idx, scale, d_v, dout, tol=2e-2):
    """dq (q's dtype and shape) and dkv (fp32, kv's shape) equal the fp32 reference's to tol."""
    _, ref_dq, ref_dkv = reference_grads(q, kv, idx, scale, d_v, dout)
    assert dq.shape == q.shape and dq.dtype == q.dtype and dkv.shape == kv.shape and dkv.dtype == torch.float32
    assert rel(dq, ref_dq) < tol, rel(dq, ref_dq)
    assert rel(dkv, ref_dkv) < tol, rel(dkv, ref_dkv)
    torch.testing.assert_close(dq.float(), ref_dq, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(dkv, ref_dkv, atol=5e-2, rtol=5e-2)


def config_sweep_case():
    """The GPU config sweeps' case at GLM-5.2 widths (16 tokens, 64 heads, 576 / 512, top-256 of
    2048, 3 short rows): (q, kv, idx, dout, ref_dq, ref_dkv), scale 0.0625."""
    T, S, heads, K = 16, 2048, 64, 256
    q, kv, idx = inputs("cuda", T, S, heads, 512, 64, K)
    idx[:3, 50:] = -1
    dout = torch.randn(T, heads, 512, device="cuda").to(torch.bfloat16)
    _, ref_dq, ref_dkv = reference_grads(q, kv, idx, 0.0625, 512, dout)
    return q, kv, idx, dout, ref_dq, ref_dkv


def hard_rows_case(device, impl):
    """hard_rows over 6 tokens, 16 heads, top-20 of keys 0..29 of 40 (keys 30..39 selected by no
    token), through impl, checked against the fp32 reference; returns (dq, dkv, args) with args
    (q, kv, idx, scale, d_v, dout) for the caller's own checks."""
    T, S, heads, d_v, d_r, K = 6, 40, 16, 32, 16, 20  # K not a multiple of the key tile
    q, kv, idx = inputs(device, T, S, heads, d_v, d_r, K, key_range=30)
    idx = hard_rows(idx)
    dout = torch.randn(T, heads, d_v, device=device).to(torch.bfloat16)
    args = (q, kv, idx, 0.15, d_v, dout)
    dq, dkv = backward(*args, impl)
    assert_reference_grads(dq, dkv, *args)
    assert (dq[4] == 0).all()  # the row without a key
    assert (dkv[30:] == 0).all()  # never selected
    return dq, dkv, args
