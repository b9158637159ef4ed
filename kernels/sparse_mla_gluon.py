"""Sparse MLA forward in Gluon: gathers by a producer warpgroup, the math by two consumer warpgroups.

Same contract as kernels/sparse_mla.py's sparse_mla_forward (q [T, heads, 576], kv [S, 576], idx [T,
topk] int32 with -1 for unused slots; returns out [T, heads, 512] and the natural-log lse), for the
GLM-5.2 shape only: 512 latent + 64 rope columns, heads in blocks of 64.

Why not Triton: its kernel (sparse_mla.py) runs 4.7 us a 64-key tile on the H200 against ~1.2 us of
tensor-core work, with the gathers, the softmax and the two GEMMs one after another in each of its 8
warps, and one CTA an SM (q plus two KV stages fill 216 KB of shared memory); Triton's own warp
specialisation of the loop gained nothing (4.68 against 4.66 ms). Here the schedule is written out:
- a producer partition (4 warps, few registers) gathers each tile's 64 KV rows with cp.async into a
  two-slot ring and signals the slot's `full` barrier when its copies land; it refills a slot once
  the consumers signal its `empty` barrier;
- the consumers (8 warps: two warpgroups, each owning half of a tile's key columns of S and 256 of
  the value columns of the [64, 512] fp32 accumulator) take the tiles in order: S = QK^T, the online
  softmax, P through shared memory (8 KB) to the PV GEMM, then the slot back to the producer, which
  by then has the next tile in the other slot.
Measured on an H100 (bench/results/sparse_mla_gluon_gpu.json run 3, three samples): 3.06-3.13 ms at 4096
tokens x top-2048 of a 64K context, 374-382 TFLOP/s, 1.50-1.53x the Triton kernel in the same process
(8K context: 382-393 TFLOP/s). Tried
and removed (run 2): issuing tile i+1's QK^T before tile i's softmax (FA3's overlap) made the
consumers hold both slots at once, so the producer could not run ahead and every gather's latency
was exposed: 5.13 ms, 0.90x Triton; with 32-key tiles in 3-4 slots (room to run ahead again, but
16-column wgmmas) 4.27 ms; 32-key tiles in order 3.99 ms.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

BLOCK_H = 64  # heads a program: one wgmma M
BLOCK_N = 64  # keys a tile
STAGES = 2  # KV slots: q (72 KB) + 2 x 72 KB + P (8 KB) = 224 KB of the 227 KB an SM has
D_V, D_R = 512, 64
PRODUCER_WARPS = 4
# H100, 64K context (bench/results/sparse_mla_gluon_gpu.json run 2, one warm machine, ~5% noise between
# timings): 88 registers and 32-row copies 3.06 ms; 56 / 16 rows 3.16-3.36; 88 / 64 rows 3.32; 152 / 64 3.38
PRODUCER_REGS = 88
ROW_GROUP = 32  # rows per cp.async call in the producer (16 16-byte copies a thread)


@gluon.jit
def gather_tiles(kv_ptr, idx_row, n_idx, stride_kv, kv_nope, kv_rope, full, empty,
              BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, STAGES: gl.constexpr,
              ROW_GROUP: gl.constexpr, WARPS: gl.constexpr):
    # 16-byte chunks (8 bf16) a thread, a warp's threads along the row
    nope_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])  # [ROW_GROUP, 512]
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WARPS, 1], [1, 0])  # [BLOCK_N, 64]
    cn = gl.arange(0, D_V, layout=gl.SliceLayout(0, nope_l))
    cr = gl.arange(0, D_R, layout=gl.SliceLayout(0, rope_l))
    n_tiles = gl.cdiv(n_idx, BLOCK_N)
    for i in range(n_tiles):
        s = i % STAGES
        # a fresh barrier counts as having completed the phase before its first: the first round passes
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        for g in gl.static_range(BLOCK_N // ROW_GROUP):
            j = i * BLOCK_N + g * ROW_GROUP + gl.arange(0, ROW_GROUP, layout=gl.SliceLayout(1, nope_l))
            ids = gl.load(idx_row + j, mask=j < n_idx, other=-1)
            rows = kv_ptr + gl.where(ids >= 0, ids, 0).to(gl.int64) * stride_kv  # -1: row 0, P = 0 there
            cp.async_copy_global_to_shared(kv_nope.index(s).slice(g * ROW_GROUP, ROW_GROUP, dim=0),
                                           rows[:, None] + cn[None, :])
        j = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rope_l))
        ids = gl.load(idx_row + j, mask=j < n_idx, other=-1)
        rows = kv_ptr + gl.where(ids >= 0, ids, 0).to(gl.int64) * stride_kv + D_V
        cp.async_copy_global_to_shared(kv_rope.index(s), rows[:, None] + cr[None, :])
        cp.mbarrier_arrive(full.index(s), increment_count=False)  # each thread, once its copies land


@gluon.jit
def tile_scores(i, idx_row, n_idx, cols, q_nope, q_rope, kv_nope, kv_rope, full, zero_s, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr):
    """Tile i's ring slot, its key ids (-1 past n_idx) and its S = QK^T issued (async) once the producer's
    copies are in the slot."""
    slot = i % STAGES
    j = i * BLOCK_N + cols
    ids = gl.load(idx_row + j, mask=j < n_idx, other=-1)
    mbarrier.wait(full.index(slot), (i // STAGES) & 1)
    fence_async_shared()  # the copies landed through the generic proxy; wgmma reads through the async one
    s_tok = warpgroup_mma(q_nope, kv_nope.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    return slot, ids, warpgroup_mma(q_rope, kv_rope.index(slot).permute((1, 0)), s_tok, is_async=True)


@gluon.jit
def _softmax_into_p(ids, scores, scale_log2, acc, m, denom, p_smem, o_l: gl.constexpr):
    """Online softmax of a tile's scores (base 2; ids < 0 masked): P into p_smem for the PV GEMM, the
    accumulator rescaled; the new running max and denominator."""
    s = gl.where((ids >= 0)[None, :], scores * scale_log2, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no valid key yet
    alpha = gl.exp2(m - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    denom = denom * alpha + gl.sum(p, axis=1)
    p_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()  # both warpgroups' halves of P are in place before either reads all of it
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
    return acc, m_new, denom


@gluon.jit
def _consumer(idx_row, n_idx, scale_log2, q_nope, q_rope, kv_nope, kv_rope, p_smem, full, empty,
              BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr, STAGES: gl.constexpr):
    """Each tile's scores, softmax and PV in order, while the producer fills the next slot."""
    # each warpgroup computes half of a tile's key columns of S and half of the value columns of O
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    zero_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
    m = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    denom = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_l))
    acc = gl.zeros([BLOCK_H, D_V], gl.float32, o_l)
    for i in range(gl.cdiv(n_idx, BLOCK_N)):
        slot, ids, s_tok = tile_scores(i, idx_row, n_idx, cols, q_nope, q_rope, kv_nope, kv_rope, full, zero_s,
                                       BLOCK_N, STAGES)
        scores = warpgroup_mma_wait(0, deps=(s_tok, ))
        acc, m, denom = _softmax_into_p(ids, scores, scale_log2, acc, m, denom, p_smem, o_l)
        o_tok = warpgroup_mma(p_smem, kv_nope.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(o_tok, ))
        gl.thread_barrier()  # every warp's PV is done with the slot and with P
        mbarrier.arrive(empty.index(slot), count=1)  # one thread (count 1), after the barrier
    return acc, m, denom


