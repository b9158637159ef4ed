"""The split sparse MLA backward (dq pass writing dS and P, then a token-major dkv pass) against the
fp32 torch autograd and the atomic impl."""
from __future__ import annotations

import pytest
import torch

from kernels import sparse_mla_bwd as smb
from kernels import sparse_mla_bwd_split as spl
from tests.kernels.mla_grads import hard_rows_case
from tests.kernels.mla_grads import backward as _backward
from tests.kernels.mla_grads import config_sweep_case
from tests.kernels.mla_grads import inputs as _inputs
from tests.kernels.mla_grads import rel as _rel
from tests.kernels.mla_grads import reference_grads

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("chunk_bytes", [None, 1])
def test_split_matches_reference_with_duplicates_padding_unselected_keys_and_chunks(device, monkeypatch,
                                                                                      chunk_bytes):
    # chunk_bytes=1: one token per scratch chunk, so every chunk boundary is crossed
    if chunk_bytes is not None:
        monkeypatch.setattr(spl, "SCRATCH_BYTES", chunk_bytes)
    dq, dkv, args = hard_rows_case(device, "split")
    atomic_dq, atomic_dkv = _backward(*args, "atomic")
    assert _rel(dq, atomic_dq) < 5e-3 and _rel(dkv, atomic_dkv) < 5e-3, (_rel(dq, atomic_dq), _rel(dkv, atomic_dkv))


@pytest.mark.parametrize("cfg", sorted({(c["N_COLS"], c["COL_SPLIT"]) for c in spl.DKV_CONFIGS}))
def test_every_dkv_column_layout_gives_the_reference(device, monkeypatch, cfg):
    # each (column blocks, programs per token) of the configs: the rope columns go to the last program
    from kernels._tuning import Autotuner, KernelConfig
    n_cols, col_split = cfg
    monkeypatch.setattr(spl, "DKV_TUNER", Autotuner("dkv", [KernelConfig.make(
        BLOCK_N=16, N_COLS=n_cols, COL_SPLIT=col_split, num_warps=4, num_stages=1)]))
    T, S, heads, d_v, d_r, K = 3, 30, 16, 64, 16, 24  # 64 value columns: blocks of 16 at 4 x 1 and 1 x 4
    q, kv, idx = _inputs(device, T, S, heads, d_v, d_r, K)
    idx[0, 3] = idx[0, 2]
    idx[2, 20:] = -1
    dout = torch.randn(T, heads, d_v, device=device).to(torch.bfloat16)
    dq, dkv = _backward(q, kv, idx, 0.15, d_v, dout, "split")
    _, ref_dq, ref_dkv = reference_grads(q, kv, idx, 0.15, d_v, dout)
    assert _rel(dq, ref_dq) < 2e-2 and _rel(dkv, ref_dkv) < 2e-2, (_rel(dq, ref_dq), _rel(dkv, ref_dkv))
    assert _rel(dkv[:, d_v:], ref_dkv[:, d_v:]) < 2e-2  # the rope columns: added exactly once


def test_split_with_more_heads_than_one_block_and_masked_heads(device):
    # 80 heads: the dkv pass loops over two head blocks (64 + 16 of which 0 masked) per token
    T, S, heads, d_v, d_r, K = 3, 24, 80, 16, 16, 16
    q, kv, idx = _inputs(device, T, S, heads, d_v, d_r, K)
    idx[1, 3] = idx[1, 2]
    scale = 0.2
    dout = torch.randn(T, heads, d_v, device=device).to(torch.bfloat16)
    dq, dkv = _backward(q, kv, idx, scale, d_v, dout, "split")
    _, ref_dq, ref_dkv = reference_grads(q, kv, idx, scale, d_v, dout)
    assert _rel(dq, ref_dq) < 2e-2 and _rel(dkv, ref_dkv) < 2e-2, (_rel(dq, ref_dq), _rel(dkv, ref_dkv))


def test_split_is_the_default_through_autograd(device, monkeypatch):
    T, S, heads, d_v, d_r, K = 4, 40, 16, 32, 16, 16
    q, kv, idx = _inputs(device, T, S, heads, d_v, d_r, K)
    idx[1, 9:] = -1
    dout = torch.randn(T, heads, d_v, device=device).to(torch.bfloat16)
    assert smb.DEFAULT_BWD_IMPL == "split"
    called = []
    real = spl.split_backward
    monkeypatch.setattr(smb, "split_backward", lambda *a, **k: called.append(1) or real(*a, **k))
    qa, kva = q.clone().requires_grad_(), kv.clone().requires_grad_()
    smb.sparse_mla(qa, kva, idx, 0.2, d_v, use_triton=True).backward(dout)  # no bwd_impl: the default
    assert called == [1]
    _, ref_dq, ref_dkv = reference_grads(q, kv, idx, 0.2, d_v, dout)
    assert _rel(qa.grad, ref_dq) < 2e-2 and _rel(kva.grad, ref_dkv) < 2e-2


