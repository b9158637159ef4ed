"""bench/kernel_resources.py: a kernel compiled for sm_90 on this CPU machine, and what it reports."""
from __future__ import annotations

import pytest

from bench import kernel_resources as kr


def test_a_kernel_compiles_for_hopper_without_a_gpu_and_reports_its_resources():
    from kernels.sparse_mla_bwd import _delta_kernel

    args = {"do_ptr": kr.Ptr("bf16"), "out_ptr": kr.Ptr("bf16"), "delta_ptr": kr.Ptr("fp32"), "stride_dot": 64 * 512,
            "stride_doh": 512, "stride_ot": 64 * 512, "stride_oh": 512, "stride_lt": 64}
    res = kr.compile_sm90(_delta_kernel, args, {"HEADS": 64, "D_V": 512, "BLOCK_H": 16}, num_warps=4, num_stages=1)
    assert 0 < res["registers"] <= 255 and res["spill_stack_bytes"] >= 0 and res["shared_bytes"] >= 0
    assert res["wgmma"] == 0 and res["atom_v4_f32"] == 0  # a row reduction: no MMA, no atomics


def test_the_split_dkv_pass_uses_wgmma_and_vector_atomics_and_fits():
    case = next(c for c in kr._sparse_mla_bwd_cases() if c[0] == "sparse_mla_bwd_split_dkv")
    _, fn, args, constexprs, configs = case
    cfg, extra = configs[0]
    res = kr.compile_sm90(fn, args, {**constexprs, **dict(cfg.params), **extra}, cfg.num_warps, cfg.num_stages)
    assert res["wgmma"] > 0 and res["atom_v4_f32"] > 0 and res["atom_f32"] == 0  # 16-byte atomics only
    assert res["shared_bytes"] <= 232448 and res["spill_stack_bytes"] == 0  # the H200's 227 KB per block


def test_a_missing_argument_is_named():
    from kernels.sparse_mla_bwd import _delta_kernel

    with pytest.raises(ValueError, match=r"no value for \['stride_lt'\]"):
        kr.compile_sm90(_delta_kernel, {"do_ptr": kr.Ptr("bf16"), "out_ptr": kr.Ptr("bf16"),
                                        "delta_ptr": kr.Ptr("fp32"), "stride_dot": 1, "stride_doh": 1,
                                        "stride_ot": 1, "stride_oh": 1}, {"HEADS": 4, "D_V": 16, "BLOCK_H": 4}, 4, 1)


def test_the_topk_filter_streams_through_cp_async_and_split_thresholds_free_registers():
    cases = [c for c in kr._topk_cases() if c[0] == "topk_filter"]
    res = {}
    for _, fn, args, constexprs, configs in cases:
        cfg, _ = configs[0]
        key = (cfg["BLOCK"], cfg.num_warps, cfg.num_stages, cfg["SPLIT_T"])
        if key in {(1024, 4, 3, False), (1024, 4, 3, True)} and key not in res:
            res[key] = kr.compile_sm90(fn, args, {**constexprs, **dict(cfg.params)}, cfg.num_warps, cfg.num_stages)
    inline, split = res[(1024, 4, 3, False)], res[(1024, 4, 3, True)]
    assert inline["cp_async"] > 0 and split["cp_async"] > 0  # the row's blocks are pipelined, not loaded in turn
    assert split["registers"] < inline["registers"] and split["spill_stack_bytes"] == 0


def test_the_filter_prefix_sum_stays_in_the_load_layout_with_ptx_stores():
    """topk_common.scatter_b32: with tl.store the scattered candidate stores pulled the prefix sum into
    a one-key-per-thread layout (a warp scan per key); through the PTX store it is scanned per thread."""
    case = next(c for c in kr._topk_cases() if c[0] == "topk_filter" and c[4][0][0]["SPLIT_T"])
    _, fn, args, constexprs, configs = case
    cfg, _ = configs[0]
    res = {asm: kr.compile_sm90(fn, args, {**constexprs, **dict(cfg.params), "ASM_STORE": asm}, cfg.num_warps,
                                cfg.num_stages) for asm in (False, True)}
    assert res[True]["shfl"] * 2 < res[False]["shfl"] and res[True]["bar_sync"] < res[False]["bar_sync"], res


