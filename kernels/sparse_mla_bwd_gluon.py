"""The split backward's dq pass in Gluon: the forward's producer/consumer schedule, on sm_90.

Same contract as sparse_mla_bwd_rows.py's kernel with STORE_DSP and without WITH_DKV (what
kernels/sparse_mla_bwd_split.py launches): per (token, block of 64 heads) it recomputes S and P from
lse, accumulates dq = dS kv, and writes the bf16 dS and P tiles into the [tokens, heads, topk]
scratch from which the dkv pass builds dkv. For the GLM-5.2 shape only (bf16, 512 + 64 columns): where the Gluon forward runs
(sparse_mla_gluon.supports).

Why: the Triton dq pass runs one stage, because q, dO and one 64-key KV tile fill 208 KB of shared
memory, so its gathers never overlap its GEMMs (4.62 ms a 2048-token chunk of 4096 x top-2048 of
64K on an H100). Here a producer warpgroup (kernels/sparse_mla_gluon.py's `gather_tiles`) gathers
32-key tiles into a two-slot ring beside q and dO (221 KB) while two consumer warpgroups compute,
per tile: S = q kv^T and dP = dO kv_nope^T (each warpgroup half of the key columns), P and dS, both
through shared memory to the dq GEMMs (dq += dS kv: each warpgroup half of the 576 columns) and,
while those run, out to the scratch in 16-byte rows. Measured on H100s
(bench/results/dq_pass_gluon_gpu.json, three runs, each in one process): 2.52-2.64 ms, 1.74-1.83x the
Triton pass, dq, dS and P bit-identical to it; with q and dO copied by the producer (Q_ROWS, session 29)
2.48-2.53 ms.
Register budget: the dq accumulator is 144 fp32 registers a thread. With the q and dO tiles at a
constant shared-memory address the compiler hoists the 68 64-bit wgmma descriptors of their
k-steps out of the key loop, 136 more registers, and the consumers spilled 312 bytes a thread (3.74
ms); at a loop-variant index that is always 0 the descriptors are uniform adds in the loop, and at
PRODUCER_REGS 56 (the consumers get 224) nothing spills.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

from kernels.sparse_mla_gluon import (BLOCK_H, D_R, D_V, gather_tiles, kv_ring, rows_to_shared, rows_to_shared_async,
                                      tile_scores)

# H100, one 2048-token chunk (bench/results/dq_pass_gluon_gpu.json runs 1-3): 32-key tiles in 2 slots;
# producer registers 40, 56, 72 or 88 (the consumers get 208 there and spill 40 bytes), 2 producer warps,
# 16- or 32-row copies all within 2.52-2.64 ms (noise); 64-key tiles in 1 slot 2.83; q at a constant
# address 3.74-3.82
# SCRATCH_EVICT: the L2 eviction policy of the dS / P scratch stores (2 x 1 GB at 4096 tokens, read back by the
# dkv pass long after L2 has turned over); IO_EVICT: of dq's stores and (Q_ROWS 0) q / dO's loads, once a program
# each ("": the default; "evict_first" asks L2 to drop those lines before the gathered KV rows; cp.async drops it)
# Q_ROWS: 0 loads q and dO (139 KB) in the default partition before the producer starts; > 0 has the producer copy
# them by cp.async (Q_ROWS rows a call) ahead of its first gathers, so that their loads and the first tile's overlap
# (H100, dq_pass_gluon_gpu.json run 6: 32 rows 2.477-2.527 ms against 2.558-2.571 with 0, 16 rows 2.493; dq, dS
# and P bit-identical); SCRATCH_EVICT evict_first beside it 2.483 (no gain the run could show)
SCHEDULE = dict(BLOCK_N=32, STAGES=2, PRODUCER_WARPS=4, PRODUCER_REGS=56, ROW_GROUP=32, OPAQUE_Q=True,
                SCRATCH_EVICT="", IO_EVICT="", Q_ROWS=32)


@gluon.jit
def tile_to_global(smem, row, k0, n_idx, n_heads, WARPS: gl.constexpr, EVICT: gl.constexpr):
    """A [heads, keys] bf16 tile from shared memory into the [heads, topk] scratch rows at key k0, 16 bytes
    a thread with one address each, by the WARPS warps of the calling partition. From the wgmma layout each
    thread would store 8 scattered values through 8 64-bit addresses (32 registers the consumers do not have)."""
    kpt: gl.constexpr = smem.shape[1] // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // kpt, kpt], [WARPS, 1], [1, 0])
    h = gl.arange(0, smem.shape[0], layout=gl.SliceLayout(1, layout))
    k = k0 + gl.arange(0, smem.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(row + h[:, None] * n_idx + k[None, :], smem.load(layout),
             mask=(h < n_heads)[:, None] & (k < n_idx)[None, :], eviction_policy=EVICT)


@gluon.jit
def row_stats(lse_row, delta_row, n_heads, BLOCK_H: gl.constexpr, s_l: gl.constexpr):
    """Per head row of the S tile (layout s_l): whether it has a valid key (a row with none has P = 0
    everywhere), its lse in base 2 (0 where it has none) and its Delta."""
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_l))
    head_ok = heads < n_heads
    lse = gl.load(lse_row + heads, mask=head_ok, other=float("-inf"))
    row_ok = head_ok & (lse > float("-inf"))
    return row_ok, gl.where(row_ok, lse * 1.4426950408889634, 0.0), gl.load(delta_row + heads, mask=head_ok, other=0.0)


@gluon.jit
def _dq_consumer(idx_row, n_idx, n_heads, lse_row, delta_row, ds_row, p_row, scale, scale_log2, q_nope, q_rope,
                 do_s, kv_nope, kv_rope, ds_smem, p_smem, full, empty, q_full, BLOCK_H: gl.constexpr,
                 BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, STAGES: gl.constexpr,
                 OPAQUE_Q: gl.constexpr, SCRATCH_EVICT: gl.constexpr, Q_ROWS: gl.constexpr):
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    dn_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    dr_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                   instr_shape=[16, D_R // 2, 16])
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    row_ok, lse2, delta = row_stats(lse_row, delta_row, n_heads, BLOCK_H, s_l)
    zero_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
    dq_n = gl.zeros([BLOCK_H, D_V], gl.float32, dn_l)
    dq_r = gl.zeros([BLOCK_H, D_R], gl.float32, dr_l)
    if Q_ROWS > 0:
        mbarrier.wait(q_full, 0)  # tile_scores fences before the first wgmma reads q
    for i in range(gl.cdiv(n_idx, BLOCK_N)):
        z = (i + n_idx) >> 30 if OPAQUE_Q else 0  # always 0 (n_idx < 2^30): see the module's docstring
        slot, ids, s_tok = tile_scores(i, idx_row, n_idx, cols, q_nope.index(z), q_rope.index(z), kv_nope, kv_rope,
                                       full, zero_s, BLOCK_N, STAGES)
        dp_tok = warpgroup_mma(do_s.index(z), kv_nope.index(slot).permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
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
        tile_to_global(ds_smem, ds_row, i * BLOCK_N, n_idx, n_heads, 8, SCRATCH_EVICT)  # while the wgmmas run
        tile_to_global(p_smem, p_row, i * BLOCK_N, n_idx, n_heads, 8, SCRATCH_EVICT)
        dq_n, dq_r = warpgroup_mma_wait(0, deps=(n_tok, r_tok))
        gl.thread_barrier()  # every warp is done with the slot, dS and P
        mbarrier.arrive(empty.index(slot), count=1)
    return dq_n, dq_r


@gluon.jit
def _dq_producer(kv_ptr, idx_row, n_idx, stride_kv, kv_nope, kv_rope, full, empty, q_row, do_row, stride_qh, stride_doh,
                 h0, q_nope, q_rope, do_s, q_full, HEADS: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr,
                 D_R: gl.constexpr, STAGES: gl.constexpr, ROW_GROUP: gl.constexpr, WARPS: gl.constexpr,
                 Q_ROWS: gl.constexpr):
    """The producer: (Q_ROWS > 0) q and dO by cp.async, q_full's arrival as they land, then the KV tiles."""
    if Q_ROWS > 0:
        rows_to_shared_async(q_nope.index(0), q_row, stride_qh, h0, HEADS, 0, Q_ROWS, WARPS)
        rows_to_shared_async(q_rope.index(0), q_row, stride_qh, h0, HEADS, D_V, Q_ROWS, WARPS)
        rows_to_shared_async(do_s.index(0), do_row, stride_doh, h0, HEADS, 0, Q_ROWS, WARPS)
        cp.mbarrier_arrive(q_full, increment_count=False)
    gather_tiles(kv_ptr, idx_row, n_idx, stride_kv, kv_nope, kv_rope, full, empty, BLOCK_N, D_V, D_R, STAGES,
                 ROW_GROUP, WARPS)