@gluon.jit
def rows_to_shared(smem, base, stride_row, r0, n_rows, col0, WARPS: gl.constexpr, EVICT: gl.constexpr):
    """smem [R, C] = rows r0 .. r0 + R of a row-major block at base (rows n_rows and past as zeros),
    columns col0 .. col0 + C; by the WARPS warps of the default partition, outside the specialised region
    (EVICT: the loads' L2 eviction policy, "" for the default)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    r = r0 + gl.arange(0, smem.shape[0], layout=gl.SliceLayout(1, layout))
    c = col0 + gl.arange(0, smem.shape[1], layout=gl.SliceLayout(0, layout))
    smem.store(gl.load(base + r[:, None] * stride_row + c[None, :], mask=(r < n_rows)[:, None], other=0.0,
                       eviction_policy=EVICT))


@gluon.jit
def rows_to_shared_async(smem, base, stride_row, r0, n_rows, col0, ROWS: gl.constexpr, WARPS: gl.constexpr):
    """rows_to_shared's copy by cp.async (16 bytes a thread a copy, ROWS rows a call) from any partition of WARPS
    warps: rows n_rows and past are not read (cp.async fills them with zeros). The caller waits for the copies
    (cp.async's mbarrier arrive, or wait_group) and fences before an async-proxy reader (wgmma)."""
    C: gl.constexpr = smem.shape[1]
    TPC: gl.constexpr = C // 8 if C // 8 < 32 else 32
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC], [WARPS, 1], [1, 0])
    c = col0 + gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    for g in gl.static_range(smem.shape[0] // ROWS):
        r = r0 + g * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cp.async_copy_global_to_shared(smem.slice(g * ROWS, ROWS, dim=0), base + r[:, None] * stride_row + c[None, :],
                                       mask=(r < n_rows)[:, None])


@gluon.jit
def kv_ring(dtype: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, STAGES: gl.constexpr,
            PRODUCER_WARPS: gl.constexpr):
    """The KV tiles' ring in shared memory ([STAGES, BLOCK_N, D_V] and [STAGES, BLOCK_N, D_R]) and its slots'
    `full` barriers (one arrival per producer thread, as its copies land) and `empty` ones (one arrival)."""
    kv_nope = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_V],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_V], gl.bfloat16))
    kv_rope = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_R],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_R], gl.bfloat16))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(empty.index(s), count=1)
    return kv_nope, kv_rope, full, empty


