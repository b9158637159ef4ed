"""Sparse MLA forward in Gluon, the two consumer warpgroups on alternate key tiles (sm_90).

Same contract as kernels/sparse_mla_gluon.py (q [T, heads, 576], kv [S, 576], idx [T, topk] int32 with -1
for unused slots; out [T, heads, 512] and the natural-log lse), for the same shapes.

Why: in sparse_mla_gluon.py both consumer warpgroups work on every 64-key tile, each computing half of its
key columns of S: a 64 x 32 wgmma whose 2 KB of q per 16-deep step is read from shared memory for 1 KB of
keys, so at 64 heads the QK^T GEMM (53% of the FLOPs) is bound by shared-memory reads, and each tile's
steps run one after another (374-382 TFLOP/s on an H100). Here each warpgroup takes every other tile whole
(64 x 64 wgmmas: q's reads amortised over twice the keys) and owns half of O's 512 value columns, the
schedule DeepSeek's FlashMLA sparse prefill uses for 64 heads (issue #22: 640 TFLOP/s on an H800):
- tile pair j: warpgroup 0 has S0 of tile 2j, warpgroup 1 S1 of tile 2j + 1. Warpgroup 0 takes the online
  softmax's new row max m0 over its tile and hands it over in shared memory; warpgroup 1 goes on to
  m1 = max(m0, its tile's), hands that back, and both end the pair at m1;
- each warpgroup multiplies its own P (from registers) into its half of O, and the other's P (through shared
  memory, warpgroup 0's rescaled to m1 first) into the same half: O[:, :256] by warpgroup 0, O[:, 256:]
  by warpgroup 1;
- a producer warpgroup gathers each tile's KV rows with cp.async into two slots (slot 0: even tiles, slot 1:
  odd), each in a left half (columns 0-255) and a right one (256-575), each half with its own `full` and
  `empty` barriers: a half is refilled as soon as its last reader is done (slot 0's left after warpgroup
  0's own PV, its right after warpgroup 1's PV over it), and the next tile's QK^T starts on the left half
  while the right one lands;
- warpgroup 0's P for warpgroup 1 goes where slot 0's rope columns were (read only by its QK^T, already
  done): q 72 KB + two 72 KB slots + warpgroup 1's P 8 KB fit the 227 KB an SM has;
- the producer also loads q, by cp.async right after the first tile's left half (`Q_ROWS`), so that q's load
  and the first gathers are in flight together: a program holds its SM alone, and with q loaded by the
  consumers before the producer started, the two latencies ran one after the other in every program (session
  29, sparse_mla_gluon_gpu.json run 14, H100: 64K 2.97-3.05 ms against 3.03-3.13, 8K 2.71-2.72 against 2.77-2.78).
At the end the two warpgroups add their row sums through shared memory and each writes its half of out.
Measured on an H100 (bench/results/sparse_mla_gluon_gpu.json run 4, three timings in two processes), 4096
tokens x top-2048: at an 8K context (latents in L2) 2.73-2.74 ms, 426-429 TFLOP/s, 1.05-1.12x sparse_mla_gluon.py;
at 64K 3.04-3.14 ms, 0.97-0.98x: there the gathers that miss L2 decide, and both kernels hold two 64-key slots.
On the H200 (session 25, same runs) it was the faster at both contexts: 8K 2.69-2.76 ms against 2.90-2.96, 64K
2.96-3.01 against 3.01-3.06 (388-394 TFLOP/s), so it is the default wherever the Gluon kernels run
(sparse_mla.DEFAULT_GLUON_FWD); bench.kernels times the other beside it.
Tried and removed, for the 64K context: the producer asking L2 for the next pair's rows (cp.async.bulk.prefetch.L2)
before waiting for a slot (run 5, H100: 3.00-3.10 ms against 3.01-3.09; the in-order kernel and the dq pass slower), so
what 64K adds is not a latency that a prefetch hides; every other wave of programs taking its rows' slots in reverse,
so that a wave starts on the rows the one before read last (run 6, H200: 2.98-3.02 against 2.96-3.01); the ragged
last wave (4096 tokens on 132 SMs: 4 programs in a 32nd wave) cut into one-pair pieces launched apart and merged
(session 28, H200: 0.978-1.010x in three timings, the pieces' own launch 0.13-0.15 ms); one program an SM looping
over tokens with the producer loading the next token's q (session 29, H100: exact, 1.48x slower, the math inside a
loop over tokens); FlashMLA's L2 hints on the gathers by a PTX rewrite (session 29, H100: a 256-byte prefetch size
gained nothing measurable, any cache policy hit an illegal instruction on one check case).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernels.sparse_mla_gluon import (BLOCK_H, BLOCK_N, D_R, D_V, launch_forward, rows_to_shared,
                                      rows_to_shared_async)

HALF = D_V // 2  # value columns a warpgroup owns; also the left half of a KV row
# the register split (setmaxnreg): WG1's CONSUMER_REGS and the producer's PRODUCER_REGS are asked for, WG0 (the
# default partition) gets what is left of 64K / 384 threads: 504 - CONSUMER_REGS - PRODUCER_REGS
# 216 / 56 (warpgroup 0: 232) and 208 / 56 (240) compile without spills (bench/kernel_resources); 216 / 72 (216)
# spills 96 bytes in warpgroup 0's loop
# IO_EVICT: the L2 eviction policy of out's stores and (Q_ROWS 0) q's loads, which each program makes once ("":
# the default; "evict_first" asks L2 to drop those lines before the gathered KV rows). Triton 3.6 drops an eviction
# policy given to cp.async, so neither the gathers nor the producer's q copies can carry one.
# Q_ROWS: 0 loads q in the default partition before the producer starts; > 0 has the producer load it by cp.async
# (Q_ROWS rows a call) right after the first tile's left half, so that q's load and the first gathers overlap
# (H100, run 14: 32 rows 2.8% faster than 0 at 64K, 2.2% at 8K; 16 rows between; 32 and 16 compile without spills)
# IO_EVICT "evict_first" there: 8K 0.8% faster again, 64K 0.5% slower, within the rounds' spread: left off
# STAGE_OUT: out's stores through a free slot half in 16-byte row pieces (see _finish); not yet run on a GPU
SCHEDULE = dict(PRODUCER_WARPS=4, PRODUCER_REGS=56, CONSUMER_REGS=216, ROW_GROUP=32, IO_EVICT="", Q_ROWS=32,
                STAGE_OUT=False)
# the exchange barriers between the consumer warpgroups (each completes once a pair, or once at the end)
M0, M1, S0, S1, L0, L1 = (gl.constexpr(i) for i in range(6))
N_SYNC = gl.constexpr(6)


@gluon.jit
def _copy_rows(dst, kv_ptr, idx_row, n_idx, stride_kv, j0, col0, ROWS: gl.constexpr, WARPS: gl.constexpr):
    """cp.async dst [BLOCK_N, C] <- kv[idx[j0 + r], col0 : col0 + C] (16 bytes a thread a copy, ROWS rows a
    call; slots past n_idx and -1 slots read row 0, which the consumers mask)."""
    C: gl.constexpr = dst.shape[1]
    TPC: gl.constexpr = C // 8 if C // 8 < 32 else 32
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC], [WARPS, 1], [1, 0])
    c = col0 + gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    for g in gl.static_range(dst.shape[0] // ROWS):
        j = j0 + g * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        ids = gl.load(idx_row + j, mask=j < n_idx, other=-1)
        rows = kv_ptr + gl.where(ids >= 0, ids, 0).to(gl.int64) * stride_kv
        cp.async_copy_global_to_shared(dst.slice(g * ROWS, ROWS, dim=0), rows[:, None] + c[None, :])


@gluon.jit
def _gather_left0(j0, ph, kv_ptr, idx_row, n_idx, stride_kv, kv_l, full_l, empty_l, ROW_GROUP: gl.constexpr,
                  WARPS: gl.constexpr):
    """A pair's first gather: tile 2j's left half into slot 0 (key slots from j0), once warpgroup 0 is done with it."""
    mbarrier.wait(empty_l.index(0), ph)
    _copy_rows(kv_l.index(0), kv_ptr, idx_row, n_idx, stride_kv, j0, 0, ROW_GROUP, WARPS)
    cp.mbarrier_arrive(full_l.index(0), increment_count=False)


@gluon.jit
def _gather_rest(j0, ph, kv_ptr, idx_row, n_idx, stride_kv, kv_l, kv_r, kv_rope, full_l, full_r, empty_l, empty_r,
                 BLOCK_N: gl.constexpr, HALF: gl.constexpr, ROW_GROUP: gl.constexpr, WARPS: gl.constexpr):
    """The pair's other gathers, in the order the consumers hand the halves back: slot 1's right half (tile 2j + 1),
    slot 0's right, slot 1's left."""
    j1 = j0 + BLOCK_N
    mbarrier.wait(empty_r.index(1), ph)
    _copy_rows(kv_r.index(1), kv_ptr, idx_row, n_idx, stride_kv, j1, HALF, ROW_GROUP, WARPS)
    _copy_rows(kv_rope.index(1), kv_ptr, idx_row, n_idx, stride_kv, j1, 2 * HALF, BLOCK_N, WARPS)
    cp.mbarrier_arrive(full_r.index(1), increment_count=False)
    mbarrier.wait(empty_r.index(0), ph)
    _copy_rows(kv_r.index(0), kv_ptr, idx_row, n_idx, stride_kv, j0, HALF, ROW_GROUP, WARPS)
    _copy_rows(kv_rope.index(0), kv_ptr, idx_row, n_idx, stride_kv, j0, 2 * HALF, BLOCK_N, WARPS)
    cp.mbarrier_arrive(full_r.index(0), increment_count=False)
    mbarrier.wait(empty_l.index(1), ph)
    _copy_rows(kv_l.index(1), kv_ptr, idx_row, n_idx, stride_kv, j1, 0, ROW_GROUP, WARPS)
    cp.mbarrier_arrive(full_l.index(1), increment_count=False)


@gluon.jit
def _gather_pairs(kv_ptr, idx_row, n_idx, stride_kv, pairs, kv_l, kv_r, kv_rope, full_l, full_r, empty_l, empty_r,
                  q_row, stride_qh, h0, q_l, q_r, q_rope, q_full, HEADS: gl.constexpr, BLOCK_N: gl.constexpr,
                  HALF: gl.constexpr, ROW_GROUP: gl.constexpr, WARPS: gl.constexpr, Q_ROWS: gl.constexpr):
    """The producer: per pair, in the order the consumers hand the halves back, slot 0's left half (tile 2j),
    slot 1's right (2j + 1), slot 0's right, slot 1's left; each half's `full` barrier takes one arrival
    from every producer thread, as its copies land. Q_ROWS > 0: q too, by cp.async right after the first
    tile's left half (q_full as its barrier), outside the loop (whose registers it would otherwise take)."""
    first = 0
    if Q_ROWS > 0:
        _gather_left0(0, 1, kv_ptr, idx_row, n_idx, stride_kv, kv_l, full_l, empty_l, ROW_GROUP, WARPS)
        rows_to_shared_async(q_l.index(0), q_row, stride_qh, h0, HEADS, 0, Q_ROWS, WARPS)
        rows_to_shared_async(q_r.index(0), q_row, stride_qh, h0, HEADS, HALF, Q_ROWS, WARPS)
        rows_to_shared_async(q_rope.index(0), q_row, stride_qh, h0, HEADS, 2 * HALF, Q_ROWS, WARPS)
        cp.mbarrier_arrive(q_full, increment_count=False)
        _gather_rest(0, 1, kv_ptr, idx_row, n_idx, stride_kv, kv_l, kv_r, kv_rope, full_l, full_r, empty_l, empty_r,
                     BLOCK_N, HALF, ROW_GROUP, WARPS)
        first = 1
    for j in range(first, pairs):
        ph = (j & 1) ^ 1  # a fresh barrier counts as having completed the phase before its first
        _gather_left0(2 * j * BLOCK_N, ph, kv_ptr, idx_row, n_idx, stride_kv, kv_l, full_l, empty_l, ROW_GROUP, WARPS)
        _gather_rest(2 * j * BLOCK_N, ph, kv_ptr, idx_row, n_idx, stride_kv, kv_l, kv_r, kv_rope, full_l, full_r,
                     empty_l, empty_r, BLOCK_N, HALF, ROW_GROUP, WARPS)


