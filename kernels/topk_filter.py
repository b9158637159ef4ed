"""Filter-then-select exact top-k of causal score rows (the FILTER variant of kernels/topk.py).

Why two kernels. The sampled variant (topk_sample.py) already reads each row once, but it does the
compaction and the select in one program, so the select's footprint (a 2048-wide sort, radix
histograms: 80-122 registers a thread) sets the occupancy of the streaming part, and each 512-key
block is loaded, scanned and stored before the next load is issued: about 2 KB in flight per
program, a latency-bound 0.5 TB/s on the H200 (11% of the copy rate). Here:
  1. filter, one lean program per row: a threshold t from SAMPLES sampled keys (runs of RUN
     neighbouring keys, so that a sample costs a 32-byte sector and not one per key; SPLIT_T: by a
     kernel of their own), then one pipelined pass over the row (num_stages > 1: the next blocks'
     loads are in flight while one block is scanned) that appends every score >= t (a float
     compare: the threshold is turned back into its float once) to the row's candidate lists, the
     raw fp32 score and its int32 index in two arrays, in index order, and stores the count (it
     keeps counting past CAP). The appends go through topk_common.scatter_b32 on CUDA: through
     tl.store, the prefix sum that places them ran in a one-key-per-thread layout and the filter
     took 0.83 ms against 0.59 (H200, 4096 x 64K rows; the loads alone 0.26 ms).
  2. select, one program per row, everything in registers: the CAP-slot candidate lists (or the row
     itself when it has <= CAP keys), the k-th largest key by kth_key (a search cut by a tail model,
     then a rank of the last few keys), ties at it to the lowest indices (the candidates are in
     index order) and the k indices written ascending, both by one prefix sum of two packed
     counts: no sort, no scratch reread.
Exact whatever the sample: if >= k keys of a row are >= t, its k-th key is >= t, so every key the
full select would take (ties included) is a candidate. A row with fewer than k candidates (t too
high) or more than CAP (t too low) is filtered once more (_refilter_kernel, between the two: its
samples searched again with their count scaled by what the row showed); a row that misses again
(heavy ties) is finished by the full radix select over the row (topk_common.emit_full), in the
refilter kernel when it is given the output (topk_rows_filtered does: then the select reads no
scores of a chunk whose rows all pass CAP, and may run on a stream of its own, SelectPipeline), else
in the select kernel. The refilter is what lets the threshold come from 2048 samples (0.06% of a 64K
context's rows refiltered): a row's full select costs ~0.16 ms, alone at the end of the kernel.
Since session 19 the filter takes two blocks a step (PAIR: one prefix sum and one sum of packed
counts place both; the longest 64K chunk 0.705 ms against 0.798, H100, run 18).
The float compare keeps a superset of the keys >= t (-0.0 and +0.0 compare equal; NaN scores are
kept by `x != x`), which is all exactness needs: the select orders the candidates by ordered_key.
Row reads: one, plus SAMPLES / RUN sectors for the threshold; candidates: ~1.5 k x 8 bytes written
and read back.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.topk_common import (emit_full, emit_short_row, key_to_float, ordered_key, sampled_threshold,
                                 scatter_b32, select_in_registers)


class Candidates(NamedTuple):
    """What the filter leaves for the select: per row, up to CAP scores and their indices in index
    order, how many keys passed the threshold (past CAP when they overflowed), and which path the
    row took (int32: 0 the first threshold's candidates, 1 the refilter's, 2 the full select, by the
    refilter given the output, else by the select; the select writes it for the rows the filter
    skips)."""
    scores: torch.Tensor
    indices: torch.Tensor
    counts: torch.Tensor
    paths: torch.Tensor


@triton.jit
def _threshold_kernel(score_ptr, t_ptr, row0, offset, S, stride_s, K: tl.constexpr, SAMPLES: tl.constexpr,
                      RUN: tl.constexpr, CAP: tl.constexpr, AIM: tl.constexpr):
    """SPLIT_T: each filtered row's threshold, by a kernel of its own (the samples' registers then do
    not bound the streaming kernel's occupancy: 95 registers with 4096 samples in it, 56 without)."""
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    if n > CAP:
        tl.store(t_ptr + r, sampled_threshold(score_ptr + r.to(tl.int64) * stride_s, n, K, SAMPLES, RUN, AIM / 1.5))


