"""Exact per-row top-k of causal score rows (radix select), for the DSA indexer.

Scores are fp32; each is mapped to a uint32 key with the same order. One program per row finds
the k-th largest key digit by digit (histogram of RADIX_BITS bits per pass over the keys that
match the prefix so far), then emits every key above it plus the lowest-index keys equal to it
(deterministic ties). Output per row: min(k, n) indices in ascending order, then -1.

Two variants (the autotuner picks; both exact):
- full (COMPACT=0): every pass reads the whole row (ceil(32 / RADIX_BITS) + 1 row reads).
- compact (COMPACT=1): after FULL_PASSES passes over the row, one more pass writes the keys
  already known to be selected straight to the output and copies the few keys that share the
  k-th key's prefix (at most CAP; else it falls back to the full variant) to a scratch buffer;
  the remaining digits are resolved on that buffer, then the k indices are sorted in place.
  Row reads: FULL_PASSES + 1 instead of ~6.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels._tuning import Autotuner, KernelConfig
from kernels.topk_common import emit_full, emit_short_row, finish_candidates, ordered_key, radix_pass
from kernels.topk_filter import AIM_PCT

# H200, 4096 rows of a 64K context. Full variant: 7 bits / 512 / 4 warps 4.4-4.6 ms, 6 bits 4.6 ms,
# 8 bits 6.1 ms, 4 bits 6.4 ms, 11 bits 33.7 ms (tl.histogram cost grows with the bins).
# Compact, 7 bits x 2 full passes, CAP 8192: 3.5 ms (5.96 vs 8.86 ms on 128K rows).
# The first config is the reference the benchmarks compare with, and what the CPU interpreter runs.
TOPK_CONFIGS = [
    KernelConfig.make(BLOCK=1024, RADIX_BITS=8, COMPACT=0, num_warps=4, num_stages=1),
    # sampled threshold (kernels/topk_sample.py): one compaction read of the row, then an exact select
    # over the survivors. H200, the 4096 longest rows of 64K (bench indexer_topk_variants, 2026-12-01):
    # 2.34 ms (7 bits, BLOCK 512) against the compact variant's 3.33 ms; 10.5% of the copy rate.
    KernelConfig.make(SAMPLES=2048, BLOCK=512, RADIX_BITS=7, CAP=8192, num_warps=4, num_stages=1),
    # filter then select (kernels/topk_filter.py): thresholds from 4096 sampled keys (a kernel of their
    # own, SPLIT_T: the streaming kernel then needs 56 registers, not 95), a lean pipelined filter
    # program per row, then the exact select in registers. The 4096 longest rows of 64K on the H200
    # (bench/results/topk_filter_gpu.json run 4): filter 0.59 + select 0.25 = 0.84 ms (29% of the copy
    # rate; the loads alone take 0.26 ms) against the sampled select's 2.18 ms; over the whole 64K
    # context 10.2 ms against 24.3. BLOCK 512 / 2048, 2 warps: 0.61-0.71 ms (filter). Session 17 (runs 10-12):
    # both searches cut by a tail model (topk_common.search_bracket): whole 64K context 8.45 ms against
    # 8.62 with thirds only, same H200; the rows in parts, each part's select on a second stream beside
    # the next part's filter, lost (1 / 2 / 4 / 8 parts: 0.77 / 0.81 / 1.05 / 2.01 ms) and was removed.
    # Session 18 (runs 13-15): a row whose candidates miss [k, CAP] is refiltered (topk_filter's
    # _refilter_kernel) instead of taking the full radix select (0.16 ms a row), so fewer samples do:
    # few enough to sit in the filter again (64 registers). Whole 64K context on an H100 (run 15):
    # 2048 samples 7.40 ms (0.06% of the rows refiltered), 1024 7.85 (1.1%; two missed again), this
    # config's earlier 4096 samples in a kernel of their own 8.66. Session 19 (runs 16-18): the filter
    # takes two blocks a step (PAIR: one prefix sum and one sum place both), the select runs on a
    # stream of its own (topk_filter.topk_rows_filtered). The tuner on an H100 (run 18), the longest
    # chunk: 64K 0.705 ms paired against 0.798 unpaired, 128K 1.106 against 1.152, 32K 0.439 (BLOCK
    # 512 paired) against 0.454; the whole 64K top-k 7.04 ms against run 15's 8.04 on an H100.
    KernelConfig.make(FILTER=1, SPLIT_T=0, SAMPLES=2048, RUN=8, BLOCK=1024, CAP=4096, RADIX_BITS=8, PAIR=1,
                      SELECT_WARPS=4, num_warps=4, num_stages=3),
    KernelConfig.make(FILTER=1, SPLIT_T=0, SAMPLES=2048, RUN=8, BLOCK=512, CAP=4096, RADIX_BITS=8, PAIR=1,
                      SELECT_WARPS=4, num_warps=4, num_stages=3),
]
# Exact, CPU-interpreter tested, not in the default list (each costs a compile and a timing per tuning
# key): the full and compact radix shapes and the sampled 8-bit one, which the sampled threshold beat
# (2.3 ms against 3.2-6.4 ms in one run), the segment-parallel variant (3.77-4.62 ms against the
# compact variant's 3.33 ms: instruction-bound, not short of parallelism), and the sampled-threshold
# shapes that lost. tests/kernels/test_kernels_indexer.py::test_every_gpu_config_is_correct covers
# both lists.
EXPERIMENTAL_TOPK_CONFIGS = [
    # the filter's default until session 19: one block a step (lost to PAIR at every shape, run 18)
    KernelConfig.make(FILTER=1, SPLIT_T=0, SAMPLES=2048, RUN=8, BLOCK=1024, CAP=4096, RADIX_BITS=8,
                      SELECT_WARPS=4, num_warps=4, num_stages=3),
    # the filter's default until session 18: 4096 samples, by a kernel of their own
    KernelConfig.make(FILTER=1, SPLIT_T=1, SAMPLES=4096, RUN=8, BLOCK=1024, CAP=4096, RADIX_BITS=8,
                      SELECT_WARPS=4, num_warps=4, num_stages=3),
    KernelConfig.make(BLOCK=512, RADIX_BITS=7, COMPACT=0, num_warps=4, num_stages=1),
    KernelConfig.make(BLOCK=512, RADIX_BITS=6, COMPACT=0, num_warps=4, num_stages=1),
    KernelConfig.make(BLOCK=512, RADIX_BITS=8, COMPACT=1, FULL_PASSES=2, CAP=4096, num_warps=4, num_stages=1),
    KernelConfig.make(BLOCK=1024, RADIX_BITS=8, COMPACT=1, FULL_PASSES=2, CAP=4096, num_warps=4, num_stages=1),
    KernelConfig.make(BLOCK=512, RADIX_BITS=7, COMPACT=1, FULL_PASSES=2, CAP=8192, num_warps=4, num_stages=1),
    KernelConfig.make(BLOCK=512, RADIX_BITS=6, COMPACT=1, FULL_PASSES=3, CAP=2048, num_warps=4, num_stages=1),
    KernelConfig.make(SAMPLES=2048, BLOCK=1024, RADIX_BITS=8, CAP=8192, num_warps=4, num_stages=1),
    # segment-parallel (kernels/topk_seg.py): (row, segment) grids instead of one program per row
    KernelConfig.make(SEG=4096, BLOCK=512, RADIX_BITS=8, FULL_PASSES=2, CAP=4096, num_warps=4, num_stages=1),
    KernelConfig.make(SEG=8192, BLOCK=1024, RADIX_BITS=8, FULL_PASSES=2, CAP=4096, num_warps=4, num_stages=1),
    KernelConfig.make(SEG=4096, BLOCK=512, RADIX_BITS=7, FULL_PASSES=2, CAP=8192, num_warps=4, num_stages=1),
    KernelConfig.make(SEG=2048, BLOCK=512, RADIX_BITS=8, FULL_PASSES=2, CAP=4096, num_warps=2, num_stages=1),
    # sampled threshold: the shapes that lost to the one in TOPK_CONFIGS
    KernelConfig.make(SAMPLES=4096, BLOCK=1024, RADIX_BITS=8, CAP=8192, num_warps=8, num_stages=1),
    KernelConfig.make(SAMPLES=2048, BLOCK=2048, RADIX_BITS=8, CAP=8192, num_warps=8, num_stages=1),
    # filter then select, the shapes that lost on the H100 (run 2): an 8192-slot select (its tile
    # halves the rows in flight: 1.72 ms in all) and a 2-warp filter (1.85 ms)
    KernelConfig.make(FILTER=1, SAMPLES=4096, RUN=8, BLOCK=1024, CAP=8192, RADIX_BITS=8, SELECT_WARPS=8,
                      num_warps=4, num_stages=3),
    KernelConfig.make(FILTER=1, SAMPLES=4096, RUN=8, BLOCK=512, CAP=4096, RADIX_BITS=8, SELECT_WARPS=4,
                      num_warps=2, num_stages=4),
    # the thresholds inside the filter program: 0.74 ms against 0.59 split (H200, run 4)
    KernelConfig.make(FILTER=1, SAMPLES=4096, RUN=8, BLOCK=1024, CAP=4096, RADIX_BITS=8, SELECT_WARPS=4,
                      num_warps=4, num_stages=3),
    # Measured and removed (session 16, bench/results/topk_filter_gpu.json runs 6-8, H100): warp
    # segments (one contiguous range of the row per warp, the prefix sums inside a warp: filter -5%,
    # select 3x slower from the segment tile's reshape), the thresholds' search in 1-2 warps a row (the
    # filter phase 0.83 / 0.76 ms against 0.69) and a 1-2-warp select that streams its indices back
    # (0.26-0.28 ms against 0.26).
]
TOPK_TUNER = Autotuner("indexer_topk", TOPK_CONFIGS)


@triton.jit
def _topk_rows_kernel(score_ptr, out_ptr, ckey_ptr, cidx_ptr, shift_ptr, dmask_ptr, row0, offset, S,
                      stride_s, stride_o, stride_c,
                      K: tl.constexpr, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, N_PASSES: tl.constexpr,
                      COMPACT: tl.constexpr, FULL_PASSES: tl.constexpr, CAP: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)  # valid (causal) keys of this row
    row_ptr = score_ptr + r.to(tl.int64) * stride_s
    out_row = out_ptr + (row0 + r).to(tl.int64) * stride_o
    if n <= K:
        emit_short_row(out_row, n, K, BLOCK)
    else:
        prefix = tl.zeros([], tl.uint32)
        pmask = tl.zeros([], tl.uint32)
        remaining = tl.full([], K, tl.int32)
        if not COMPACT:
            emit_full(row_ptr, out_row, n, prefix, pmask, remaining, shift_ptr, dmask_ptr,
                       0, N_PASSES, RADIX_BITS, BLOCK)
        else:
            in_bin = n
            for p in tl.static_range(FULL_PASSES):
                prefix, pmask, remaining, in_bin = radix_pass(
                    row_ptr, n, prefix, pmask, remaining, tl.load(shift_ptr + p), tl.load(dmask_ptr + p),
                    RADIX_BITS, BLOCK, False)
            if in_bin > CAP:  # too many keys share the prefix for the scratch buffer
                emit_full(row_ptr, out_row, n, prefix, pmask, remaining, shift_ptr, dmask_ptr,
                           FULL_PASSES, N_PASSES, RADIX_BITS, BLOCK)
            else:
                _emit_compact(row_ptr, out_row, ckey_ptr + r.to(tl.int64) * stride_c,
                              cidx_ptr + r.to(tl.int64) * stride_c, n, prefix, pmask, remaining,
                              shift_ptr, dmask_ptr, K, FULL_PASSES, N_PASSES, RADIX_BITS, BLOCK)


@triton.jit
def _emit_compact(row_ptr, out_row, ckey_row, cidx_row, n, prefix, pmask, remaining, shift_ptr, dmask_ptr,
                  K: tl.constexpr, FULL_PASSES: tl.constexpr, N_PASSES: tl.constexpr,
                  RADIX_BITS: tl.constexpr, BLOCK: tl.constexpr):
    # 1. one row read: keys above the prefix are selected (write them); keys on it are candidates
    written = tl.zeros([], tl.int32)
    n_cand = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < n
        key = ordered_key(tl.load(row_ptr + idx, mask=ok, other=0.0))
        masked = key & pmask
        top = ok & (masked > prefix)
        cand = ok & (masked == prefix)
        top_i = top.to(tl.int32)
        cand_i = cand.to(tl.int32)
        tl.store(out_row + written + tl.cumsum(top_i, axis=0) - 1, idx, mask=top)
        pos = n_cand + tl.cumsum(cand_i, axis=0) - 1
        tl.store(ckey_row + pos, key, mask=cand)
        tl.store(cidx_row + pos, idx, mask=cand)
        written += tl.sum(top_i, axis=0)
        n_cand += tl.sum(cand_i, axis=0)
    tl.debug_barrier()  # candidates written by all threads before any thread reads them
    finish_candidates(out_row, ckey_row, cidx_row, n_cand, prefix, pmask, remaining, written, shift_ptr,
                       dmask_ptr, K, FULL_PASSES, N_PASSES, RADIX_BITS, BLOCK)


@functools.lru_cache(maxsize=64)
def _radix_schedule(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pass shift and digit mask over the 32-bit key, most significant digit first.

    Built once per (bits, device): they are two host-to-device copies, and on the H100 the same
    filter shape took 1.31 ms through topk_rows_chunk, which built them at every launch, against
    1.18 ms with them built once (session 15, bench/results/topk_filter_gpu.json run 2). The kernels
    only read them."""
    shifts, masks = [], []
    hi = 32
    while hi > 0:
        lo = max(hi - bits, 0)
        shifts.append(lo)
        masks.append((1 << (hi - lo)) - 1)
        hi = lo
    return (torch.tensor(shifts, dtype=torch.int32, device=device),
            torch.tensor(masks, dtype=torch.int64, device=device).to(torch.uint32))


