"""The split backward's dkv pass in Gluon (sm_90): loads, GEMMs and scatter-adds in separate warps.

Same contract as sparse_mla_bwd_split.py's `_dkv_from_dsp_kernel`: dkv[idx[t, j]] += dS[t, :, j]^T q[t] +
P[t, :, j]^T dO[t] (value columns) and dS^T q_rope (rope columns) over every token t and slot j, from the
bf16 dS / P scratch [tokens, heads, topk] the dq pass wrote, with fp32 reductions (a key picked twice or by
many tokens is added once per pick; -1 slots add nothing). For bf16, 512 + 64 columns and 64 heads.

What bounds the pass (H100, one 2048-token chunk of 4096 x top-2048 of 64K; bench/results/
tma_reduce_probe_gpu.json and dkv_pass_ws_gpu.json): its 9.7 GB of fp32 reductions go at ~3 TB/s when the
programs running at once add into a part of dkv that L2 (50 MB) holds, and at 1.3 TB/s when they add into
all of it (151 MB). Each chunk also streams dS / P through L2 once per program that needs a token's row,
which costs the reductions their lines. So a program owns whole dkv rows (the 8 value blocks and the rope
block, one launch: dS / P read once, 1.07 GB a chunk) but only a band of keys: its token's slots whose keys
fall in band b, found by a search in the token's ascending idx row, with the bands slowest in the grid and
the tokens fastest, so that the programs running at once add into 64K / 5 keys x 576 columns = 30 MB.
Session 22's layout (groups of 128 value columns, no bands: 33.5 MB at once, but dS / P read 5 times, 4.8
GB) took 5.09-5.14 ms; the banded whole rows 3.98-4.01 (dkv_pass_ws_gpu.json runs 10-12). Per program:
- loader warps load each 64-key tile of the token's dS and P rows ([64 heads, 64 keys]) through registers
  with an L2 evict-first policy (cp.async takes none in Gluon 3.6), tile i + 1's loads in flight while tile
  i goes into the ring (`dsp_full`);
- the GEMM warpgroup computes, per tile and 64-column block, acc [64 keys, 64] = dS^T q[:, block] (+ P^T
  dO[:, block]) with dS^T / P^T as the transposed A operand straight from shared memory, block c + 1's
  GEMMs issued before block c's tile goes into a ring of fp32 tiles (`acc_full`);
- reducer warps read each fp32 tile in 16-byte rows and issue its reductions (inline `red` with an L2
  evict-last policy: tl.atomic_add takes none) into the keys of the band, handing the slot back (a named
  barrier) as soon as the tile is in their registers.
Measured against the Triton pass in one process (dkv_pass_ws_gpu.json run 11, H100): 3.98 ms against 5.63
(1.41x), exact to 5e-7 of 3.07; the whole backward 13.47 ms, 219 TFLOP/s (16.64 with the Triton pass).
Alone, the GEMM side takes 1.9 ms; with no dS / P copies (wrong, a probe) the pass takes 3.6.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernels.sparse_mla_gluon import D_R, D_V

HEADS = 64  # the GEMMs' K: a program holds all of a token's heads
BLOCK_N = 64  # keys a tile: the GEMMs' M
COLS = 64  # dkv columns a GEMM (N): D_V // COLS value blocks and one rope block (D_R == COLS)
GEMM_WARPS = gl.constexpr(4)  # the default partition (the launch's num_warps): one warpgroup
# H100 (dkv_pass_ws_gpu.json runs 11-12, against 4.01 ms): 4 / 6 / 7 / 10 bands 4.39 / 4.02 / 4.16 / 4.62; the
# rope columns in a launch of their own 4.29; 8 reducer or loader warps 4.86, 2 loader warps 6.20; EVICT ""
# 4.29; RED_POLICY "" 4.29; a 3-slot acc ring 4.01 (3-slot rings of both do not fit beside whole rows); no
# bands, 2 value blocks a group (session 22) 5.13. QDO_EVICT: the token's q / dO columns (139 KB a program,
# loaded again by each band's program: 1.4 GB a chunk) by cp.async ("") or through registers with that L2
# policy. PROBE bits make the result wrong and time a part: 1 no reductions, 2 no GEMMs, 4 no dS / P copies.
SCHEDULE = dict(VALUE_BLOCKS=8, KEY_BANDS=0, ROPE_WITH_VALUES=True, STAGES=2, ACC_STAGES=2, REDUCER_WARPS=4,
                LOADER_WARPS=4, REDUCER_REGS=128, LOADER_REGS=128, EVICT="evict_first", RED_POLICY="evict_last",
                QDO_EVICT="", PROBE=0)


# The acc ring's `empty` signals are named barriers, not mbarriers: an mbarrier arrive is a CTA-scope
# release, and a release between 64 x 64 tiles of reductions took them from 2.84 to 1.82 TB/s on an H100
# (bench/results/tma_reduce_probe_gpu.json, `sync` 2) where a block barrier cost nothing (`sync` 1). In
# the pass as it was then (whole rows a program, 7.0 ms, bound by L2) the switch measured no change
# (dkv_pass_ws_gpu.json run 3); it was not measured again at 5.3 ms.
# Triton's warp specialisation uses ids 0-2; the ring's slots take the ids from 15 down.
LAST_BARRIER_ID = gl.constexpr(15)
# Key bands: the dkv rows split into bands of keys, the band slowest in the grid, so that a program may own
# whole rows (dS / P read once) while the programs running at once still add into no more dkv than L2 holds
# well: 33.5 MB measured at 3.0 ms of reductions, 151 MB at 7.5 (H100, tma_reduce_probe_gpu.json); with whole
# rows at 64K keys that is 5 bands (30 MB; 4 bands, 38 MB: 4.39 ms against 4.01). KEY_BANDS 0: key_bands's.
BAND_BYTES = 34 << 20


@gluon.jit
def _named_barrier(bar_id, n_threads, SYNC: gl.constexpr, WARPS: gl.constexpr):
    """bar.sync (SYNC: wait until n_threads have arrived or synced) or bar.arrive (go on) on barrier bar_id,
    by every thread of the calling partition (WARPS warps)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    ids = gl.full([32 * WARPS], bar_id, gl.int32, layout)  # one element a thread: the asm runs once in each
    count = gl.full([32 * WARPS], n_threads, gl.int32, layout)
    if SYNC:
        gl.inline_asm_elementwise("bar.sync $1, $2; mov.u32 $0, 0;", "=r,r,r", [ids, count], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.arrive $1, $2; mov.u32 $0, 0;", "=r,r,r", [ids, count], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _tile_offsets(i, i_end, n_idx, h, kk, PROBE: gl.constexpr):
    """Tile i's element offsets in a token's [heads, topk] scratch rows, and which exist (none from tile
    i_end on: a whole tile's mask, so that the loads stay 16 bytes wide)."""
    k = i * kk.shape[0] + kk
    ok = (k < n_idx)[None, :] & (h >= 0)[:, None] & ((PROBE & 4) == 0) & (i < i_end)  # probe 4: no copies
    return h[:, None] * n_idx + k[None, :], ok


@gluon.jit
def _load_tiles(ds_row, p_row, n_idx, i0, n_tiles, ds_ring, p_ring, dsp_full, dsp_empty, HEADS: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WITH_P: gl.constexpr, EVICT: gl.constexpr,
                WARPS: gl.constexpr, PROBE: gl.constexpr):
    """Each tile's [HEADS, BLOCK_N] dS (and P) rows into the ring (keys past n_idx as zeros), through registers
    with L2 eviction policy EVICT ("evict_first": read once a program, they then leave the dkv rows in L2;
    cp.async takes no policy in Gluon 3.6 and measured 6.03 ms against 5.31), tile i + 1's loads in flight
    while tile i is stored."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_N // 8), BLOCK_N // 8], [WARPS, 1], [1, 0])
    h = gl.arange(0, HEADS, layout=gl.SliceLayout(1, layout))
    kk = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    off, ok = _tile_offsets(i0, i0 + n_tiles, n_idx, h, kk, PROBE)
    ds_next = gl.load(ds_row + off, mask=ok, other=0.0, eviction_policy=EVICT)
    p_next = gl.load(p_row + off, mask=ok & WITH_P, other=0.0, eviction_policy=EVICT)
    for i in range(n_tiles):
        ds_x, p_x = ds_next, p_next
        off, ok = _tile_offsets(i0 + i + 1, i0 + n_tiles, n_idx, h, kk, PROBE)  # past the last tile: nothing
        ds_next = gl.load(ds_row + off, mask=ok, other=0.0, eviction_policy=EVICT)
        p_next = gl.load(p_row + off, mask=ok & WITH_P, other=0.0, eviction_policy=EVICT)
        s = i % STAGES
        mbarrier.wait(dsp_empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes the first round
        ds_ring.index(s).store(ds_x)
        if WITH_P:
            p_ring.index(s).store(p_x)
        gl.thread_barrier()  # every loader thread's part in place
        mbarrier.arrive(dsp_full.index(s), count=1)


@gluon.jit
def _issue(c: gl.constexpr, ds_t, p_t, q_blk, do_blk, zero, P_BLOCKS: gl.constexpr):
    """Column block c's GEMMs, asynchronously: dS^T q_c (+ P^T dO_c for the first P_BLOCKS blocks)."""
    tok = warpgroup_mma(ds_t, q_blk.index(c), zero, use_acc=False, is_async=True)
    if c < P_BLOCKS:
        tok = warpgroup_mma(p_t, do_blk.index(c), tok, is_async=True)
    return tok


@gluon.jit
def _put(acc, g, acc_ring, acc_full, ACC_STAGES: gl.constexpr, N_THREADS: gl.constexpr):
    """The g-th fp32 tile into its acc ring slot, once the reducers have emptied it (from the second round:
    named barrier LAST_BARRIER_ID - slot, N_THREADS the GEMM and reducer threads)."""
    a = g % ACC_STAGES
    if g >= ACC_STAGES:
        _named_barrier(LAST_BARRIER_ID - a, N_THREADS, True, GEMM_WARPS)
    acc_ring.index(a).store(acc)
    gl.thread_barrier()  # the whole tile in place before the reducers are told
    mbarrier.arrive(acc_full.index(a), count=1)


@gluon.jit
def _gemms(n_tiles, q_blk, do_blk, ds_ring, p_ring, acc_ring, dsp_full, dsp_empty, acc_full,
           BLOCK_N: gl.constexpr, COLS: gl.constexpr, NBLK: gl.constexpr, STAGES: gl.constexpr,
           ACC_STAGES: gl.constexpr, N_THREADS: gl.constexpr, P_BLOCKS: gl.constexpr, PROBE: gl.constexpr):
    """Per tile and column block: acc = dS^T q_block (+ P^T dO_block) into the acc ring, block c + 1's GEMMs
    issued before block c's tile is stored."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[GEMM_WARPS, 1],
                                                    instr_shape=[16, COLS, 16])
    zero = gl.zeros([BLOCK_N, COLS], gl.float32, acc_l)
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(dsp_full.index(s), (i // STAGES) & 1)
        fence_async_shared()  # the copies landed through the generic proxy; wgmma reads through the async one
        ds_t = ds_ring.index(s).permute((1, 0))
        p_t = p_ring.index(s).permute((1, 0))
        if (PROBE & 2) != 0:  # no GEMMs (a probe of the reductions' rate)
            for c in gl.static_range(NBLK):
                _put(zero, i * NBLK + c, acc_ring, acc_full, ACC_STAGES, N_THREADS)
        else:
            prev = _issue(0, ds_t, p_t, q_blk, do_blk, zero, P_BLOCKS)
            for c in gl.static_range(1, NBLK):
                tok = _issue(c, ds_t, p_t, q_blk, do_blk, zero, P_BLOCKS)
                acc = warpgroup_mma_wait(2 if c < P_BLOCKS else 1, deps=(prev, ))  # block c's groups may run on
                _put(acc, i * NBLK + c - 1, acc_ring, acc_full, ACC_STAGES, N_THREADS)
                prev = tok
            _put(warpgroup_mma_wait(0, deps=(prev, )), i * NBLK + NBLK - 1, acc_ring, acc_full, ACC_STAGES, N_THREADS)
        mbarrier.arrive(dsp_empty.index(s), count=1)  # every wgmma that read the slot has been waited for


@gluon.jit
def _red_add_evict_last(ptrs, vals, live):
    """ptrs[...] += vals where live, as 16-byte `red` with an L2 evict-last policy (tl.atomic_add takes no
    cache policy): 4 consecutive fp32 a thread, the first one's address 16-byte aligned."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b64 pol; setp.ne.s32 p, $12, 0; "
        "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
        "@p red.relaxed.gpu.global.add.L2::cache_hint.v4.f32 [$4], {$8, $9, $10, $11}, pol; "
        "mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0; }",
        "=r,=r,=r,=r,l,l,l,l,r,r,r,r,r,r,r,r",
        [ptrs.to(gl.int64), vals.to(gl.int32, bitcast=True), live.to(gl.int32)],  # ints: the asm broadcasts them
        dtype=gl.int32, is_pure=False, pack=4)