@gluon.jit
def dq_pass_kernel(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, ds_ptr, p_ptr, scale, scale_log2,
                   n_idx, stride_qt, stride_qh, stride_kv, stride_it, stride_dot, stride_doh, stride_lt, stride_dqt,
                   stride_dqh, stride_st, HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                   D_V: gl.constexpr, D_R: gl.constexpr, STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr, ROW_GROUP: gl.constexpr, OPAQUE_Q: gl.constexpr,
                   SCRATCH_EVICT: gl.constexpr, IO_EVICT: gl.constexpr, Q_ROWS: gl.constexpr):
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    qn_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_V], gl.bfloat16)
    qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_R], gl.bfloat16)
    t_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    q_nope = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_V], qn_sl)  # [1, ...]: for a loop-variant index
    q_rope = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_R], qr_sl)
    do_s = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_V], qn_sl)
    kv_nope, kv_rope, full, empty = kv_ring(dtype, BLOCK_N, D_V, D_R, STAGES, PRODUCER_WARPS)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], t_sl)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], t_sl)
    q_full = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_full.index(0), count=PRODUCER_WARPS * 32)
    q_row = q_ptr + t * stride_qt
    do_row = do_ptr + t * stride_dot
    if Q_ROWS == 0:  # by the default partition, before the producer starts; heads past HEADS as zeros
        rows_to_shared(q_nope.index(0), q_row, stride_qh, h0, HEADS, 0, 8, IO_EVICT)
        rows_to_shared(q_rope.index(0), q_row, stride_qh, h0, HEADS, D_V, 8, IO_EVICT)
        rows_to_shared(do_s.index(0), do_row, stride_doh, h0, HEADS, 0, 8, IO_EVICT)
    fence_async_shared()
    gl.thread_barrier()
    idx_row = idx_ptr + t * stride_it
    lse_row = lse_ptr + t * stride_lt + h0
    dq_n, dq_r = gl.warp_specialize(
        [(_dq_consumer, (idx_row, n_idx, HEADS - h0, lse_row, delta_ptr + t * stride_lt + h0,
                         ds_ptr + t * stride_st + h0 * n_idx, p_ptr + t * stride_st + h0 * n_idx, scale, scale_log2,
                         q_nope, q_rope, do_s, kv_nope, kv_rope, ds_smem, p_smem, full, empty, q_full.index(0),
                         BLOCK_H, BLOCK_N, D_V, D_R, STAGES, OPAQUE_Q, SCRATCH_EVICT, Q_ROWS)),
         (_dq_producer, (kv_ptr, idx_row, n_idx, stride_kv, kv_nope, kv_rope, full, empty, q_row, do_row, stride_qh,
                         stride_doh, h0, q_nope, q_rope, do_s, q_full.index(0), HEADS, BLOCK_N, D_V, D_R, STAGES,
                         ROW_GROUP, PRODUCER_WARPS, Q_ROWS))],
        [PRODUCER_WARPS], [PRODUCER_REGS])
    dn_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    dr_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                   instr_shape=[16, D_R // 2, 16])
    hn = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, dn_l))
    hr = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, dr_l))
    dq_row = dq_ptr + t * stride_dqt
    gl.store(dq_row + hn[:, None] * stride_dqh + gl.arange(0, D_V, layout=gl.SliceLayout(0, dn_l))[None, :],
             dq_n.to(dtype), mask=(hn < HEADS)[:, None], eviction_policy=IO_EVICT)
    gl.store(dq_row + hr[:, None] * stride_dqh + D_V + gl.arange(0, D_R, layout=gl.SliceLayout(0, dr_l))[None, :],
             dq_r.to(dtype), mask=(hr < HEADS)[:, None], eviction_policy=IO_EVICT)