def _bucket(n: int) -> int:
    """Tuning key of a size: its power-of-two ceiling (varying packed lengths reuse one tuning)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def topk_rows_chunk(scores, row0, rows, offset, S, topk, out, config: KernelConfig | None = None,
                    pipeline=None):
    """Top-k of each causal row of ``scores`` (chunk rows [row0, row0+rows)) into out[row0:...].

    Row r of the chunk has n = min(row0 + r + offset + 1, S) valid leading columns.
    ``config`` forces one variant (tests); by default the autotuner picks it. ``pipeline`` (a
    topk_filter.SelectPipeline): the FILTER variant may run its last phase on the pipeline's stream
    (topk_filter.topk_rows_filtered); the caller then joins it before reading ``out``."""
    def launch(cfg: KernelConfig, pipeline=None) -> None:
        shifts, masks = _radix_schedule(cfg["RADIX_BITS"], scores.device)
        p = dict(cfg.params)
        if "FILTER" in p:
            from kernels.topk_filter import topk_rows_filtered
            topk_rows_filtered(scores, row0, rows, offset, S, topk, out, shifts, masks, samples=p["SAMPLES"],
                               run=p["RUN"], block=p["BLOCK"], cap=p["CAP"], radix_bits=p["RADIX_BITS"],
                               filter_warps=cfg.num_warps, filter_stages=cfg.num_stages,
                               select_warps=p["SELECT_WARPS"], split_t=bool(p.get("SPLIT_T", 0)),
                               t_warps=p.get("T_WARPS", 4), refilter=bool(p.get("REFILTER", 1)),
                               aim=p.get("AIM_PCT", AIM_PCT) / 100, pair=bool(p.get("PAIR", 0)), pipeline=pipeline)
            return
        if "SAMPLES" in p:
            from kernels.topk_sample import topk_rows_sampled
            topk_rows_sampled(scores, row0, rows, offset, S, topk, out, shifts, masks, samples=p["SAMPLES"],
                              block=p["BLOCK"], radix_bits=p["RADIX_BITS"], cap=p["CAP"], num_warps=cfg.num_warps)
            return
        if "SEG" in p:
            from kernels.topk_seg import topk_rows_segmented
            topk_rows_segmented(scores, row0, rows, offset, S, topk, out, shifts, masks, seg=p["SEG"],
                                block=p["BLOCK"], radix_bits=p["RADIX_BITS"],
                                full_passes=min(p["FULL_PASSES"], shifts.numel()), cap=p["CAP"],
                                num_warps=cfg.num_warps)
            return
        compact, cap = p.get("COMPACT", 0), p.get("CAP", 1)
        full_passes = min(p.get("FULL_PASSES", 1), shifts.numel())
        ckey = torch.empty((rows, cap if compact else 1), device=scores.device, dtype=torch.uint32)
        cidx = torch.empty((rows, cap if compact else 1), device=scores.device, dtype=torch.int32)
        _topk_rows_kernel[(rows,)](
            scores, out, ckey, cidx, shifts, masks, row0, offset, S, scores.stride(0), out.stride(0),
            ckey.stride(0), K=topk, BLOCK=cfg["BLOCK"], RADIX_BITS=cfg["RADIX_BITS"], N_PASSES=shifts.numel(),
            COMPACT=bool(compact), FULL_PASSES=full_passes, CAP=cap,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    cfg = config or TOPK_TUNER.choose((_bucket(rows), _bucket(S), topk), scores.device, launch)
    launch(cfg, pipeline)
