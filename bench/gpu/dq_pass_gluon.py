"""Probe: the split backward's dq pass with the Gluon forward's producer/consumer schedule.

The shipped dq pass (kernels/sparse_mla_bwd_rows.py with STORE_DSP) runs one stage: q, dO and one
64-key KV tile fill 208 KB of shared memory, so its gathers never overlap its GEMMs (the Triton
forward: 4.66 ms at 2 stages against 6.09 at 1). Here a producer warpgroup gathers KV tiles into a
ring (kernels/sparse_mla_gluon.py's `_producer`, unchanged) while two consumer warpgroups compute,
per tile: S = q kv^T, dP = dO kv_nope^T, P and dS, the bf16 dS and P into the split impl's scratch,
and dq += dS kv. With 32-key tiles two slots fit beside q and dO (212 KB), so the producer runs a
tile ahead, at the price of 16-column wgmmas for S and dP (the forward's in-order 32-key tiles: 3.99
ms against Triton's 4.61, H100, sparse_mla_gluon_gpu.json run 2).

Not part of the product until it is measured: on a GPU, `python bench/gpu/dq_pass_gluon.py --out
X.json` checks dq, dS and P against the shipped pass on one 2048-token chunk (4096 x top-2048 of a
64K context, the kernels benchmark's inputs) and times both; `--compile-only` compiles it for sm_90
here (bench/kernel_resources.py) and prints its registers and shared memory: 217 KB at 32-key tiles
in two slots; the consumers (the register file less the producer's PRODUCER_REGS, 208 a thread at 88)
spill 184-288 bytes a thread (the dq accumulator alone is 144 registers), which the first GPU run
should weigh before anything else.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.sparse_mla_gluon import _producer, rows_to_shared, tile_scores  # noqa: E402

# the default (32-key tiles, two slots, 56 producer registers so that the consumers get 224: no spills);
# 32-row copies; 88 producer registers (208 for the consumers: 40 bytes spilled); the constant-index q
# (312 bytes spilled); 64-key tiles in one slot (80 bytes spilled)
SCHEDULES = [{}, {"ROW_GROUP": 32}, {"PRODUCER_REGS": 88}, {"PRODUCER_REGS": 88, "OPAQUE_Q": False},
             {"BLOCK_N": 64, "STAGES": 1}]


@gluon.jit
def _tile_to_global(smem, row, k0, n_idx, HEADS: gl.constexpr):
    """A [heads, keys] bf16 tile from shared memory into the [heads, topk] scratch rows at key k0: 16 bytes
    a thread, one address each. Stored straight from the wgmma layout, each thread held 8 scattered
    values and 8 64-bit addresses (the loop-invariant part hoisted), 32 registers of the 208 the
    consumers have, and they spilled 288 bytes a thread."""
    kpt: gl.constexpr = smem.shape[1] // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // kpt, kpt], [8, 1], [1, 0])
    h = gl.arange(0, smem.shape[0], layout=gl.SliceLayout(1, layout))
    k = k0 + gl.arange(0, smem.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(row + h[:, None] * n_idx + k[None, :], smem.load(layout),
             mask=(h < HEADS)[:, None] & (k < n_idx)[None, :])


@gluon.jit
def _dq_consumer(idx_row, n_idx, lse_row, delta_row, ds_row, p_row, scale, scale_log2, q_nope, q_rope, do_s,
                 kv_nope, kv_rope, ds_smem, p_smem, full, empty, HEADS: gl.constexpr, BLOCK_H: gl.constexpr,
                 BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, STAGES: gl.constexpr,
                 OPAQUE_Q: gl.constexpr):
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    dn_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    dr_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                   instr_shape=[16, D_R // 2, 16])
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_l))
    head_ok = heads < HEADS
    lse = gl.load(lse_row + heads, mask=head_ok, other=float("-inf"))
    row_ok = head_ok & (lse > float("-inf"))  # a row with no valid key has P = 0 everywhere
    lse2 = gl.where(row_ok, lse * 1.4426950408889634, 0.0)
    delta = gl.load(delta_row + heads, mask=head_ok, other=0.0)
    zero_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
    dq_n = gl.zeros([BLOCK_H, D_V], gl.float32, dn_l)
    dq_r = gl.zeros([BLOCK_H, D_R], gl.float32, dr_l)
    for i in range(gl.cdiv(n_idx, BLOCK_N)):
        # q's and dO's tiles at a loop-variant index that is always 0 (i + n_idx < 2^30): with a constant one
        # the compiler hoists the 68 64-bit wgmma descriptors of their k-steps out of the loop, 136 registers
        # the consumers do not have (they spilled 288 bytes a thread); computed in the loop they are uniform adds
        z = (i + n_idx) >> 30 if OPAQUE_Q else 0
        slot, ids, s_tok = tile_scores(i, idx_row, n_idx, cols, q_nope.index(z), q_rope.index(z), kv_nope, kv_rope,
                                       full, zero_s, BLOCK_N, STAGES)
        dp_tok = warpgroup_mma(do_s.index(z), kv_nope.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(0, deps=(s_tok, dp_tok))
        live = row_ok[:, None] & (ids >= 0)[None, :]
        p = gl.where(live, gl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        ds = (p * (dp - delta[:, None]) * scale).to(gl.bfloat16)
        ds_smem.store(ds)
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # both warpgroups' halves of dS and P in place before either reads all of it
        n_tok = warpgroup_mma(ds_smem, kv_nope.index(slot), dq_n, is_async=True)
        r_tok = warpgroup_mma(ds_smem, kv_rope.index(slot), dq_r, is_async=True)
        _tile_to_global(ds_smem, ds_row, i * BLOCK_N, n_idx, HEADS)  # while the wgmmas run (they only read)
        _tile_to_global(p_smem, p_row, i * BLOCK_N, n_idx, HEADS)
        dq_n, dq_r = warpgroup_mma_wait(0, deps=(n_tok, r_tok))
        gl.thread_barrier()  # every warp is done with the slot and with dS
        mbarrier.arrive(empty.index(slot), count=1)
    return dq_n, dq_r


@gluon.jit
def _dq_pass_gluon(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, ds_ptr, p_ptr, scale, scale_log2,
                   n_idx, stride_qt, stride_qh, stride_kv, stride_it, stride_dot, stride_doh, stride_lt, stride_dqt,
                   stride_dqh, stride_st, HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                   D_V: gl.constexpr, D_R: gl.constexpr, STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr, ROW_GROUP: gl.constexpr, OPAQUE_Q: gl.constexpr):
    t = gl.program_id(0).to(gl.int64)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_nope = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_V], gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_V],
                                                                                                  gl.bfloat16))
    q_rope = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_R], gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_R],
                                                                                                  gl.bfloat16))
    do_s = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_V], gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_V],
                                                                                                gl.bfloat16))
    kv_nope = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_V],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_V], gl.bfloat16))
    kv_rope = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_R],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_R], gl.bfloat16))
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16))
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(empty.index(s), count=1)
    rows_to_shared(q_nope.index(0), q_ptr + t * stride_qt, stride_qh, 0, HEADS, 0)
    rows_to_shared(q_rope.index(0), q_ptr + t * stride_qt, stride_qh, 0, HEADS, D_V)
    rows_to_shared(do_s.index(0), do_ptr + t * stride_dot, stride_doh, 0, HEADS, 0)
    fence_async_shared()
    gl.thread_barrier()
    idx_row = idx_ptr + t * stride_it
    dq_n, dq_r = gl.warp_specialize(
        [(_dq_consumer, (idx_row, n_idx, lse_ptr + t * stride_lt, delta_ptr + t * stride_lt, ds_ptr + t * stride_st,
                         p_ptr + t * stride_st, scale, scale_log2, q_nope, q_rope, do_s, kv_nope, kv_rope, ds_smem,
                         p_smem, full, empty, HEADS, BLOCK_H, BLOCK_N, D_V, D_R, STAGES, OPAQUE_Q)),
         (_producer, (kv_ptr, idx_row, n_idx, stride_kv, kv_nope, kv_rope, full, empty, BLOCK_N, D_V, D_R, STAGES,
                      ROW_GROUP, PRODUCER_WARPS))],
        [PRODUCER_WARPS], [PRODUCER_REGS])
    dn_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    dr_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                   instr_shape=[16, D_R // 2, 16])
    hn = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, dn_l))
    hr = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, dr_l))
    dq_row = dq_ptr + t * stride_dqt
    gl.store(dq_row + hn[:, None] * stride_dqh + gl.arange(0, D_V, layout=gl.SliceLayout(0, dn_l))[None, :],
             dq_n.to(dtype), mask=(hn < HEADS)[:, None])
    gl.store(dq_row + hr[:, None] * stride_dqh + D_V + gl.arange(0, D_R, layout=gl.SliceLayout(0, dr_l))[None, :],
             dq_r.to(dtype), mask=(hr < HEADS)[:, None])


def constexprs(heads: int = 64, **change) -> dict:
    base = dict(HEADS=heads, BLOCK_H=64, BLOCK_N=32, D_V=512, D_R=64, STAGES=2, PRODUCER_WARPS=4, PRODUCER_REGS=56,
                ROW_GROUP=16, OPAQUE_Q=True)
    base |= change
    base["ROW_GROUP"] = min(base["ROW_GROUP"], base["BLOCK_N"])
    return base


def launch(q, kv, idx, dout, lse, delta, dq, ds, p, scale, **schedule) -> None:
    """dq, and the bf16 dS / P scratch rows, of q's tokens (heads <= 64), as the split impl's dq pass."""
    n, heads, _ = q.shape
    _dq_pass_gluon[(n, )](q, kv, idx, dout, lse, delta, dq, ds, p, scale, scale * 1.4426950408889634, idx.shape[1],
                          q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), dout.stride(0), dout.stride(1),
                          lse.stride(0), dq.stride(0), dq.stride(1), ds.stride(0),
                          **constexprs(heads, **schedule), num_warps=8)


def compile_only() -> int:
    from bench.kernel_resources import Ptr, compile_sm90
    H, K = 64, 2048
    args = {"q_ptr": Ptr("bf16"), "kv_ptr": Ptr("bf16"), "idx_ptr": Ptr("i32"), "do_ptr": Ptr("bf16"),
            "lse_ptr": Ptr("fp32"), "delta_ptr": Ptr("fp32"), "dq_ptr": Ptr("bf16"), "ds_ptr": Ptr("bf16"),
            "p_ptr": Ptr("bf16"), "scale": 0.0625, "scale_log2": 0.09, "n_idx": K, "stride_qt": H * 576,
            "stride_qh": 576, "stride_kv": 576, "stride_it": K, "stride_dot": H * 512, "stride_doh": 512,
            "stride_lt": H, "stride_dqt": H * 576, "stride_dqh": 576, "stride_st": K * H}
    for sch in SCHEDULES:
        print(json.dumps({"schedule": sch, **compile_sm90(_dq_pass_gluon, args, constexprs(H, **sch), 8, 1)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 here and print the resources")
    a = ap.parse_args(argv)
    if a.compile_only:
        return compile_only()
    if a.out is None:
        ap.error("--out is required unless --compile-only")
    import torch

    from bench.machine import machine
    from bench.gpu.split_dkv_floor import backward_inputs
    from kernels import sparse_mla_bwd_split as spl
    from kernels.sparse_mla import LOG2E
    from kernels.sparse_mla_bwd_rows import sparse_mla_bwd_rows_kernel

    T, S, H, DV, DR, K = 2048, 65536, 64, 512, 64, 2048
    dev = torch.device("cuda")
    q, kv, idx, dout, scale, lse, delta = backward_inputs(T, S, H, K, hole_rows=4)  # -1 slots past 1000
    ds0, p0 = (torch.empty((T, H, K), device=dev, dtype=torch.bfloat16) for _ in range(2))
    dq0 = torch.empty_like(q)
    spl.split_backward(q, kv, idx, dout, lse, delta, scale, DV)  # tunes the shipped dq pass
    cfg = spl.DQ_TUNER.records[spl.tuning_key(q, idx)].best

    def shipped():
        sparse_mla_bwd_rows_kernel[(T, 1)](
            q, kv, idx, dout, lse, delta, dq0, dq0, ds0, p0, scale, scale * LOG2E, K,
            q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), dout.stride(0), dout.stride(1), lse.stride(0),
            dq0.stride(0), dq0.stride(1), 0, ds0.stride(0), HEADS=H, D_V=DV, D_R=DR, BLOCK_H=64,
            BLOCK_N=cfg["BLOCK_N"], WITH_DKV=False, STORE_DSP=True, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)

    shipped()
    flops = 2.0 * T * H * K * (DV + DR + DV + DV + DR)  # S, dP and dq
    result = {"machine": machine(), "shape": {"tokens": T, "context": S, "heads": H, "topk": K}, "flops": flops,
              "shipped": {"config": cfg.describe(), "ms": round(triton.testing.do_bench(shipped, warmup=10, rep=100), 4)},
              "gluon": []}
    result["shipped"]["tflops"] = round(flops / result["shipped"]["ms"] / 1e9, 1)
    print(json.dumps(result["shipped"]), flush=True)
    for sch in SCHEDULES:
        ds, p, dq = torch.empty_like(ds0), torch.empty_like(p0), torch.empty_like(q)
        row = {"schedule": sch}
        try:
            launch(q, kv, idx, dout, lse, delta, dq, ds, p, scale, **sch)
            row |= {"max_abs_diff_dq": float((dq.float() - dq0.float()).abs().max()),
                    "max_abs_dq": float(dq0.float().abs().max()),
                    "max_abs_diff_ds": float((ds.float() - ds0.float()).abs().max()),
                    "max_abs_diff_p": float((p.float() - p0.float()).abs().max())}
            ms = triton.testing.do_bench(lambda sch=sch: launch(q, kv, idx, dout, lse, delta, dq, ds, p, scale, **sch),
                                         warmup=10, rep=100)
            row |= {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                    "speedup_over_shipped": round(result["shipped"]["ms"] / ms, 3)}
        except Exception as exc:  # noqa: BLE001 -- a schedule that fails to compile or run is a finding
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[-1][:300] if str(exc) else ''}"
        result["gluon"].append(row)
        print(json.dumps(row), flush=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