def test_the_gluon_dq_pass_is_the_default_only_without_padded_heads(monkeypatch, device):
    from kernels import sparse_mla_gluon
    kv = torch.zeros(4, 576, dtype=torch.bfloat16)
    assert spl.default_dq_impl(torch.zeros(1, 64, 576, dtype=torch.bfloat16), kv, 512) == "triton"  # CPU
    monkeypatch.setattr(sparse_mla_gluon, "supports", lambda q, kv, d_v: True)  # as on an sm_90 GPU
    assert spl.default_dq_impl(torch.zeros(1, 128, 576, dtype=torch.bfloat16), kv, 512) == "gluon"
    assert spl.default_dq_impl(torch.zeros(1, 48, 576, dtype=torch.bfloat16), kv, 512) == "triton"
    q, kv, idx = _inputs(device, 2, 8, 16, 16, 16, 4)
    lse = torch.zeros(2, 16, device=device)
    with pytest.raises(ValueError, match="dq_impl must be one of"):
        spl.split_backward(q, kv, idx, torch.zeros(2, 16, 16, device=device, dtype=torch.bfloat16), lse, lse, 0.1,
                           16, dq_impl="cuda")
    if device.type != "cuda":
        monkeypatch.undo()  # the real rule: no sm_90 GPU here
        with pytest.raises(ValueError, match="dq_impl='gluon' needs bf16 q and kv on an sm_90 GPU"):
            spl.split_backward(q, kv, idx, torch.zeros(2, 16, 16, device=device, dtype=torch.bfloat16), lse, lse,
                               0.1, 16, dq_impl="gluon")