def test_the_gluon_forward_specialises_its_warps_and_fits_in_shared_memory():
    case = next(c for c in kr._sparse_mla_bwd_cases() if c[0] == "sparse_mla_fwd_gluon")
    _, fn, args, constexprs, configs = case
    cfg, _ = configs[0]
    res = kr.compile_sm90(fn, args, {**constexprs, **dict(cfg.params)}, cfg.num_warps, cfg.num_stages)
    # q (72 KB) + two KV slots (144 KB) + P (8 KB) + barriers, under the H200's 227 KB a block
    assert 224 * 1024 <= res["shared_bytes"] <= 232448
    assert res["wgmma"] > 0 and res["cp_async"] > 0 and res["mma_sync"] == 0


# the default; q loaded before the producer starts; out's stores staged through a free slot half
@pytest.mark.parametrize("change", [{}, {"Q_ROWS": 0}, {"STAGE_OUT": True}])
def test_the_paired_gluon_forward_fits_without_spilling(change):
    """kernels/sparse_mla_gluon_pair.py: q + two KV slots + P1 in 227 KB (P0 in slot 0's rope columns), no
    spill at its register split (warpgroup 0 232, warpgroup 1 216, the producer 56), and its wgmmas left
    asynchronous by ptxas (session 26's persistent variant, a loop over items around the loop over tiles, had
    them all serialised: C7514, 20% slower)."""
    case = next(c for c in kr._sparse_mla_bwd_cases() if c[0] == "sparse_mla_fwd_gluon_pair")
    _, fn, args, constexprs, configs = case
    cfg, _ = configs[0]
    res = kr.compile_sm90(fn, args, {**constexprs, **change}, cfg.num_warps, cfg.num_stages)
    assert 224 * 1024 <= res["shared_bytes"] <= 232448, res
    # S of a tile (36 k-steps) in warpgroup 0's prologue and loop and in warpgroup 1's loop, 4 PVs of 4 k-steps
    assert res["wgmma"] == 3 * 36 + 4 * 4 and res["cp_async"] > 0 and res["spill_stack_bytes"] == 0, res
    assert not res["wgmma_serialized"] and len([p for p in res["partitions"] if p["wgmma"]]) == 2, res


@pytest.mark.parametrize("q_rows", [None, 0])  # the default (q and dO copied by the producer), before it starts
def test_the_gluon_dq_pass_fits_without_spilling_its_consumers(q_rows):
    case = next(c for c in kr._sparse_mla_bwd_cases() if c[0] == "sparse_mla_bwd_split_dq_gluon")
    _, fn, args, constexprs, configs = case
    cfg, _ = configs[0]
    if q_rows is not None:
        constexprs = {**constexprs, "Q_ROWS": q_rows}
    res = kr.compile_sm90(fn, args, constexprs, cfg.num_warps, cfg.num_stages)
    assert res["wgmma"] > 0 and res["cp_async"] > 0 and res["shared_bytes"] <= 232448, res
    # the set-up spills a few bytes outside the loops (8 with the producer copying q and dO, 24 without); the
    # consumers' loop spilled 312 with q at a constant shared-memory address (kernels/sparse_mla_bwd_gluon.py)
    assert res["spill_stack_bytes"] <= 32, res
    hoisted = kr.compile_sm90(fn, args, {**constexprs, "OPAQUE_Q": False}, cfg.num_warps, cfg.num_stages)
    assert hoisted["spill_stack_bytes"] > 4 * res["spill_stack_bytes"], (hoisted, res)


def test_the_gluon_dkv_pass_fits_two_rings_beside_its_columns_without_spilling():
    case = next(c for c in kr._sparse_mla_bwd_cases() if c[0] == "sparse_mla_bwd_split_dkv_gluon")
    _, fn, args, constexprs, configs = case
    for cfg, extra in configs:  # the value columns' launch, then the rope columns'
        res = kr.compile_sm90(fn, args, {**constexprs, **extra}, cfg.num_warps, cfg.num_stages)
        # 16-byte reductions only, with their L2 policy (inline `red`), none through tl.atomic_add
        assert res["wgmma"] > 0 and res["red_v4_f32"] > 0 and res["atom_v4_f32"] == res["atom_f32"] == 0, res
        assert res["spill_stack_bytes"] == 0 and res["shared_bytes"] <= 232448, res