@gluon.jit
def _qk_part(q_part, kv_part, full, phase, acc, use_acc: gl.constexpr):
    """acc (+)= q_part kv_part^T issued async once the producer's copies of the half are in. In the consumers'
    loops every shared-memory operand is indexed by a loop-variant 0 (z): at constant addresses the compiler
    hoists the 64-bit wgmma descriptors of all their k-steps out of the loop (36 for q alone), more registers
    than the consumers have (sparse_mla_bwd_gluon.py measured the same)."""
    mbarrier.wait(full, phase)
    fence_async_shared()  # the copies landed through the generic proxy; wgmma reads through the async one
    return warpgroup_mma(q_part, kv_part.permute((1, 0)), acc, use_acc=use_acc, is_async=True)


@gluon.jit
def _signal(bar):
    """One arrival on bar once every warp of the calling warpgroup is past this point."""
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _masked(s, idx_row, n_idx, j0, scale_log2, s_l: gl.constexpr):
    """A tile's scores in base 2, -inf where the slot is -1 or past n_idx."""
    j = j0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_l))
    ids = gl.load(idx_row + j, mask=j < n_idx, other=-1)
    return gl.where((ids >= 0)[None, :], s * scale_log2, float("-inf"))


@gluon.jit
def _finish(o, m, den, m_smem, den_smem, sync, mine: gl.constexpr, out_row, stride_oh, col0, h0, HEADS: gl.constexpr,
            lse_row, WRITE_LSE: gl.constexpr, o_l: gl.constexpr, EVICT: gl.constexpr, stage, STAGE_OUT: gl.constexpr):
    """Both warpgroups' row sums added through shared memory (barriers L0 / L1, which complete once); this
    warpgroup's half of out (and the lse). STAGE_OUT: out goes through `stage` (a [64, 256] slot half no one
    reads any more) and to global memory in 16-byte row pieces; else straight from the wgmma layout, where a
    warp's store covers 16 bytes of each of 8 rows (half of every 32-byte sector it touches)."""
    den_smem.slice(mine * den.shape[0], den.shape[0]).store(den)
    _signal(sync.index(L0 + mine))
    mbarrier.wait(sync.index(L0 + 1 - mine), 0)
    den = den + den_smem.slice((1 - mine) * den.shape[0], den.shape[0]).load(den.type.layout)
    den_safe = gl.where(den > 0, den, 1.0)
    out = (o / gl.convert_layout(den_safe, gl.SliceLayout(1, o_l))[:, None]).to(out_row.dtype.element_ty)
    if STAGE_OUT:
        stage.store(out)
        gl.thread_barrier()  # the warpgroup's rows all in place before any warp reads others'
        io_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        ho = h0 + gl.arange(0, o.shape[0], layout=gl.SliceLayout(1, io_l))
        co = col0 + gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, io_l))
        gl.store(out_row + ho[:, None] * stride_oh + co[None, :], stage.load(io_l), mask=(ho < HEADS)[:, None],
                 eviction_policy=EVICT)
    else:
        ho = h0 + gl.arange(0, o.shape[0], layout=gl.SliceLayout(1, o_l))
        co = col0 + gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, o_l))
        gl.store(out_row + ho[:, None] * stride_oh + co[None, :], out, mask=(ho < HEADS)[:, None],
                 eviction_policy=EVICT)
    if WRITE_LSE:
        lse = gl.where(den > 0, (m + gl.log2(den_safe)) / 1.4426950408889634, float("-inf"))
        hl = h0 + gl.arange(0, o.shape[0], layout=den.type.layout)
        gl.store(lse_row + hl, lse, mask=hl < HEADS)


