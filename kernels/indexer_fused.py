"""DSA indexer top-k that never writes a chunk's full score rows (``indexer_topk(..., impl="fused")``).

The default impl (kernels/indexer.py) writes each chunk's causal fp32 scores ([4096, 64K] = 1 GiB)
and re-reads them in the select: on the H200 that select reads at 10.5% of the copy rate at best.
Here, per chunk of rows:
  1. thresholds: scores of SAMPLES keys at a fixed stride (the chunk's longest row / SAMPLES),
     computed by the same q.k / relu / weight math, written to a small [rows, SAMPLES] buffer; per
     row, t = the largest key with >= 3k / (2 stride) + 4 samples at or above it (about 1.5 k keys of
     the row expected >= t, as kernels/topk_sample.py). Rows with <= CAP keys take t = 0 (all).
  2. scoring: the score tiles of the default kernel, but each tile writes only its survivors
     (causal, key >= t) as (ordered key, index) into the row's CAP-slot candidate buffer: a prefix
     sum inside the tile and one atomic_add per (row, tile) on the row's counter, which keeps
     counting past CAP so that an overflow is seen.
  3. select, one program per row: the exact radix select over the candidates. Their order depends
     on the scheduling, so ties at the k-th key go to the lowest indices by a bitwise search over
     the index (topk_common.finish_unordered_candidates), then the k indices are sorted.
  4. fallback: a row with fewer than k candidates (threshold too high) or more than CAP (ties) is
     flagged; after all chunks (one host sync) the flagged rows' scores are recomputed into a
     scratch of their own and selected by the default full select (topk.topk_rows_chunk).
Exactness: if >= k keys of a row have key >= t, the k-th largest key is >= t, so every selected
key (including all ties at the k-th) is a candidate, and the select over the candidates is the
select over the row; rows where that premise fails take the fallback. Whatever the sample, the
output equals the default's, given the same scores: the tile math here repeats
indexer._indexer_score_kernel's expressions in the same order (per head: dot, relu, times w,
accumulated in head order). Not yet timed on the GPU.
Memory per chunk: candidates rows x CAP x 8 bytes (256 MiB at 4096 x 8192) + samples rows x
SAMPLES x 4 (32 MiB) instead of rows x S x 4 (1 GiB at 64K).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._tuning import Autotuner, KernelConfig
from kernels.topk import _bucket, _radix_schedule, topk_rows_chunk
from kernels.topk_common import (emit_short_row, finish_unordered_candidates, ordered_key, select_in_registers,
                                  threshold_at_count)

# Sampled keys per row and candidate slots per row: the values kernels/topk_sample.py measured
# best with on the H200 (2048 / 8192). At 64K keys the stride is 32 and ~3,200 keys survive
# (1.5 k + 4 strides; sampling spread ~ +-10 strides), far from both fallback bounds.
SAMPLES = 2048
CAP = 8192
# Flagged rows closer than this are recomputed as one run (a non-flagged row in between is
# selected again, to the same result): fewer launches when many rows fall back.
FALLBACK_MERGE_GAP = 64
# Tile of the sampled-score kernel (its work is SAMPLES / S of the scoring: 3% at 64K).
SAMPLE_BLOCK_T, SAMPLE_BLOCK_S, SAMPLE_WARPS = 64, 64, 4

# The tile shapes of score_tile, for the default indexer's scoring kernel (indexer.py) and this
# one alike: the candidate writes add a row scan per tile, not a different tile.
SCORE_CONFIGS = [
    KernelConfig.make(BLOCK_T=64, BLOCK_S=128, num_warps=4, num_stages=3),
    KernelConfig.make(BLOCK_T=128, BLOCK_S=128, num_warps=8, num_stages=3),
    KernelConfig.make(BLOCK_T=128, BLOCK_S=64, num_warps=4, num_stages=4),
    KernelConfig.make(BLOCK_T=64, BLOCK_S=256, num_warps=8, num_stages=3),
]
FUSED_SCORE_CONFIGS = SCORE_CONFIGS
FUSED_SCORE_TUNER = Autotuner("indexer_fused_score", FUSED_SCORE_CONFIGS)
# The select over ~1.5 k candidates: topk_sample.py's two best shapes (2.46 / 2.34 ms there). The
# 8-bit one first: what the CPU interpreter runs, one radix pass fewer.
# REG: the candidates held in registers (topk_common.select_in_registers: count passes, no radix
# histograms, a sort of the k indices), 16 warps for the 8192-slot tile. H200, session 15, 4096 rows
# of 64K (with the 32-pass bitwise search): 0.99 ms against the radix shapes' 0.97 (8 bits) and 0.83 ms (7 bits): one program of 16
# warps per SM at a time (121 registers) is too few rows in flight; the tuner keeps the 7-bit one.
FUSED_SELECT_CONFIGS = [
    KernelConfig.make(BLOCK=1024, RADIX_BITS=8, num_warps=4, num_stages=1),
    KernelConfig.make(BLOCK=512, RADIX_BITS=7, num_warps=4, num_stages=1),
    KernelConfig.make(BLOCK=1024, RADIX_BITS=8, REG=1, num_warps=16, num_stages=1),
]
FUSED_SELECT_TUNER = Autotuner("indexer_fused_select", FUSED_SELECT_CONFIGS)


@triton.jit
def score_tile(q_ptr, w_ptr, kt, rows, row_ok, stride_qt, stride_qh, stride_wt,
                HEADS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    # one [BLOCK_T, BLOCK_S] tile of scores; indexer._indexer_score_kernel computes its tiles with
    # this same function, so the fused and the default impl see bit-identical scores by construction
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
    for h in range(HEADS):
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptr + rows * stride_wt + h, mask=row_ok, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(kt))
        acc += tl.maximum(s, 0.0) * w[:, None]
    return acc


@triton.jit
def _sample_score_kernel(q_ptr, k_ptr, w_ptr, samp_ptr, S, rows_in_chunk, row0, offset, key_stride,
                         stride_qt, stride_qh, stride_kt, stride_wt, stride_p,
                         HEADS: tl.constexpr, D: tl.constexpr, SAMPLES: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    pid_j = tl.program_id(0)
    pid_t = tl.program_id(1)
    local = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = row0 + local
    row_ok = local < rows_in_chunk
    last_pos = row0 + offset + tl.minimum((pid_t + 1) * BLOCK_T, rows_in_chunk) - 1
    if pid_j * BLOCK_S * key_stride <= last_pos:
        j = pid_j * BLOCK_S + tl.arange(0, BLOCK_S)
        cols = j * key_stride
        col_ok = (j < SAMPLES) & (cols < S)
        kt = tl.load(k_ptr + cols[:, None] * stride_kt + tl.arange(0, D)[None, :], mask=col_ok[:, None], other=0.0)
        acc = score_tile(q_ptr, w_ptr, kt, rows, row_ok, stride_qt, stride_qh, stride_wt, HEADS, D, BLOCK_T, BLOCK_S)
        causal = cols[None, :] <= (rows + offset)[:, None]
        tl.store(samp_ptr + local[:, None] * stride_p + j[None, :], acc,
                 mask=row_ok[:, None] & col_ok[None, :] & causal)


@triton.jit
def _threshold_kernel(samp_ptr, t_ptr, row0, offset, S, key_stride, stride_p,
                      K: tl.constexpr, SAMPLES: tl.constexpr, CAP: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    t = tl.zeros([], tl.uint32)  # rows with <= CAP keys: every key is a candidate
    if n > CAP:
        n_samp = tl.minimum((n - 1) // key_stride + 1, SAMPLES)  # samples at positions < n
        j = tl.arange(0, SAMPLES)
        ok = j < n_samp
        keys = ordered_key(tl.load(samp_ptr + r.to(tl.int64) * stride_p + j, mask=ok, other=0.0))
        t = threshold_at_count(keys, ok, (3 * K) // (2 * key_stride) + 4)
    tl.store(t_ptr + r, t)


@triton.jit
def _score_compact_kernel(q_ptr, k_ptr, w_ptr, t_ptr, cnt_ptr, ckey_ptr, cidx_ptr, S, rows_in_chunk, row0, offset,
                          stride_qt, stride_qh, stride_kt, stride_wt, stride_c,
                          HEADS: tl.constexpr, D: tl.constexpr, K: tl.constexpr, CAP: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    pid_s = tl.program_id(0)
    pid_t = tl.program_id(1)
    local = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = row0 + local
    row_ok = local < rows_in_chunk
    last_pos = row0 + offset + tl.minimum((pid_t + 1) * BLOCK_T, rows_in_chunk) - 1
    # skip tiles wholly in the causal future, and tiles whose rows all have <= K keys (taken whole)
    if (pid_s * BLOCK_S <= last_pos) & (tl.minimum(last_pos + 1, S) > K):
        cols = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        col_ok = cols < S
        kt = tl.load(k_ptr + cols[:, None] * stride_kt + tl.arange(0, D)[None, :], mask=col_ok[:, None], other=0.0)
        acc = score_tile(q_ptr, w_ptr, kt, rows, row_ok, stride_qt, stride_qh, stride_wt, HEADS, D, BLOCK_T, BLOCK_S)
        selecting = row_ok & (tl.minimum(rows + offset + 1, S) > K)
        t = tl.load(t_ptr + local, mask=selecting, other=0)
        key = ordered_key(acc)
        causal = cols[None, :] <= (rows + offset)[:, None]
        surv = selecting[:, None] & col_ok[None, :] & causal & (key >= t[:, None])
        surv_i = surv.to(tl.int32)
        count = tl.sum(surv_i, axis=1)
        base = tl.atomic_add(cnt_ptr + local, count, mask=count > 0, sem="relaxed")
        pos = base[:, None] + tl.cumsum(surv_i, axis=1) - 1
        keep = surv & (pos < CAP)
        slot = local[:, None] * stride_c + pos  # int32: the host checks rows * CAP < 2**31
        tl.store(ckey_ptr + slot, key, mask=keep)
        tl.store(cidx_ptr + slot, tl.broadcast_to(cols[None, :], [BLOCK_T, BLOCK_S]), mask=keep)


@triton.jit
def _select_kernel(out_ptr, cnt_ptr, ckey_ptr, cidx_ptr, flag_ptr, shift_ptr, dmask_ptr, row0, offset, S, idx_bits,
                   stride_o, stride_c, K: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                   RADIX_BITS: tl.constexpr, N_PASSES: tl.constexpr, REG: tl.constexpr, CAP_TILE: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    out_row = out_ptr + (row0 + r).to(tl.int64) * stride_o
    if n <= K:
        emit_short_row(out_row, n, K, BLOCK)
    else:
        n_cand = tl.load(cnt_ptr + r)
        if (n_cand >= K) & (n_cand <= CAP):
            if REG:  # the row's CAP slots in registers: no radix passes over memory
                j = tl.arange(0, CAP_TILE)  # CAP rounded up to a power of two
                ok = j < n_cand
                key = tl.load(ckey_ptr + r.to(tl.int64) * stride_c + j, mask=ok, other=0)
                idx = tl.load(cidx_ptr + r.to(tl.int64) * stride_c + j, mask=ok, other=0)
                select_in_registers(key, idx, ok, out_row, idx_bits, K, False, False)
            else:
                finish_unordered_candidates(out_row, ckey_ptr + r.to(tl.int64) * stride_c,
                                            cidx_ptr + r.to(tl.int64) * stride_c, n_cand, shift_ptr, dmask_ptr,
                                            idx_bits, K, N_PASSES, RADIX_BITS, BLOCK)
        else:
            tl.store(flag_ptr + row0 + r, 1)


@triton.jit
def _score_rows_kernel(q_ptr, k_ptr, w_ptr, out_ptr, S, rows_in_chunk, row0, offset,
                       stride_qt, stride_qh, stride_kt, stride_wt, stride_o,
                       HEADS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """The fallback's full causal scores of rows [row0, row0 + rows_in_chunk) (the default's layout)."""
    pid_s = tl.program_id(0)
    pid_t = tl.program_id(1)
    local = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = row0 + local
    row_ok = local < rows_in_chunk
    last_pos = row0 + offset + tl.minimum((pid_t + 1) * BLOCK_T, rows_in_chunk) - 1
    if pid_s * BLOCK_S <= last_pos:
        cols = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        col_ok = cols < S
        kt = tl.load(k_ptr + cols[:, None] * stride_kt + tl.arange(0, D)[None, :], mask=col_ok[:, None], other=0.0)
        acc = score_tile(q_ptr, w_ptr, kt, rows, row_ok, stride_qt, stride_qh, stride_wt, HEADS, D, BLOCK_T, BLOCK_S)
        causal = cols[None, :] <= (rows + offset)[:, None]
        tl.store(out_ptr + local[:, None] * stride_o + cols[None, :], acc,
                 mask=row_ok[:, None] & col_ok[None, :] & causal)


def merge_runs(rows: list[int], gap: int = FALLBACK_MERGE_GAP) -> list[tuple[int, int]]:
    """Sorted row ids -> half-open runs [a, b); ids closer than `gap` share a run."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and r - (runs[-1][1] - 1) < gap:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