def test_the_gluon_dkv_pass_is_the_default_only_at_64_heads(monkeypatch, device):
    from kernels import sparse_mla_gluon
    kv = torch.zeros(4, 576, dtype=torch.bfloat16)
    assert spl.default_dkv_impl(torch.zeros(1, 64, 576, dtype=torch.bfloat16), kv, 512) == "triton"  # CPU
    monkeypatch.setattr(sparse_mla_gluon, "supports", lambda q, kv, d_v: True)  # as on an sm_90 GPU
    assert spl.default_dkv_impl(torch.zeros(1, 64, 576, dtype=torch.bfloat16), kv, 512) == "gluon"
    assert spl.default_dkv_impl(torch.zeros(1, 128, 576, dtype=torch.bfloat16), kv, 512) == "triton"
    assert spl.default_dkv_impl(torch.zeros(1, 16, 576, dtype=torch.bfloat16), kv, 512) == "triton"
    q, kv, idx = _inputs(device, 2, 8, 16, 16, 16, 4)
    lse = torch.zeros(2, 16, device=device)
    dout = torch.zeros(2, 16, 16, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dkv_impl must be one of"):
        spl.split_backward(q, kv, idx, dout, lse, lse, 0.1, 16, dkv_impl="atomic")
    with pytest.raises(ValueError, match=r"dkv_impl='gluon' needs .* and 64 heads; got q .*\(use dkv_impl='triton'\)"):
        spl.split_backward(q, kv, idx, dout, lse, lse, 0.1, 16, dkv_impl="gluon")  # 16 heads


def test_the_gluon_dkv_pass_bands_keys_so_that_the_programs_at_once_add_into_band_bytes():
    from kernels import sparse_mla_bwd_dkv_gluon as dg
    # 64K keys: 128 columns a program fit in one band (33.5 MB), 512 take 4 bands, whole rows (576) 5
    assert dg.key_bands(65536, 128) == 1 and dg.key_bands(65536, 512) == 4 and dg.key_bands(65536, 576) == 5
    assert dg.key_bands(131072, 128) == 2 and dg.key_bands(1, 576) == 1 and dg.key_bands(65536, 64) == 1
    # the default: whole rows (8 value blocks and the rope block) in one launch, banded by the rule
    assert dg.constexprs(True)["NBLK"] == 9 and dg.constexprs(True)["P_BLOCKS"] == 8
    assert dg._launches({}) == [(True, 0)] and dg._bands(65536, True, {}) == 5
    assert dg.needs_sorted_rows(65536) and not dg.needs_sorted_rows(8192)  # 8K keys: 18.9 MB, one band
    assert dg.needs_sorted_rows(8192, KEY_BANDS=2) and not dg.constexprs(True)["BANDED"]
    assert dg.constexprs(True, KEY_BANDS=4)["BANDED"]
    # the rope columns apart: a launch of their own, banded by its own width
    apart = dict(VALUE_BLOCKS=2, ROPE_WITH_VALUES=False)
    assert dg._launches(apart) == [(True, 0), (False, 512)] and dg.constexprs(False, **apart)["P_BLOCKS"] == 0
    assert not dg.needs_sorted_rows(65536, **apart) and dg.needs_sorted_rows(600_000, **apart)
    with pytest.raises(ValueError, match="unknown Gluon dkv pass schedule keys .*'BANDS'"):
        dg.constexprs(True, BANDS=2)
    with pytest.raises(ValueError, match="ROPE_WITH_VALUES needs one group of all value columns: VALUE_BLOCKS=8"):
        dg.constexprs(True, VALUE_BLOCKS=2)


def test_delta_kernel_is_the_fp32_row_sum(device):
    g = torch.randn(5, 20, 32, device=device).to(torch.bfloat16)  # 20 heads: a partial head block
    o = torch.randn(5, 20, 32, device=device).to(torch.bfloat16)
    torch.testing.assert_close(smb._delta(g, o), (g.float() * o.float()).sum(-1), atol=1e-4, rtol=1e-5)


def test_the_scratch_chunk_bounds_the_scratch():
    assert spl._chunk_tokens(2048, 64, 2) * 2 * 2048 * 64 * 2 <= spl.SCRATCH_BYTES
    assert spl._chunk_tokens(10 ** 9, 64, 2) == 1  # at least one token per chunk
    # blocks of >= 16 columns: fewer blocks first, then fewer programs per token
    assert [spl._n_cols(4, 1, d) for d in (512, 64, 32, 16)] == [(4, 1), (4, 1), (2, 1), (1, 1)]
    assert [spl._n_cols(2, 2, d) for d in (512, 64, 32, 16)] == [(2, 2), (2, 2), (1, 2), (1, 1)]


@pytest.mark.gpu
@gpu
def test_every_split_config_is_correct_gpu(monkeypatch):
    from kernels._tuning import Autotuner
    q, kv, idx, dout, ref_dq, ref_dkv = config_sweep_case()
    ran = 0
    monkeypatch.setattr(spl, "default_dq_impl", lambda q, kv, d_v: "triton")  # the Triton dq pass's configs
    for dq_cfg in spl.DQ_CONFIGS:
        for dkv_cfg in spl.DKV_CONFIGS:
            monkeypatch.setattr(spl, "DQ_TUNER", Autotuner("dq", [dq_cfg]))
            monkeypatch.setattr(spl, "DKV_TUNER", Autotuner("dkv", [dkv_cfg]))
            try:
                dq, dkv = _backward(q, kv, idx, 0.0625, 512, dout, "split")
            except Exception as exc:  # noqa: BLE001 -- a config the device cannot run is skipped by the tuner
                if "resources" in str(exc).lower() or "shared memory" in str(exc).lower():
                    continue
                raise
            ran += 1
            assert _rel(dq, ref_dq) < 1e-2 and _rel(dkv, ref_dkv) < 1e-2, (dq_cfg, dkv_cfg)
    assert ran >= 1


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T,heads,S,K,holes", [(64, 64, 4096, 2048, True), (40, 128, 3000, 300, True),
                                               (16, 64, 512, 3, False)])