# a consumer warpgroup's wgmma accumulators: S of a 64 x 64 tile, its half of O ([64, 256])
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]))
P_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2))  # own P, from registers


@gluon.jit
def _fresh(BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr):
    """A consumer's start: a zero S accumulator, the running max (-inf), the row sums and its half of O (0)."""
    m = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    return (gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT), m, gl.zeros_like(m),
            gl.zeros([BLOCK_H, HALF], gl.float32, O_LAYOUT))


@gluon.jit
def _first_scores(q_l, q_r, q_rope, kv_l, kv_r, kv_rope, full_l, full_r, zero_s):
    """Warpgroup 0's S of the first tile (slot 0), once its halves have landed (their barriers' first phase)."""
    s_tok = _qk_part(q_l.index(0), kv_l.index(0), full_l.index(0), 0, zero_s, False)
    s_tok = _qk_part(q_r.index(0), kv_r.index(0), full_r.index(0), 0, s_tok, True)
    s_tok = warpgroup_mma(q_rope.index(0), kv_rope.index(0).permute((1, 0)), s_tok, is_async=True)
    return warpgroup_mma_wait(0, deps=(s_tok, ))


@gluon.jit
def _even_pair(j, pairs, ph, s, m, den, o, zero_s, idx_row, n_idx, scale_log2, q_l, q_r, q_rope, kv_l, kv_r, kv_rope,
               p1_smem, m_smem, full_l, full_r, empty_l, sync, BLOCK_N: gl.constexpr):
    """Warpgroup 0's part of pair j (barrier phase ph) from tile 2j's S: the pair's softmax and both PVs into O's
    columns 0-255, and tile 2j + 2's S while the second runs. Returns (s, m, den, o)."""
    z = (j + n_idx) >> 30  # always 0 (n_idx < 2^30): see _qk_part
    x = _masked(s, idx_row, n_idx, 2 * j * BLOCK_N, scale_log2, S_LAYOUT)
    m0 = gl.maximum(m, gl.max(x, axis=1))
    m0_safe = gl.where(m0 == float("-inf"), 0.0, m0)  # rows with no valid key yet
    alpha = gl.exp2(m - m0_safe)
    p = gl.exp2(x - m0_safe[:, None])
    den = den * alpha + gl.sum(p, axis=1)
    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    m_smem.store(m0)
    _signal(sync.index(M0))
    o_tok = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_OPERAND), kv_l.index(z), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o_tok, ))
    _signal(empty_l.index(0))  # slot 0's left half: its QK^T and this PV are done
    mbarrier.wait(sync.index(M1), ph)
    m1 = m_smem.load(gl.SliceLayout(1, S_LAYOUT))  # max(m0, tile 2j + 1's): where the pair ends
    # P0 at m1 for warpgroup 1's half of the values (rows with no valid key have P0 = 0: any finite beta)
    beta = gl.where(m0 == float("-inf"), 1.0, gl.exp2(m0_safe - gl.where(m1 == float("-inf"), 0.0, m1)))
    kv_rope.index(z).store((p * beta[:, None]).to(gl.bfloat16))  # slot 0's rope columns: read by S0 only
    fence_async_shared()
    _signal(sync.index(S0))
    o = o * gl.convert_layout(beta, gl.SliceLayout(1, O_LAYOUT))[:, None]
    den = den * beta
    m = m1
    mbarrier.wait(sync.index(S1), ph)
    fence_async_shared()  # slot 1 landed by cp.async (generic proxy), waited for by warpgroup 1 only
    o_tok = warpgroup_mma(p1_smem.index(z), kv_l.index(1 + z), o, is_async=True)
    if j + 1 < pairs:  # tile 2j + 2's QK^T on slot 0's left half while this PV runs
        s_tok = _qk_part(q_l.index(z), kv_l.index(z), full_l.index(0), ph ^ 1, zero_s, False)
        o = warpgroup_mma_wait(1, deps=(o_tok, ))
        _signal(empty_l.index(1))
        s_tok = _qk_part(q_r.index(z), kv_r.index(z), full_r.index(0), ph ^ 1, s_tok, True)
        s_tok = warpgroup_mma(q_rope.index(z), kv_rope.index(z).permute((1, 0)), s_tok, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
    else:
        o = warpgroup_mma_wait(0, deps=(o_tok, ))
        _signal(empty_l.index(1))
    return s, m, den, o


@gluon.jit
def _odd_scores(j, ph, n_idx, zero_s, q_l, q_r, q_rope, kv_l, kv_r, kv_rope, full_l, full_r):
    """Warpgroup 1's S of tile 2j + 1 (slot 1), the right half first: the producer fills it before the left."""
    z = (j + n_idx) >> 30  # always 0: see _qk_part
    s_tok = _qk_part(q_r.index(z), kv_r.index(1 + z), full_r.index(1), ph, zero_s, False)
    s_tok = warpgroup_mma(q_rope.index(z), kv_rope.index(1 + z).permute((1, 0)), s_tok, is_async=True)
    s_tok = _qk_part(q_l.index(z), kv_l.index(1 + z), full_l.index(1), ph, s_tok, True)
    return warpgroup_mma_wait(0, deps=(s_tok, ))


@gluon.jit
def _odd_pair(j, ph, s, m, den, o, idx_row, n_idx, scale_log2, kv_r, kv_rope, p1_smem, m_smem, empty_r, sync,
              BLOCK_N: gl.constexpr):
    """Warpgroup 1's part of pair j (barrier phase ph) from tile 2j + 1's S: the pair's running max, its own P and
    warpgroup 0's into O's columns 256-511. Returns (m, den, o)."""
    z = (j + n_idx) >> 30  # always 0: see _qk_part
    x = _masked(s, idx_row, n_idx, (2 * j + 1) * BLOCK_N, scale_log2, S_LAYOUT)
    mbarrier.wait(sync.index(M0), ph)
    m1 = gl.maximum(m_smem.load(gl.SliceLayout(1, S_LAYOUT)), gl.max(x, axis=1))
    gl.thread_barrier()  # every thread has read m0 before any writes m1 over it
    m1_safe = gl.where(m1 == float("-inf"), 0.0, m1)
    alpha = gl.exp2(m - m1_safe)
    p = gl.exp2(x - m1_safe[:, None])
    den = den * alpha + gl.sum(p, axis=1)
    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    m = m1
    m_smem.store(m1)
    _signal(sync.index(M1))
    p_bf = p.to(gl.bfloat16)
    o_tok = warpgroup_mma(gl.convert_layout(p_bf, P_OPERAND), kv_r.index(1 + z), o, is_async=True)
    p1_smem.index(z).store(p_bf)
    fence_async_shared()
    _signal(sync.index(S1))
    mbarrier.wait(sync.index(S0), ph)
    fence_async_shared()  # slot 0's right half landed by cp.async, waited for by warpgroup 0 only
    o_tok = warpgroup_mma(kv_rope.index(z), kv_r.index(z), o_tok, is_async=True)  # P0, in slot 0's rope
    warpgroup_mma_wait(1, deps=(o_tok, ))  # the first PV done (its value is read below, after both)
    _signal(empty_r.index(1))  # slot 1's right half: this QK^T and the first PV are done
    o = warpgroup_mma_wait(0, deps=(o_tok, ))
    _signal(empty_r.index(0))  # slot 0's right half and P0
    return m, den, o


@gluon.jit
def _even_tiles(idx_row, n_idx, pairs, scale_log2, q_l, q_r, q_rope, kv_l, kv_r, kv_rope, p1_smem, m_smem, den_smem,
                full_l, full_r, empty_l, empty_r, sync, out_row, stride_oh, h0, lse_row, q_full, HEADS: gl.constexpr,
                BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, IO_EVICT: gl.constexpr,
                Q_ROWS: gl.constexpr, STAGE_OUT: gl.constexpr):
    """Warpgroup 0 (the default partition): tiles 2j, O's columns 0-255."""
    zero_s, m, den, o = _fresh(BLOCK_H, BLOCK_N, HALF)
    if Q_ROWS > 0:
        mbarrier.wait(q_full, 0)
    s = _first_scores(q_l, q_r, q_rope, kv_l, kv_r, kv_rope, full_l, full_r, zero_s)
    for j in range(pairs):
        s, m, den, o = _even_pair(j, pairs, j & 1, s, m, den, o, zero_s, idx_row, n_idx, scale_log2, q_l, q_r, q_rope,
                                  kv_l, kv_r, kv_rope, p1_smem, m_smem, full_l, full_r, empty_l, sync, BLOCK_N)
    # slot 0's left half: its last readers were this warpgroup's QK^T and PV, both waited for
    _finish(o, m, den, m_smem, den_smem, sync, 0, out_row, stride_oh, 0, h0, HEADS, lse_row, False, O_LAYOUT,
            IO_EVICT, kv_l.index(0), STAGE_OUT)


@gluon.jit
def _odd_tiles(idx_row, n_idx, pairs, scale_log2, q_l, q_r, q_rope, kv_l, kv_r, kv_rope, p1_smem, m_smem, den_smem,
               full_l, full_r, empty_l, empty_r, sync, out_row, stride_oh, h0, lse_row, q_full, HEADS: gl.constexpr,
               BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, IO_EVICT: gl.constexpr,
               Q_ROWS: gl.constexpr, STAGE_OUT: gl.constexpr):
    """Warpgroup 1 (a worker partition): tiles 2j + 1, O's columns 256-511, and the lse."""
    zero_s, m, den, o = _fresh(BLOCK_H, BLOCK_N, HALF)
    if Q_ROWS > 0:
        mbarrier.wait(q_full, 0)
    for j in range(pairs):
        s = _odd_scores(j, j & 1, n_idx, zero_s, q_l, q_r, q_rope, kv_l, kv_r, kv_rope, full_l, full_r)
        m, den, o = _odd_pair(j, j & 1, s, m, den, o, idx_row, n_idx, scale_log2, kv_r, kv_rope, p1_smem, m_smem,
                              empty_r, sync, BLOCK_N)
    # slot 1's right half: its last readers were this warpgroup's QK^T and PV, both waited for
    _finish(o, m, den, m_smem, den_smem, sync, 1, out_row, stride_oh, HALF, h0, HEADS, lse_row, True, O_LAYOUT,
            IO_EVICT, kv_r.index(1), STAGE_OUT)


@gluon.jit
def _buffers(dtype: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, D_R: gl.constexpr,
             PRODUCER_WARPS: gl.constexpr):
    """The kernel's shared memory: q in halves and rope columns, the two KV slots in halves with their barriers,
    warpgroup 1's P, the exchange vectors and barriers (q 72 KB + two 72 KB slots + P1 8 KB of the 227 KB)."""
    half_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF], gl.bfloat16)
    rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_R], gl.bfloat16)
    kvh_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.bfloat16)
    kvr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_R], gl.bfloat16)
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    q_l = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HALF], half_sl)  # [1, ...]: see _qk
    q_r = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HALF], half_sl)
    q_rope = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_R], rope_sl)
    kv_l = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], kvh_sl)
    kv_r = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], kvh_sl)
    kv_rope = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_R], kvr_sl)  # [BLOCK_H, BLOCK_N] P0 fits slot 0's
    p1_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, BLOCK_N], kvr_sl)
    m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_sl)
    den_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_sl)
    full_l = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    full_r = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    empty_l = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    empty_r = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    sync = gl.allocate_shared_memory(gl.int64, [N_SYNC, 1], bar_l)
    for s in gl.static_range(2):
        mbarrier.init(full_l.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(full_r.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(empty_l.index(s), count=1)
        mbarrier.init(empty_r.index(s), count=1)
    for b in gl.static_range(N_SYNC):
        mbarrier.init(sync.index(b), count=1)
    return (q_l, q_r, q_rope, kv_l, kv_r, kv_rope, p1_smem, m_smem, den_smem, full_l, full_r, empty_l, empty_r,
            sync)


@gluon.jit
def _sparse_mla_fwd_pair(q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, scale_log2, n_idx, stride_qt, stride_qh, stride_kv,
                         stride_it, stride_ot, stride_oh, stride_lt, HEADS: gl.constexpr, BLOCK_H: gl.constexpr,
                         BLOCK_N: gl.constexpr, HALF: gl.constexpr, D_R: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                         PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, ROW_GROUP: gl.constexpr,
                         IO_EVICT: gl.constexpr, Q_ROWS: gl.constexpr, STAGE_OUT: gl.constexpr):
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    (q_l, q_r, q_rope, kv_l, kv_r, kv_rope, p1_smem, m_smem, den_smem, full_l, full_r, empty_l, empty_r,
     sync) = _buffers(dtype, BLOCK_H, BLOCK_N, HALF, D_R, PRODUCER_WARPS)
    q_full = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_full.index(0), count=PRODUCER_WARPS * 32)
    q_row = q_ptr + t * stride_qt
    if Q_ROWS == 0:  # q by the default partition's loads, before the producer starts
        rows_to_shared(q_l.index(0), q_row, stride_qh, h0, HEADS, 0, 4, IO_EVICT)  # heads past HEADS as zeros
        rows_to_shared(q_r.index(0), q_row, stride_qh, h0, HEADS, HALF, 4, IO_EVICT)
        rows_to_shared(q_rope.index(0), q_row, stride_qh, h0, HEADS, 2 * HALF, 4, IO_EVICT)
    fence_async_shared()
    gl.thread_barrier()
    idx_row = idx_ptr + t * stride_it
    pairs = gl.cdiv(gl.cdiv(n_idx, BLOCK_N), 2)  # an odd last tile is paired with one of -1 slots
    out_row = out_ptr + t * stride_ot
    lse_row = lse_ptr + t * stride_lt
    gl.warp_specialize(  # the constexprs inline: a tuple held in a variable turns them into tensors
        [(_even_tiles, (idx_row, n_idx, pairs, scale_log2, q_l, q_r, q_rope, kv_l, kv_r, kv_rope, p1_smem, m_smem,
                        den_smem, full_l, full_r, empty_l, empty_r, sync, out_row, stride_oh, h0, lse_row,
                        q_full.index(0), HEADS, BLOCK_H, BLOCK_N, HALF, IO_EVICT, Q_ROWS, STAGE_OUT)),
         (_odd_tiles, (idx_row, n_idx, pairs, scale_log2, q_l, q_r, q_rope, kv_l, kv_r, kv_rope, p1_smem, m_smem,
                       den_smem, full_l, full_r, empty_l, empty_r, sync, out_row, stride_oh, h0, lse_row,
                       q_full.index(0), HEADS, BLOCK_H, BLOCK_N, HALF, IO_EVICT, Q_ROWS, STAGE_OUT)),
         (_gather_pairs, (kv_ptr, idx_row, n_idx, stride_kv, pairs, kv_l, kv_r, kv_rope, full_l, full_r, empty_l,
                          empty_r, q_row, stride_qh, h0, q_l, q_r, q_rope, q_full.index(0), HEADS, BLOCK_N, HALF,
                          ROW_GROUP, PRODUCER_WARPS, Q_ROWS))],
        [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def constexprs(**change) -> dict:
    """The kernel's compile-time constants besides HEADS (what a launch and bench/kernel_resources pass): SCHEDULE
    with `change`; an unknown name is a ValueError."""
    base = dict(BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, HALF=HALF, D_R=D_R, **SCHEDULE)
    unknown = set(change) - set(base)
    if unknown:
        raise ValueError(f"unknown Gluon paired sparse MLA constants {sorted(unknown)}; known: {sorted(base)}")
    return base | change


def sparse_mla_forward_pair(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sm_scale: float,
                            d_v: int = 512, **schedule) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_mla.sparse_mla_forward's outputs from this kernel (inputs as checked there)."""
    return launch_forward(_sparse_mla_fwd_pair, constexprs(**schedule), 4, q, kv, idx, sm_scale, d_v,
                          "paired Gluon sparse MLA forward")