@gluon.jit
def _sparse_mla_fwd_gluon(q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, scale_log2, n_idx,
                          stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh, stride_lt,
                          HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr,
                          D_R: gl.constexpr, STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                          PRODUCER_REGS: gl.constexpr, ROW_GROUP: gl.constexpr):
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    qn_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_V], gl.bfloat16)
    qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_R], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    q_nope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], qn_sl)
    q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_R], qr_sl)
    kv_nope, kv_rope, full, empty = kv_ring(dtype, BLOCK_N, D_V, D_R, STAGES, PRODUCER_WARPS)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_sl)

    rows_to_shared(q_nope, q_ptr + t * stride_qt, stride_qh, h0, HEADS, 0, 8, "")  # once; heads past HEADS: zeros
    rows_to_shared(q_rope, q_ptr + t * stride_qt, stride_qh, h0, HEADS, D_V, 8, "")
    fence_async_shared()
    gl.thread_barrier()

    idx_row = idx_ptr + t * stride_it
    acc, m, denom = gl.warp_specialize(
        [(_consumer, (idx_row, n_idx, scale_log2, q_nope, q_rope, kv_nope, kv_rope, p_smem, full, empty,
                      BLOCK_H, BLOCK_N, D_V, STAGES)),
         (gather_tiles, (kv_ptr, idx_row, n_idx, stride_kv, kv_nope, kv_rope, full, empty,
                      BLOCK_N, D_V, D_R, STAGES, ROW_GROUP, PRODUCER_WARPS))],
        [PRODUCER_WARPS], [PRODUCER_REGS])

    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    l_safe = gl.where(denom > 0, denom, 1.0)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_l))[:, None]
    ho = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_l))
    co = gl.arange(0, D_V, layout=gl.SliceLayout(0, o_l))
    gl.store(out_ptr + t * stride_ot + ho[:, None] * stride_oh + co[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(ho < HEADS)[:, None])
    lse = gl.where(denom > 0, (m + gl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    hl = h0 + gl.arange(0, BLOCK_H, layout=m.type.layout)
    gl.store(lse_ptr + t * stride_lt + hl, lse, mask=hl < HEADS)


def constexprs(**change) -> dict:
    """The kernel's compile-time constants besides HEADS (what a launch and bench/kernel_resources pass);
    change: the variants bench/gpu/sparse_mla_gluon_check.py times (BLOCK_N 32 with STAGES up to 4,
    PRODUCER_REGS, PRODUCER_WARPS, ROW_GROUP)."""
    base = dict(BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, D_V=D_V, D_R=D_R, STAGES=STAGES, PRODUCER_WARPS=PRODUCER_WARPS,
                PRODUCER_REGS=PRODUCER_REGS, ROW_GROUP=ROW_GROUP)
    unknown = set(change) - set(base)
    if unknown:
        raise ValueError(f"unknown Gluon sparse MLA constants {sorted(unknown)}; known: {sorted(base)}")
    return base | change


def supports(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> bool:
    """The shapes and machines this kernel is written for: bf16 on sm_90, 512 + 64 columns."""
    return (q.is_cuda and q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16 and d_v == D_V
            and q.shape[-1] == D_V + D_R and torch.cuda.get_device_capability(q.device)[0] == 9)


def launch_forward(kernel, cx: dict, num_warps: int, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor,
                   sm_scale: float, d_v: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_mla.sparse_mla_forward's outputs from one of the Gluon forward kernels (this module's, or
    sparse_mla_gluon_pair.py's: the same arguments) launched with constants cx, a program per (token, 64 heads)."""
    if not supports(q, kv, d_v):
        raise ValueError(f"the {name} needs bf16 q and kv on an sm_90 GPU with 512 + 64 columns; got q "
                         f"{q.dtype} {tuple(q.shape)} on {q.device}, d_v={d_v}")
    q, kv, idx = q.contiguous(), kv.contiguous(), idx.to(torch.int32).contiguous()
    T, heads, _ = q.shape
    out = torch.empty((T, heads, d_v), device=q.device, dtype=q.dtype)
    lse = torch.empty((T, heads), device=q.device, dtype=torch.float32)
    if T == 0:
        return out, lse
    if idx.shape[1] == 0:  # no slot: the consumers would wait for a first tile that never comes
        return out.zero_(), lse.fill_(float("-inf"))
    head_blocks = triton.cdiv(heads, BLOCK_H)
    kernel[(T, head_blocks)](q, kv, idx, out, lse, sm_scale * 1.4426950408889634, idx.shape[1], q.stride(0),
                             q.stride(1), kv.stride(0), idx.stride(0), out.stride(0), out.stride(1), lse.stride(0),
                             HEADS=heads, **cx, num_warps=num_warps)
    return out, lse


def sparse_mla_forward_gluon(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sm_scale: float,
                             d_v: int = 512, **schedule) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_mla.sparse_mla_forward's outputs from this kernel (inputs as checked there)."""
    return launch_forward(_sparse_mla_fwd_gluon, constexprs(**schedule), 8, q, kv, idx, sm_scale, d_v,
                          "Gluon sparse MLA forward")
