"""Sparse MLA forward (absorbed MQA form) against the gathered torch reference."""
from __future__ import annotations

import pytest
import torch

from kernels import sparse_mla as sm

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_forward_matches_reference_with_padding_and_empty_rows(device):
    T, S, heads, d_v, d_r, K = 6, 50, 16, 32, 16, 40
    q = torch.randn(T, heads, d_v + d_r, device=device).to(torch.bfloat16)
    kv = torch.randn(S, d_v + d_r, device=device).to(torch.bfloat16)
    idx = torch.randint(0, S, (T, K), device=device, dtype=torch.int32)
    idx[1, 10:] = -1  # short row
    idx[2, :] = -1  # no key at all
    out, lse = sm.sparse_mla_forward(q, kv, idx, sm_scale=0.1, d_v=d_v)
    ref_out, ref_lse = sm.reference_sparse_mla(q, kv, idx, sm_scale=0.1, d_v=d_v)
    assert out.shape == (T, heads, d_v) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-4)
    assert torch.isinf(lse[2]).all() and (out[2] == 0).all()


def test_flop_formula_counts_qk_and_pv():
    assert sm.sparse_mla_flops(1, 1, 1) == 2 * (576 + 512)
    assert sm.sparse_mla_flops(2, 64, 2048) == 2 * 2 * 64 * 2048 * 1088


def test_an_unknown_impl_is_named(device):
    q = torch.zeros(1, 16, 48, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="impl must be one of"):
        sm.sparse_mla_forward(q, torch.zeros(4, 48, device=device, dtype=torch.bfloat16),
                              torch.zeros(1, 2, device=device, dtype=torch.int32), 0.1, d_v=32, impl="cuda")


def test_the_paired_gluon_kernel_is_the_default_where_it_runs_without_padded_heads(monkeypatch):
    from kernels import sparse_mla_gluon
    kv = torch.zeros(4, 576, dtype=torch.bfloat16)
    assert sm.default_forward_impl(torch.zeros(1, 64, 576, dtype=torch.bfloat16), kv, 512) == "triton"  # CPU
    monkeypatch.setattr(sparse_mla_gluon, "supports", lambda q, kv, d_v: True)  # as on an sm_90 GPU
    q = torch.zeros(1, 128, 576, dtype=torch.bfloat16)
    assert sm.default_forward_impl(q, kv, 512) == "pair"
    assert sm.default_forward_impl(q, torch.empty(131072, 576, dtype=torch.bfloat16, device="meta"), 512) == "pair"
    assert sm.default_forward_impl(torch.zeros(1, 16, 576, dtype=torch.bfloat16), kv, 512) == "triton"


def test_bad_shapes_are_named(device):
    q = torch.zeros(2, 16, 48, device=device, dtype=torch.bfloat16)
    kv = torch.zeros(5, 48, device=device, dtype=torch.bfloat16)
    idx = torch.zeros(2, 4, device=device, dtype=torch.int32)
    with pytest.raises(ValueError, match="powers of two"):
        sm.sparse_mla_forward(q, kv, idx, 0.1, d_v=40)
    with pytest.raises(ValueError, match="idx must be"):
        sm.sparse_mla_forward(q, kv, idx[:1], 0.1, d_v=32)


@pytest.mark.gpu
@gpu
def test_forward_gpu_glm_dims():
    T, S, heads, K = 128, 8192, 64, 2048
    q = torch.randn(T, heads, 576, device="cuda").to(torch.bfloat16)
    kv = torch.randn(S, 576, device="cuda").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(S, device="cuda")[:K] for _ in range(T)]).to(torch.int32)
    idx[:8, 1000:] = -1
    ref_out, ref_lse = sm.reference_sparse_mla(q, kv, idx, sm.default_sm_scale(), chunk_tokens=32)
    for impl in (None, "triton"):  # the default (Gluon on sm_90) and the Triton kernel
        out, lse = sm.sparse_mla_forward(q, kv, idx, sm.default_sm_scale(), impl=impl)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
@gpu
def test_every_gpu_config_is_correct(monkeypatch):
    from kernels._tuning import Autotuner
    T, S, heads, K = 16, 4096, 64, 512
    q = torch.randn(T, heads, 576, device="cuda").to(torch.bfloat16)
    kv = torch.randn(S, 576, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, S, (T, K), device="cuda", dtype=torch.int32)
    idx[:4, 100:] = -1
    ref_out, ref_lse = sm.reference_sparse_mla(q, kv, idx, 0.0625)
    for cfg in sm.CONFIGS:
        monkeypatch.setattr(sm, "TUNER", Autotuner("mla", [cfg]))
        try:
            out, lse = sm.sparse_mla_forward(q, kv, idx, 0.0625, impl="triton")
        except Exception as exc:  # a config the device cannot run (shared memory) is skipped by the tuner
            if ("resources" in str(exc).lower() or "shared memory" in str(exc).lower()
                    or type(exc).__module__.startswith("triton")):  # the compiler rejects it
                continue
            raise
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2, msg=cfg.describe)
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4, msg=cfg.describe)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kernel", ["gluon", "pair"])
@pytest.mark.parametrize("T,heads,S,K,holes", [(64, 64, 4096, 2048, True), (40, 48, 3000, 300, True),
                                               (33, 128, 9000, 2048, False), (16, 64, 512, 1, False),
                                               (8, 64, 700, 130, True)])  # 3 tiles: the pair kernel's odd one
def test_gluon_forward_matches_the_definition(T, heads, S, K, holes, kernel):
    from kernels.sparse_mla_gluon import sparse_mla_forward_gluon, supports
    from kernels.sparse_mla_gluon_pair import sparse_mla_forward_pair
    q = torch.randn(T, heads, 576, device="cuda").to(torch.bfloat16)
    kv = torch.randn(S, 576, device="cuda").to(torch.bfloat16)
    if not supports(q, kv, 512):
        pytest.skip("the Gluon kernel is written for sm_90")
    idx = torch.randint(0, S, (T, K), device="cuda", dtype=torch.int32)
    if holes:  # -1 slots anywhere, a partial last tile, and a row with no valid key (out 0, lse -inf)
        idx[torch.rand(T, K, device="cuda") < 0.2] = -1
        idx[0] = -1
    forward = {"gluon": sparse_mla_forward_gluon, "pair": sparse_mla_forward_pair}[kernel]
    out, lse = forward(q, kv, idx, sm.default_sm_scale())
    ref_out, ref_lse = sm.reference_sparse_mla(q, kv, idx, sm.default_sm_scale(), chunk_tokens=16)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)