def test_gluon_dq_pass_matches_the_triton_pass_and_the_reference(T, heads, S, K, holes):
    from kernels import sparse_mla_gluon
    from kernels.sparse_mla import sparse_mla_forward
    q, kv, idx = _inputs("cuda", T, S, heads, 512, 64, K)
    if not sparse_mla_gluon.supports(q, kv, 512):
        pytest.skip("the Gluon dq pass is written for sm_90")
    if holes:  # -1 slots anywhere, a partial last tile, a duplicate and a row with no valid key
        idx[torch.rand(T, K, device="cuda") < 0.2] = -1
        idx[1, 1] = idx[1, 0] = 7
        idx[0] = -1
    dout = torch.randn(T, heads, 512, device="cuda").to(torch.bfloat16)
    assert spl.default_dq_impl(q, kv, 512) == "gluon"  # what the split backward takes on sm_90
    out, lse = sparse_mla_forward(q, kv, idx, 0.0625, 512)
    delta = smb._delta(dout, out)
    dq, dkv = spl.split_backward(q, kv, idx, dout, lse, delta, 0.0625, 512, dq_impl="gluon")
    tri_dq, tri_dkv = spl.split_backward(q, kv, idx, dout, lse, delta, 0.0625, 512, dq_impl="triton")
    assert _rel(dq, tri_dq) < 2e-3 and _rel(dkv, tri_dkv) < 2e-3, (_rel(dq, tri_dq), _rel(dkv, tri_dkv))
    _, ref_dq, ref_dkv = reference_grads(q, kv, idx, 0.0625, 512, dout)
    assert _rel(dq, ref_dq) < 1e-2 and _rel(dkv, ref_dkv) < 1e-2, (_rel(dq, ref_dq), _rel(dkv, ref_dkv))
    if holes:
        assert (dq[0] == 0).all()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T,S,K,holes", [(64, 4096, 2048, True), (40, 3000, 300, True), (16, 512, 3, False)])
@pytest.mark.parametrize("schedule", [{}, {"BAND_BYTES": 1_000_000}, {"KEY_BANDS": 3},
                                      {"VALUE_BLOCKS": 2, "ROPE_WITH_VALUES": False, "STAGES": 3, "ACC_STAGES": 3},
                                      {"VALUE_BLOCKS": 2, "ROPE_WITH_VALUES": False, "BAND_BYTES": 300_000}])
def test_gluon_dkv_pass_matches_the_triton_pass_and_the_reference(T, S, K, holes, schedule, monkeypatch):
    # schedule: the default (whole rows a program, rope columns too, one launch; bands only past 18 MB of
    # dkv); the same over bands (a small BAND_BYTES; 3 bands: edges off any power of two); groups of 128 value
    # columns with the rope columns apart, without and with bands in both launches. Banded, split_backward
    # sorts the rows (holes come first).
    from kernels import sparse_mla_bwd_dkv_gluon as dg
    from kernels.sparse_mla import sparse_mla_forward
    q, kv, idx = _inputs("cuda", T, S, 64, 512, 64, K)
    if spl.default_dkv_impl(q, kv, 512) != "gluon":
        pytest.skip("the Gluon dkv pass is written for sm_90")
    for key, value in schedule.items():
        if key == "BAND_BYTES":
            monkeypatch.setattr(dg, key, value)
        else:
            monkeypatch.setitem(dg.SCHEDULE, key, value)
    banded = dg.needs_sorted_rows(S)
    idx[idx == S - 1] = S - 2  # key S - 1 picked by no token (at 4096 keys the others may all be)
    if holes:  # -1 slots anywhere, a partial last tile, a key picked twice and a row with no valid key
        idx[torch.rand(T, K, device="cuda") < 0.2] = -1
        idx[1, 1] = idx[1, 0] = 7
        idx[0] = -1
    dout = torch.randn(T, 64, 512, device="cuda").to(torch.bfloat16)
    out, lse = sparse_mla_forward(q, kv, idx, 0.0625, 512)
    delta = smb._delta(dout, out)
    dq, dkv = spl.split_backward(q, kv, idx, dout, lse, delta, 0.0625, 512, dkv_impl="gluon")
    tri_dq, tri_dkv = spl.split_backward(q, kv, idx, dout, lse, delta, 0.0625, 512, dkv_impl="triton")
    if banded:  # the dq pass over sorted rows: the same products, added in another order
        assert _rel(dq, tri_dq) < 1e-3, _rel(dq, tri_dq)
    else:
        assert torch.equal(dq, tri_dq)  # the same dq pass
    assert _rel(dkv, tri_dkv) < 2e-3, _rel(dkv, tri_dkv)
    _, ref_dq, ref_dkv = reference_grads(q, kv, idx, 0.0625, 512, dout)
    assert _rel(dkv, ref_dkv) < 1e-2, _rel(dkv, ref_dkv)
    unpicked = torch.ones(S, dtype=torch.bool, device="cuda")
    unpicked[idx[idx >= 0].long()] = False
    assert unpicked[S - 1] and (dkv[unpicked] == 0).all()  # keys no token picked get nothing