@gluon.jit
def _reduce(idx_row, n_idx, i0, n_tiles, start, end, dkv_ptr, stride_dkv, col0, acc_ring, acc_full,
            BLOCK_N: gl.constexpr, COLS: gl.constexpr, NBLK: gl.constexpr, ACC_STAGES: gl.constexpr, N_THREADS: gl.constexpr,
            WARPS: gl.constexpr, RED_POLICY: gl.constexpr, PROBE: gl.constexpr):
    """Each fp32 tile of the acc ring into its keys' dkv rows, 16-byte reductions: the tiles i0 .. i0 + n_tiles
    of the token's slots, the keys of slots start .. end only (the program's band)."""
    red_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (COLS // 4), COLS // 4], [WARPS, 1], [1, 0])
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, red_l))
    cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, red_l))
    for i in range(n_tiles):
        j = (i0 + i) * BLOCK_N + keys
        ids = gl.load(idx_row + j, mask=j < n_idx, other=-1)
        rows = dkv_ptr + gl.where(ids >= 0, ids, 0).to(gl.int64) * stride_dkv
        live = ((ids >= 0) & (j >= start) & (j < end))[:, None] & (cols >= 0)[None, :]
        for c in gl.static_range(NBLK):
            g = i * NBLK + c
            a = g % ACC_STAGES
            mbarrier.wait(acc_full.index(a), (g // ACC_STAGES) & 1)
            vals = acc_ring.index(a).load(red_l)
            if g < n_tiles * NBLK - ACC_STAGES:  # the slot's next round (the GEMMs wait from round 2)
                _named_barrier(LAST_BARRIER_ID - a, N_THREADS, False, WARPS)
            if (PROBE & 1) == 0:  # probe 1: no reductions (the GEMMs' rate)
                if RED_POLICY == "evict_last":
                    _red_add_evict_last(rows[:, None] + (c * COLS + cols)[None, :], vals, live)
                else:
                    gl.atomic_add(rows[:, None] + (c * COLS + cols)[None, :], vals, mask=live, sem="relaxed")


@gluon.jit
def _columns_to_shared(smem, base, stride_row, col0, EVICT: gl.constexpr):
    """smem [rows, COLS] = base's rows, columns col0 .. col0 + COLS: by cp.async (EVICT "": the caller waits),
    else through registers with that L2 policy (cp.async takes none in Gluon 3.6)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (smem.shape[1] // 8), smem.shape[1] // 8],
                                            [gl.num_warps(), 1], [1, 0])
    r = gl.arange(0, smem.shape[0], layout=gl.SliceLayout(1, layout))
    c = col0 + gl.arange(0, smem.shape[1], layout=gl.SliceLayout(0, layout))
    if EVICT == "":
        cp.async_copy_global_to_shared(smem, base + r[:, None] * stride_row + c[None, :])
    else:
        smem.store(gl.load(base + r[:, None] * stride_row + c[None, :], eviction_policy=EVICT))


@gluon.jit
def dkv_pass_kernel(q_ptr, do_ptr, idx_ptr, ds_ptr, p_ptr, dkv_ptr, n_idx, stride_qt, stride_qh, stride_dot,
                    stride_doh, stride_it, stride_st, stride_dkv, col_base, seg_ptr, stride_seg,
                    BANDED: gl.constexpr, HEADS: gl.constexpr, BLOCK_N: gl.constexpr, COLS: gl.constexpr,
                    NBLK: gl.constexpr, P_BLOCKS: gl.constexpr,
                    STAGES: gl.constexpr, ACC_STAGES: gl.constexpr, REDUCER_WARPS: gl.constexpr,
                    LOADER_WARPS: gl.constexpr, REDUCER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                    EVICT: gl.constexpr, RED_POLICY: gl.constexpr, QDO_EVICT: gl.constexpr, PROBE: gl.constexpr):
    """Program (token, group, band): dkv columns col_base + group * NBLK * COLS on, NBLK blocks of COLS (the
    first P_BLOCKS value columns, dS^T q + P^T dO; the others dS^T q: rope columns), from the token's slots
    seg[t, band] .. seg[t, band + 1] (BANDED; else all of them)."""
    gl.static_assert(ACC_STAGES <= LAST_BARRIER_ID - 2, "a named barrier a slot, above Triton's")
    N_THREADS: gl.constexpr = 32 * (GEMM_WARPS + REDUCER_WARPS)  # the GEMM warpgroup and the reducers
    t = gl.program_id(0).to(gl.int64)
    col0 = col_base + gl.program_id(1) * (NBLK * COLS)
    if BANDED:
        start = gl.load(seg_ptr + t * stride_seg + gl.program_id(2))
        end = gl.load(seg_ptr + t * stride_seg + gl.program_id(2) + 1)
    else:
        start = 0
        end = n_idx
    i0 = start // BLOCK_N
    n_tiles = gl.cdiv(end, BLOCK_N) - i0
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    blk_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, COLS], gl.bfloat16)
    tile_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, BLOCK_N], gl.bfloat16)
    acc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, COLS], gl.float32)
    q_blk = gl.allocate_shared_memory(dtype, [NBLK, HEADS, COLS], blk_sl)
    WITH_P: gl.constexpr = P_BLOCKS > 0
    do_blk = gl.allocate_shared_memory(dtype, [P_BLOCKS if WITH_P else 1, HEADS, COLS], blk_sl)
    ds_ring = gl.allocate_shared_memory(dtype, [STAGES, HEADS, BLOCK_N], tile_sl)
    p_ring = gl.allocate_shared_memory(dtype, [STAGES if WITH_P else 1, HEADS, BLOCK_N], tile_sl)
    acc_ring = gl.allocate_shared_memory(gl.float32, [ACC_STAGES, BLOCK_N, COLS], acc_sl)
    dsp_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dsp_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    acc_full = gl.allocate_shared_memory(gl.int64, [ACC_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(dsp_full.index(s), count=1)
        mbarrier.init(dsp_empty.index(s), count=1)
    for a in gl.static_range(ACC_STAGES):
        mbarrier.init(acc_full.index(a), count=1)
    for c in gl.static_range(NBLK):
        _columns_to_shared(q_blk.index(c), q_ptr + t * stride_qt, stride_qh, col0 + c * COLS, QDO_EVICT)
        if c < P_BLOCKS:
            _columns_to_shared(do_blk.index(c), do_ptr + t * stride_dot, stride_doh, col0 + c * COLS, QDO_EVICT)
    cp.commit_group()
    cp.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize(
        [(_gemms, (n_tiles, q_blk, do_blk, ds_ring, p_ring, acc_ring, dsp_full, dsp_empty, acc_full, BLOCK_N, COLS,
                   NBLK, STAGES, ACC_STAGES, N_THREADS, P_BLOCKS, PROBE)),
         (_reduce, (idx_ptr + t * stride_it, n_idx, i0, n_tiles, start, end, dkv_ptr, stride_dkv, col0, acc_ring,
                    acc_full, BLOCK_N, COLS, NBLK, ACC_STAGES, N_THREADS, REDUCER_WARPS, RED_POLICY, PROBE)),
         (_load_tiles, (ds_ptr + t * stride_st, p_ptr + t * stride_st, n_idx, i0, n_tiles, ds_ring, p_ring, dsp_full,
                        dsp_empty, HEADS, BLOCK_N, STAGES, WITH_P, EVICT, LOADER_WARPS, PROBE))],
        [REDUCER_WARPS, LOADER_WARPS], [REDUCER_REGS, LOADER_REGS])


def key_bands(n_keys: int, cols: int) -> int:
    """Bands of keys a launch of `cols` columns a program splits the dkv rows into, so that the programs running
    at once (tokens fastest, bands slowest in the grid) add into at most BAND_BYTES of dkv."""
    return max(1, -(-n_keys * cols * 4 // BAND_BYTES))


def _launches(schedule: dict) -> list[tuple[bool, int]]:
    """(value launch?, first column) of each launch: the rope columns' own unless ROPE_WITH_VALUES."""
    return [(True, 0)] + ([] if (SCHEDULE | schedule)["ROPE_WITH_VALUES"] else [(False, D_V)])


def _bands(n_keys: int, with_p: bool, schedule: dict) -> int:
    """The bands of a launch: KEY_BANDS for the value launch where it is set, else key_bands over its width."""
    fixed = (SCHEDULE | schedule)["KEY_BANDS"]
    if with_p and fixed:
        return fixed
    return key_bands(n_keys, constexprs(with_p, False, **schedule)["NBLK"] * COLS)


def needs_sorted_rows(n_keys: int, **schedule) -> bool:
    """Whether dkv_pass over n_keys dkv rows splits them into bands, which needs each idx row ascending (-1
    slots first): split_backward sorts the rows before its dq pass when it does."""
    return any(_bands(n_keys, with_p, schedule) > 1 for with_p, _ in _launches(schedule))


def constexprs(with_p: bool = True, banded: bool | None = None, **change) -> dict:
    """The kernel's compile-time constants for the value launch (with_p) or the rope one (what a launch and
    bench/kernel_resources pass); banded: whether its programs take a band of slots (None: KEY_BANDS > 1);
    change: the schedule variants a probe times."""
    unknown = set(change) - set(SCHEDULE)
    if unknown:
        raise ValueError(f"unknown Gluon dkv pass schedule keys {sorted(unknown)}; known: {sorted(SCHEDULE)}")
    sch = SCHEDULE | change
    value_blocks = sch.pop("VALUE_BLOCKS")
    bands = sch.pop("KEY_BANDS")
    rope_too = sch.pop("ROPE_WITH_VALUES")
    if rope_too and value_blocks * COLS != D_V:
        raise ValueError(f"ROPE_WITH_VALUES needs one group of all value columns: VALUE_BLOCKS={D_V // COLS}, "
                         f"got {value_blocks}")
    p_blocks = value_blocks if with_p else 0
    nblk = p_blocks + (D_R // COLS if rope_too or not with_p else 0)
    banded = bands > 1 if banded is None else banded
    return dict(BANDED=banded, HEADS=HEADS, BLOCK_N=BLOCK_N, COLS=COLS, NBLK=nblk, P_BLOCKS=p_blocks, **sch)


def _launch(args: tuple, n: int, col_base: int, bands: int, idx: torch.Tensor, n_keys: int, with_p: bool,
            schedule: dict) -> None:
    cx = constexprs(with_p, bands > 1, **schedule)
    seg = idx  # unread unless banded
    if bands > 1:  # slots of band b: seg[t, b] .. seg[t, b + 1] (rows ascending)
        per = -(-n_keys // bands)
        edges = torch.arange(0, bands + 1, device=idx.device, dtype=idx.dtype) * per
        seg = torch.searchsorted(idx, edges.expand(n, bands + 1).contiguous(), out_int32=True)
    groups = D_V // (cx["P_BLOCKS"] * COLS) if with_p else 1
    dkv_pass_kernel[(n, groups, bands)](*args, col_base, seg, seg.stride(0), **cx, num_warps=GEMM_WARPS.value)


def dkv_pass(q: torch.Tensor, grad_out: torch.Tensor, idx: torch.Tensor, ds: torch.Tensor, p: torch.Tensor,
             dkv: torch.Tensor, **schedule) -> None:
    """dkv += the dkv pass over q's tokens (64 heads) from their dS / P scratch rows [tokens, heads, topk]
    (contiguous inputs, as split_backward passes them; n_idx >= 1): the value columns in groups of
    VALUE_BLOCKS x COLS, then the rope columns (or with the values: ROPE_WITH_VALUES), each launch's programs
    over bands of dkv rows where needs_sorted_rows (then idx's rows must be ascending, -1 slots first)."""
    n, n_keys = q.shape[0], dkv.shape[0]
    args = (q, grad_out, idx, ds, p, dkv, idx.shape[1], q.stride(0), q.stride(1), grad_out.stride(0),
            grad_out.stride(1), idx.stride(0), ds.stride(0), dkv.stride(0))
    for with_p, col_base in _launches(schedule):
        _launch(args, n, col_base, _bands(n_keys, with_p, schedule), idx, n_keys, with_p, schedule)