class FusedIndexerTopk:
    """Buffers and the per-chunk phases of one fused indexer top-k (inputs checked by indexer_topk).

    The phases are methods so that the benchmark can time each one on a chunk."""

    def __init__(self, q, k, w, topk: int, offset: int, chunk_rows: int, samples: int = SAMPLES, cap: int = CAP):
        if samples < 1 or samples & (samples - 1):
            raise ValueError(f"samples must be a power of two >= 1, got {samples}")
        if cap < topk:
            raise ValueError(f"cap ({cap}) must be >= topk ({topk}): a row needs k candidates")
        self.q, self.k, self.w = q, k, w
        self.T, self.S = q.shape[0], k.shape[0]
        self.topk, self.offset, self.samples, self.cap = topk, offset, samples, cap
        self.chunk_rows = max(1, min(chunk_rows, self.T))
        if self.chunk_rows * cap >= 2**31:  # candidate slots are int32 offsets (fewer registers spilled)
            raise ValueError(f"chunk_rows * cap must be < 2**31, got {self.chunk_rows} * {cap}: lower chunk_rows")
        dev, rows = q.device, self.chunk_rows
        self.out = torch.empty((self.T, topk), device=dev, dtype=torch.int32)
        self.flags = torch.zeros((self.T,), device=dev, dtype=torch.int32)
        self.samp = torch.empty((rows, samples), device=dev, dtype=torch.float32)
        self.thresh = torch.empty((rows,), device=dev, dtype=torch.uint32)
        self.count = torch.empty((rows,), device=dev, dtype=torch.int32)
        self.ckey = torch.empty((rows, cap), device=dev, dtype=torch.uint32)
        self.cidx = torch.empty((rows, cap), device=dev, dtype=torch.int32)
        self.idx_bits = max(1, (self.S - 1).bit_length())
        self.fallback_rows = 0

    def chunks(self) -> list[tuple[int, int]]:
        """(row0, rows) per chunk, last first: its rows are the longest, so that is what gets tuned."""
        return [(r0, min(self.chunk_rows, self.T - r0)) for r0 in reversed(range(0, self.T, self.chunk_rows))]

    def _key_stride(self, row0: int, rows: int) -> int:
        n_last = min(row0 + rows + self.offset, self.S)
        return max(-(-n_last // self.samples), 1)

    def thresholds(self, row0: int, rows: int) -> None:
        q, k, w = self.q, self.k, self.w
        stride = self._key_stride(row0, rows)
        if min(row0 + rows + self.offset, self.S) > self.cap:  # else every row takes t = 0, no samples
            grid = (triton.cdiv(self.samples, SAMPLE_BLOCK_S), triton.cdiv(rows, SAMPLE_BLOCK_T))
            _sample_score_kernel[grid](
                q, k, w, self.samp, self.S, rows, row0, self.offset, stride, q.stride(0), q.stride(1), k.stride(0),
                w.stride(0), self.samp.stride(0), HEADS=q.shape[1], D=q.shape[2], SAMPLES=self.samples,
                BLOCK_T=SAMPLE_BLOCK_T, BLOCK_S=SAMPLE_BLOCK_S, num_warps=SAMPLE_WARPS, num_stages=2)
        _threshold_kernel[(rows,)](self.samp, self.thresh, row0, self.offset, self.S, stride, self.samp.stride(0),
                                   K=self.topk, SAMPLES=self.samples, CAP=self.cap, num_warps=4, num_stages=1)

    def candidates(self, row0: int, rows: int) -> None:
        q, k, w = self.q, self.k, self.w

        def launch(cfg: KernelConfig) -> None:  # resets the counters: re-running it is harmless
            bt, bs = cfg["BLOCK_T"], cfg["BLOCK_S"]
            self.count.zero_()
            _score_compact_kernel[(triton.cdiv(self.S, bs), triton.cdiv(rows, bt))](
                q, k, w, self.thresh, self.count, self.ckey, self.cidx, self.S, rows, row0, self.offset,
                q.stride(0), q.stride(1), k.stride(0), w.stride(0), self.ckey.stride(0),
                HEADS=q.shape[1], D=q.shape[2], K=self.topk, CAP=self.cap, BLOCK_T=bt, BLOCK_S=bs,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)

        key = (_bucket(rows), _bucket(self.S), q.shape[1], q.shape[2], q.dtype, self.topk)
        launch(FUSED_SCORE_TUNER.choose(key, q.device, launch))

    def select(self, row0: int, rows: int) -> None:
        def launch(cfg: KernelConfig) -> None:
            shifts, masks = _radix_schedule(cfg["RADIX_BITS"], self.q.device)
            _select_kernel[(rows,)](
                self.out, self.count, self.ckey, self.cidx, self.flags, shifts, masks, row0, self.offset, self.S,
                self.idx_bits, self.out.stride(0), self.ckey.stride(0), K=self.topk, CAP=self.cap,
                BLOCK=cfg["BLOCK"], RADIX_BITS=cfg["RADIX_BITS"], N_PASSES=shifts.numel(),
                REG=bool(dict(cfg.params).get("REG", 0)), CAP_TILE=triton.next_power_of_2(self.cap),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)

        key = (_bucket(rows), _bucket(self.S), self.topk, self.cap)
        launch(FUSED_SELECT_TUNER.choose(key, self.q.device, launch))

    def fallback(self) -> None:
        """Recompute the flagged rows' scores and select them with the default full select (one sync)."""
        flagged = torch.nonzero(self.flags).flatten().tolist()
        self.fallback_rows = len(flagged)
        runs = merge_runs(flagged)
        if not runs:
            return
        q, k, w = self.q, self.k, self.w
        span = min(self.chunk_rows, max(b - a for a, b in runs))
        scratch = torch.empty((span, self.S), device=q.device, dtype=torch.float32)
        bt, bs = FUSED_SCORE_CONFIGS[0]["BLOCK_T"], FUSED_SCORE_CONFIGS[0]["BLOCK_S"]
        for a, b in runs:
            for r0 in range(a, b, span):
                rows = min(span, b - r0)
                _score_rows_kernel[(triton.cdiv(self.S, bs), triton.cdiv(rows, bt))](
                    q, k, w, scratch, self.S, rows, r0, self.offset, q.stride(0), q.stride(1), k.stride(0),
                    w.stride(0), scratch.stride(0), HEADS=q.shape[1], D=q.shape[2], BLOCK_T=bt, BLOCK_S=bs,
                    num_warps=FUSED_SCORE_CONFIGS[0].num_warps, num_stages=FUSED_SCORE_CONFIGS[0].num_stages)
                topk_rows_chunk(scratch, r0, rows, self.offset, self.S, self.topk, self.out)

    def run(self) -> torch.Tensor:
        for row0, rows in self.chunks():
            self.thresholds(row0, rows)
            self.candidates(row0, rows)
            self.select(row0, rows)
        self.fallback()
        return self.out


def indexer_topk_fused(q, k, w, topk: int, offset: int, chunk_rows: int = 4096, *, samples: int = SAMPLES,
                       cap: int = CAP, stats: dict | None = None) -> torch.Tensor:
    """indexer.indexer_topk's result without writing the score rows (q, k, w contiguous and checked
    there). ``stats``, when given, receives the number of rows that took the exact fallback."""
    job = FusedIndexerTopk(q, k, w, topk, offset, chunk_rows, samples=samples, cap=cap)
    out = job.run()
    if stats is not None:
        stats["fallback_rows"] = job.fallback_rows
    return out
