"""The key-major sparse MLA backward (no atomics) against the fp32 torch autograd and the atomic impl."""
from __future__ import annotations

import pytest
import torch

from kernels import sparse_mla as sm
from kernels import sparse_mla_bwd as smb
from kernels import sparse_mla_bwd_keymajor as kmj
from tests.kernels.mla_grads import hard_rows_case
from tests.kernels.mla_grads import backward as _backward
from tests.kernels.mla_grads import config_sweep_case
from tests.kernels.mla_grads import inputs as _inputs
from tests.kernels.mla_grads import reference_grads as _reference_grads
from tests.kernels.mla_grads import rel as _rel

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")










def test_keymajor_matches_reference_with_duplicates_padding_unselected_and_hot_keys(device):
    # 40 keys in blocks of 16: the last block is partial; keys 30..39, picked by no token, are owned
    # by their block and stored as exact zeros (hard_rows_case checks it)
    _, dkv, _ = hard_rows_case(device, "keymajor")
    assert dkv[11].abs().max() > 0 and dkv[5].abs().max() > 0


def test_the_two_impls_agree_with_masked_heads(device):
    T, S, heads, d_v, d_r, K = 5, 48, 20, 32, 16, 24  # 20 heads: one 32-head block, 12 masked
    q, kv, idx = _inputs(device, T, S, heads, d_v, d_r, K)
    idx[0, 3:7] = idx[0, 2]
    idx[2, 10:] = -1
    dout = torch.randn(T, heads, d_v, device=device).to(torch.bfloat16)
    dq_a, dkv_a = _backward(q, kv, idx, 0.2, d_v, dout, "atomic")
    dq_k, dkv_k = _backward(q, kv, idx, 0.2, d_v, dout, "keymajor")
    torch.testing.assert_close(dq_k.float(), dq_a.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(dkv_k, dkv_a, atol=1e-2, rtol=1e-2)
    assert _rel(dkv_k, dkv_a) < 5e-3 and _rel(dq_k, dq_a) < 5e-3


def test_autograd_wrapper_runs_the_keymajor_backward(device):
    T, S, heads, d_v, d_r, K = 4, 40, 16, 32, 16, 16
    q, kv, idx = _inputs(device, T, S, heads, d_v, d_r, K)
    idx[1, 9:] = -1
    dout = torch.randn(T, heads, d_v, device=device).to(torch.bfloat16)
    qa, kva = q.clone().requires_grad_(), kv.clone().requires_grad_()
    smb.sparse_mla(qa, kva, idx, 0.2, d_v, use_triton=True, bwd_impl="keymajor").backward(dout)
    _, ref_dq, ref_dkv = _reference_grads(q, kv, idx, 0.2, d_v, dout)
    assert qa.grad.dtype == torch.bfloat16 and kva.grad.dtype == torch.bfloat16
    assert _rel(qa.grad, ref_dq) < 2e-2 and _rel(kva.grad, ref_dkv) < 2e-2


def test_inversion_lists_every_selection_once_per_key_with_its_count():
    idx = torch.tensor([[3, 3, -1, 17], [17, 0, 3, -1], [-1, -1, -1, -1], [16, 16, 16, 1]], dtype=torch.int32)
    inv = kmj.invert_topk(idx, n_keys=20, block_k=16)
    assert inv.block_off.tolist() == [0, 3, 6]  # tokens 0, 1 and 3 select keys of both blocks
    got = {}
    for b in range(2):
        for p in range(int(inv.block_off[b]), int(inv.block_off[b + 1])):
            s, n = int(inv.pair_start[p]), int(inv.pair_len[p])
            for e in range(s, s + n):
                got[(int(inv.pair_tok[p]), b * 16 + int(inv.ent_key[e]))] = int(inv.ent_count[e])
    want = {}
    for t, row in enumerate(idx.tolist()):
        for k in row:
            if k >= 0:
                want[(t, k)] = want.get((t, k), 0) + 1
    assert got == want


def test_inversion_refuses_an_index_past_the_keys():
    with pytest.raises(ValueError, match="kv has only 8 rows"):
        kmj.invert_topk(torch.tensor([[2, 8]], dtype=torch.int32), n_keys=8, block_k=16)


def test_unknown_impl_names_the_argument(device):
    q, kv, idx = _inputs(device, 2, 8, 16, 16, 16, 4)
    out, lse = sm.sparse_mla_forward(q, kv, idx, 0.1, 16)
    with pytest.raises(ValueError, match="impl must be one of"):
        smb.sparse_mla_backward(q, kv, idx, out, lse, out, 0.1, 16, impl="fast")
    with pytest.raises(ValueError, match="bwd_impl must be one of"):
        smb.sparse_mla(q, kv, idx, 0.1, 16, bwd_impl="keymajr")


@pytest.mark.gpu
@gpu
def test_keymajor_gpu_glm_dims():
    T, S, heads, K = 64, 8192, 64, 2048
    q, kv, idx = _inputs("cuda", T, S, heads, 512, 64, K)
    idx = torch.stack([torch.randperm(S, device="cuda")[:K] for _ in range(T)]).to(torch.int32)
    idx[:4, 1000:] = -1
    idx[4, :16] = 3  # duplicates
    idx[:, 0] = 7  # a key every token selects
    scale = sm.default_sm_scale()
    dout = torch.randn(T, heads, 512, device="cuda").to(torch.bfloat16)
    dq, dkv = _backward(q, kv, idx, scale, 512, dout, "keymajor")
    _, ref_dq, ref_dkv = _reference_grads(q, kv, idx, scale, 512, dout)
    assert _rel(dq, ref_dq) < 1e-2 and _rel(dkv, ref_dkv) < 1e-2, (_rel(dq, ref_dq), _rel(dkv, ref_dkv))


@pytest.mark.gpu
@gpu
def test_every_gpu_keymajor_config_is_correct(monkeypatch):
    from kernels._tuning import Autotuner
    q, kv, idx, dout, ref_dq, ref_dkv = config_sweep_case()
    n_dq, n_dkv = len(kmj.DQ_CONFIGS), len(kmj.DKV_CONFIGS)
    for dq_cfg, dkv_cfg in [(kmj.DQ_CONFIGS[i % n_dq], kmj.DKV_CONFIGS[i % n_dkv]) for i in range(max(n_dq, n_dkv))]:
        monkeypatch.setattr(kmj, "DQ_TUNER", Autotuner("dq", [dq_cfg]))
        monkeypatch.setattr(kmj, "DKV_TUNER", Autotuner("dkv", [dkv_cfg]))
        try:
            dq, dkv = _backward(q, kv, idx, 0.0625, 512, dout, "keymajor")
        except Exception as exc:  # a config the device cannot run is skipped by the tuner
            if ("resources" in str(exc).lower() or "shared memory" in str(exc).lower()
                    or type(exc).__module__.startswith("triton")):  # the compiler rejects it
                continue
            raise
        assert _rel(dq, ref_dq) < 1e-2 and _rel(dkv, ref_dkv) < 1e-2, (dq_cfg.describe(), dkv_cfg.describe())