@triton.jit
def _filter_kernel(score_ptr, ckey_ptr, cidx_ptr, count_ptr, path_ptr, t_ptr, row0, offset, S, stride_s, stride_c,
                   K: tl.constexpr, BLOCK: tl.constexpr, SAMPLES: tl.constexpr, RUN: tl.constexpr,
                   CAP: tl.constexpr, STAGES: tl.constexpr, SPLIT_T: tl.constexpr, ASM_STORE: tl.constexpr,
                   AIM: tl.constexpr, PAIR: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    if n > CAP:  # shorter rows are selected straight from the scores
        row = score_ptr + r.to(tl.int64) * stride_s
        if SPLIT_T:
            t = tl.load(t_ptr + r)
        else:
            t = sampled_threshold(row, n, K, SAMPLES, RUN, AIM / 1.5)
            tl.store(t_ptr + r, t)  # for the refilter
        n_cand = filter_row(row, n, key_to_float(t), ckey_ptr + r.to(tl.int64) * stride_c,
                            cidx_ptr + r.to(tl.int64) * stride_c, BLOCK, CAP, STAGES, ASM_STORE, PAIR)
        tl.store(count_ptr + r, n_cand)
        tl.store(path_ptr + r, 0)


# The candidates the sampled thresholds aim at, in percent of k (config key AIM_PCT). Runs 16-17 (H200):
# 125-140 were within the noise at 64K and 1.7-1.9x slower at 128K (more rows refiltered).
AIM_PCT = 150
REFILTER_TRIES: tl.constexpr = tl.constexpr(2)  # run 15: one try left 2 of 725 refiltered rows (1024 samples)


@triton.jit
def _refilter_kernel(score_ptr, ckey_ptr, cidx_ptr, count_ptr, path_ptr, t_ptr, out_ptr, shift_ptr, dmask_ptr, row0,
                     offset, S, stride_s, stride_c, stride_o, K: tl.constexpr, BLOCK: tl.constexpr,
                     SAMPLES: tl.constexpr, RUN: tl.constexpr, CAP: tl.constexpr, STAGES: tl.constexpr,
                     ASM_STORE: tl.constexpr, AIM: tl.constexpr, PAIR: tl.constexpr, FULL: tl.constexpr,
                     RADIX_BITS: tl.constexpr, N_PASSES: tl.constexpr):
    """A row whose candidates missed [K, CAP] is filtered again, at a threshold from the same samples
    with their count scaled by what the row showed (up to REFILTER_TRIES times); the other rows return
    at once. FULL: a row that still misses gets its k indices here, by the full radix select over its
    scores (path 2), so that the select reads no scores of rows longer than CAP (it may then run on a
    stream of its own while the scores are overwritten: topk_rows_filtered's pipeline). A kernel of
    its own: inside the filter it took 64 -> 96 registers a thread (sm_90, 1024 samples), inside the
    select 159 -> 168 and the select 7% longer (0.204 against 0.190 ms, H100, run 14)."""
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    if n > CAP:
        n_cand = tl.load(count_ptr + r)
        if (n_cand < K) | (n_cand > CAP):
            row = score_ptr + r.to(tl.int64) * stride_s
            t = tl.load(t_ptr + r)
            scale = tl.full([], AIM / 1.5, tl.float32)
            for _ in tl.static_range(REFILTER_TRIES):
                if (n_cand < K) | (n_cand > CAP):
                    scale = scale * (AIM * K) / tl.maximum(n_cand, 1).to(tl.float32)
                    t2 = sampled_threshold(row, n, K, SAMPLES, RUN, scale)
                    # t2 == 0: the scaled need passed the samples (keep every key: more than CAP of
                    # them), a pass that cannot land; the row goes to the full radix select
                    if (t2 != 0) & (((n_cand < K) & (t2 < t)) | ((n_cand > CAP) & (t2 > t))):
                        n_cand = filter_row(row, n, key_to_float(t2), ckey_ptr + r.to(tl.int64) * stride_c,
                                            cidx_ptr + r.to(tl.int64) * stride_c, BLOCK, CAP, STAGES, ASM_STORE,
                                            PAIR)
                        t = t2
                        tl.store(count_ptr + r, n_cand)
                        tl.store(path_ptr + r, 1)
            if FULL:
                if (n_cand < K) | (n_cand > CAP):
                    zero = tl.zeros([], tl.uint32)
                    emit_full(row, out_ptr + (row0 + r).to(tl.int64) * stride_o, n, zero, zero,
                              tl.full([], K, tl.int32), shift_ptr, dmask_ptr, 0, N_PASSES, RADIX_BITS, 1024)
                    tl.store(path_ptr + r, 2)


@triton.jit
def filter_row(row, n, t_f, ckey_row, cidx_row, BLOCK: tl.constexpr, CAP: tl.constexpr, STAGES: tl.constexpr,
               ASM_STORE: tl.constexpr, PAIR: tl.constexpr):
    """Append every score >= t_f of the row's n (NaN kept), and its index, to the candidate lists in
    index order; the count, which keeps counting past CAP. PAIR: two blocks a step, placed by one
    prefix sum and one sum (_append_pair) instead of two of each."""
    n_cand = tl.zeros([], tl.int32)
    STEP: tl.constexpr = 2 * BLOCK if PAIR else BLOCK
    n_full = (n // STEP) * STEP
    # whole steps unmasked (16-byte loads), pipelined; then the row's tail, masked
    for start in tl.range(0, n_full, STEP, num_stages=STAGES):
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(row + idx)
        if PAIR:
            x2 = tl.load(row + idx + BLOCK)
            n_cand = _append_pair(ckey_row, cidx_row, n_cand, x, x2, idx, _passes(x, t_f), _passes(x2, t_f),
                                  BLOCK, CAP, ASM_STORE)
        else:
            n_cand = _append_hits(ckey_row, cidx_row, n_cand, x, idx, _passes(x, t_f), CAP, ASM_STORE)
    idx = n_full + tl.arange(0, BLOCK)
    ok = idx < n
    x = tl.load(row + idx, mask=ok, other=0.0)
    if PAIR:
        ok2 = idx + BLOCK < n
        x2 = tl.load(row + idx + BLOCK, mask=ok2, other=0.0)
        return _append_pair(ckey_row, cidx_row, n_cand, x, x2, idx, ok & _passes(x, t_f), ok2 & _passes(x2, t_f),
                            BLOCK, CAP, ASM_STORE)
    return _append_hits(ckey_row, cidx_row, n_cand, x, idx, ok & _passes(x, t_f), CAP, ASM_STORE)


@triton.jit
def _passes(x, t_f):
    """The scores a filter at t_f keeps: those >= t_f, and NaNs (which compare false)."""
    return (x >= t_f) | (x != x)


@triton.jit
def _store_hits(ckey_row, cidx_row, x, idx, pos, keep, ASM_STORE: tl.constexpr):
    if ASM_STORE:
        scatter_b32(ckey_row + pos, x.to(tl.int32, bitcast=True), keep)
        scatter_b32(cidx_row + pos, idx, keep)
    else:
        tl.store(ckey_row + pos, x, mask=keep)
        tl.store(cidx_row + pos, idx, mask=keep)


@triton.jit
def _append_hits(ckey_row, cidx_row, n_cand, x, idx, hit, CAP: tl.constexpr, ASM_STORE: tl.constexpr):
    """Append the hits' scores and indices after the row's n_cand candidates; the new count."""
    hit_i = hit.to(tl.int32)
    pos = n_cand + tl.cumsum(hit_i, axis=0) - 1
    _store_hits(ckey_row, cidx_row, x, idx, pos, hit & (pos < CAP), ASM_STORE)
    return n_cand + tl.sum(hit_i, axis=0)


@triton.jit
def _append_pair(ckey_row, cidx_row, n_cand, x, x2, idx, hit, hit2, BLOCK: tl.constexpr, CAP: tl.constexpr,
                 ASM_STORE: tl.constexpr):
    """_append_hits for two consecutive blocks (x at idx, x2 at idx + BLOCK): their hit counts packed
    in the halves of an int32 (a block has < 65536 keys), so one prefix sum and one sum place both."""
    packed = hit.to(tl.int32) + (hit2.to(tl.int32) << 16)
    run = tl.cumsum(packed, axis=0)
    both = tl.sum(packed, axis=0)
    first = both & 0xFFFF
    pos = n_cand + (run & 0xFFFF) - 1
    _store_hits(ckey_row, cidx_row, x, idx, pos, hit & (pos < CAP), ASM_STORE)
    pos2 = n_cand + first + (run >> 16) - 1
    _store_hits(ckey_row, cidx_row, x2, idx + BLOCK, pos2, hit2 & (pos2 < CAP), ASM_STORE)
    return n_cand + first + (both >> 16)


@triton.jit
def _select_kernel(score_ptr, ckey_ptr, cidx_ptr, count_ptr, out_ptr, path_ptr, shift_ptr, dmask_ptr, row0, offset,
                   S, stride_s, stride_c, stride_o, K: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                   RADIX_BITS: tl.constexpr, N_PASSES: tl.constexpr, ASM_STORE: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    row = score_ptr + r.to(tl.int64) * stride_s
    out_row = out_ptr + (row0 + r).to(tl.int64) * stride_o
    if n <= K:
        emit_short_row(out_row, n, K, BLOCK)
        tl.store(path_ptr + r, 0)
    else:
        j = tl.arange(0, CAP)
        if n <= CAP:  # every key of the row is a candidate, in index order
            count = n
            ok = j < n
            key = ordered_key(tl.load(row + j, mask=ok, other=0.0))
            idx = j
            tl.store(path_ptr + r, 0)
        else:
            count = tl.load(count_ptr + r)
            ok = j < count
            key = ordered_key(tl.load(ckey_ptr + r.to(tl.int64) * stride_c + j, mask=ok, other=0.0))
            idx = tl.load(cidx_ptr + r.to(tl.int64) * stride_c + j, mask=ok, other=0)
        if (count >= K) & (count <= CAP):
            select_in_registers(key, idx, ok, out_row, 0, K, True, ASM_STORE)
        elif tl.load(path_ptr + r) != 2:  # (2: the refilter wrote the row) the sampled thresholds
            # missed (or heavy ties): the full radix select over the row
            zero = tl.zeros([], tl.uint32)
            emit_full(row, out_row, n, zero, zero, tl.full([], K, tl.int32), shift_ptr, dmask_ptr,
                      0, N_PASSES, RADIX_BITS, BLOCK)
            tl.store(path_ptr + r, 2)


def asm_stores(t: torch.Tensor) -> bool:
    """Whether the kernels' scattered stores go through inline PTX (topk_common.scatter_b32): on a CUDA
    tensor, not under TRITON_INTERPRET=1 (the interpreter runs no PTX)."""
    return t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"


def row_thresholds(scores, row0, rows, offset, S, topk, *, samples, run, cap, warps=4, aim=AIM_PCT / 100):
    """SPLIT_T's first kernel: each row's sampled threshold (uint32 ordered key; unset for rows of <= CAP keys).
    4 warps a row: 1, 2, 8 or 16 were slower (H100, 4096 x 64K rows: bench/results/topk_filter_gpu.json
    run 8; the search's cost follows its keys, not its reductions' barriers)."""
    thresh = torch.empty((rows,), device=scores.device, dtype=torch.uint32)
    _threshold_kernel[(rows,)](scores, thresh, row0, offset, S, scores.stride(0), K=topk, SAMPLES=samples,
                               RUN=run, CAP=cap, AIM=float(aim), num_warps=warps, num_stages=1)
    return thresh


def new_candidates(rows, cap, device) -> Candidates:
    """Unset candidate lists for `rows` rows (no memset: the filter writes counts and paths of the rows it
    reads, and the select reads no more)."""
    return Candidates(torch.empty((rows, cap), device=device, dtype=torch.float32),
                      torch.empty((rows, cap), device=device, dtype=torch.int32),
                      torch.empty((rows,), device=device, dtype=torch.int32),
                      torch.empty((rows,), device=device, dtype=torch.int32))


class SelectPipeline:
    """The selects of a run of chunks on a stream of their own, each beside the next chunk's work (CUDA).

    Two sets of candidate lists, taken in turn: a chunk's filter writes one only after the select that
    last read it is done (the current stream waits on that select's event; the host never waits). With
    new lists per chunk instead, each freed only once its select finished, the host, which runs ahead
    of the GPU, would hold a chunk's lists (128 MiB at 4096 rows) for every chunk it queued. The caller
    makes its stream wait for ``stream`` (``join``) before it reads the selects' output."""

    def __init__(self, stream):
        self.stream = stream
        self._slots: list = [None, None]  # (Candidates, the event after the select that read it)
        self._turn = 0

    def acquire(self, rows, cap, device) -> Candidates:
        slot = self._slots[self._turn]
        if slot is not None and slot[1] is not None:
            torch.cuda.current_stream(device).wait_event(slot[1])
        if slot is None or slot[0].scores.shape[0] < rows or slot[0].scores.shape[1] != cap:
            self._slots[self._turn] = slot = (new_candidates(rows, cap, device), None)  # (the old: waited for)
        return slot[0]

    def release(self) -> None:
        """After the select of the lists acquire() gave is queued on ``stream``."""
        self._slots[self._turn] = (self._slots[self._turn][0], self.stream.record_event())
        self._turn ^= 1

    def join(self, device) -> None:
        torch.cuda.current_stream(device).wait_stream(self.stream)


def filter_rows(scores, row0, rows, offset, S, topk, *, samples, run, block, cap, warps, stages, split_t=False,
                asm_store=None, thresh=None, t_warps=4, refilter=True, aim=AIM_PCT / 100, pair=False, finish=None,
                buffers=None):
    """Phase 1: the rows' candidates, Candidates(scores [rows, CAP] fp32, indices [rows, CAP] int32,
    counts [rows] int32: the keys >= t, past CAP when they overflowed; unset for rows with <= CAP
    keys, which the select reads from the scores; paths [rows]). ``split_t``: the thresholds by a kernel of
    their own first (row_thresholds; or ``thresh``, given). ``refilter``: a row whose candidates
    missed [topk, CAP] is filtered once more by _refilter_kernel (else the select's full radix select
    takes it: one such row of 61440 cost 0.16 ms, the whole 64K context's 8.92 against 8.76, H100 run 13).
    ``asm_store`` (default: asm_stores(scores)) picks the candidates' store path (benchmarks compare both).
    ``aim``: how many candidates the thresholds aim at, in multiples of topk (fewer: less to write and
    select, more rows refiltered). ``pair``: the filter takes two blocks a step (filter_row's PAIR).
    ``finish`` (out, shifts, masks, radix_bits): the refilter writes the k indices of a row that still
    misses into out[row0 + r] (the full radix select; path 2), so the select reads no scores of rows
    longer than CAP; without it the select does. ``buffers``: a Candidates of at least ``rows`` rows
    and CAP columns to write into (SelectPipeline's), else new ones."""
    if cap < topk or cap & (cap - 1):
        raise ValueError(f"CAP ({cap}) must be a power of two >= topk ({topk})")
    if samples % run or samples & (samples - 1):
        raise ValueError(f"SAMPLES ({samples}) must be a power of two and a multiple of RUN ({run})")
    if buffers is None:
        buffers = new_candidates(rows, cap, scores.device)
    ckey, cidx, count, paths = (t[:rows] for t in buffers)
    if split_t and thresh is None:
        thresh = row_thresholds(scores, row0, rows, offset, S, topk, samples=samples, run=run, cap=cap,
                                warps=t_warps, aim=aim)
    if not split_t:
        thresh = torch.empty((rows,), device=scores.device, dtype=torch.uint32)  # written by the filter
    asm = asm_stores(scores) if asm_store is None else asm_store
    args = (scores, ckey, cidx, count, paths, thresh, row0, offset, S, scores.stride(0), ckey.stride(0))
    _filter_kernel[(rows,)](*args, K=topk, BLOCK=block, SAMPLES=samples, RUN=run, CAP=cap, STAGES=stages,
                            SPLIT_T=bool(split_t), ASM_STORE=asm, AIM=float(aim), PAIR=bool(pair), num_warps=warps,
                            num_stages=stages)
    if refilter:
        out, shifts, masks, radix_bits = finish or (paths, paths, paths, 8)  # (unread without FULL)
        _refilter_kernel[(rows,)](scores, ckey, cidx, count, paths, thresh, out, shifts, masks, row0, offset, S,
                                  scores.stride(0), ckey.stride(0), out.stride(0), K=topk, BLOCK=block,
                                  SAMPLES=samples, RUN=run, CAP=cap, STAGES=stages, ASM_STORE=asm, AIM=float(aim),
                                  PAIR=bool(pair), FULL=finish is not None, RADIX_BITS=radix_bits,
                                  N_PASSES=shifts.numel() if finish else 1, num_warps=warps, num_stages=stages)
    return Candidates(ckey, cidx, count, paths)


def select_rows(scores, cand, row0, rows, offset, S, topk, out, shifts, masks, *, radix_bits, warps, asm_store=None):
    """Phase 2: the exact top-k of each row from its Candidates (or its scores) into out[row0 + r];
    completes cand.paths."""
    _select_kernel[(rows,)](scores, cand.scores, cand.indices, cand.counts, out, cand.paths, shifts, masks, row0,
                            offset, S, scores.stride(0), cand.scores.stride(0), out.stride(0), K=topk,
                            CAP=cand.scores.shape[1], BLOCK=1024, RADIX_BITS=radix_bits, N_PASSES=shifts.numel(),
                            ASM_STORE=asm_stores(scores) if asm_store is None else asm_store,
                            num_warps=warps, num_stages=1)


def topk_rows_filtered(scores, row0, rows, offset, S, topk, out, shifts, masks, *, samples, run, block, cap,
                       radix_bits, filter_warps, filter_stages, select_warps, split_t=False, t_warps=4, refilter=True,
                       aim=AIM_PCT / 100, pair=False, pipeline=None):
    """Same contract as topk.topk_rows_chunk: filter_rows, then select_rows.

    ``pipeline`` (a SelectPipeline, CUDA): the select runs on its stream, after what the current stream
    has queued, when it reads no scores (every row of the chunk longer than CAP, the refilter on: it
    finishes the rows that miss), so the caller may overwrite ``scores`` at once; it must join the
    pipeline before it reads ``out``. The select (latency-bound, ~0.2 ms a chunk of 4096 rows) then
    runs beside the next chunk's work: the whole 64K top-k 6.81 ms against 7.05 (H200, run 16)."""
    piped = pipeline is not None and refilter and min(row0 + offset + 1, S) > cap
    kw = dict(samples=samples, run=run, block=block, cap=cap, warps=filter_warps, stages=filter_stages,
              split_t=split_t, t_warps=t_warps, refilter=refilter, aim=aim, pair=pair,
              finish=(out, shifts, masks, radix_bits))
    if not piped:
        cand = filter_rows(scores, row0, rows, offset, S, topk, **kw)
        select_rows(scores, cand, row0, rows, offset, S, topk, out, shifts, masks, radix_bits=radix_bits,
                    warps=select_warps)
        return
    cand = filter_rows(scores, row0, rows, offset, S, topk, **kw, buffers=pipeline.acquire(rows, cap, scores.device))
    pipeline.stream.wait_stream(torch.cuda.current_stream(scores.device))
    with torch.cuda.stream(pipeline.stream):
        select_rows(scores, cand, row0, rows, offset, S, topk, out, shifts, masks, radix_bits=radix_bits,
                    warps=select_warps)
    pipeline.release()