def constexprs(heads: int, **change) -> dict:
    """The kernel's compile-time constants (what a launch and bench/kernel_resources pass); change: the
    variants bench/gpu/dq_pass_gluon.py times."""
    base = dict(HEADS=heads, BLOCK_H=BLOCK_H, D_V=D_V, D_R=D_R, **SCHEDULE)
    unknown = set(change) - set(base)
    if unknown:
        raise ValueError(f"unknown Gluon dq pass constants {sorted(unknown)}; known: {sorted(base)}")
    base |= change
    base["ROW_GROUP"] = min(base["ROW_GROUP"], base["BLOCK_N"])
    return base


def dq_pass(q, kv, idx, grad_out, lse, delta, dq, ds, p, sm_scale: float, **schedule) -> None:
    """dq of q's tokens, and their bf16 dS / P scratch rows [tokens, heads, topk] (contiguous inputs, as
    split_backward passes them; n_idx >= 1)."""
    n, heads, _ = q.shape
    dq_pass_kernel[(n, -(-heads // BLOCK_H))](
        q, kv, idx, grad_out, lse, delta, dq, ds, p, sm_scale, sm_scale * 1.4426950408889634, idx.shape[1],
        q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), grad_out.stride(0), grad_out.stride(1),
        lse.stride(0), dq.stride(0), dq.stride(1), ds.stride(0), **constexprs(heads, **schedule), num_warps=8)
