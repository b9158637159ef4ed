"""DSA indexer scores + top-k against the torch reference (exact sets, ties to the lower index)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import kernels.indexer as ix
from kernels.topk_common import kth_key, ordered_key, search_count, threshold_at_count
from kernels.indexer_torch import reference_indexer_scores, reference_indexer_topk, select_topk

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@triton.jit
def _threshold_at_count_kernel(key_ptr, n, need_ptr, out_ptr, BLOCK: tl.constexpr):
    j = tl.arange(0, BLOCK)
    ok = j < n
    keys = tl.load(key_ptr + j, mask=ok, other=0)
    tl.store(out_ptr + tl.program_id(0), threshold_at_count(keys, ok, tl.load(need_ptr + tl.program_id(0))))


@triton.jit
def _search_count_kernel(key_ptr, n, need, slack, out_ptr, BLOCK: tl.constexpr):
    j = tl.arange(0, BLOCK)
    ok = j < n
    keys = tl.load(key_ptr + j, mask=ok, other=0)
    tl.store(out_ptr, search_count(keys, ok, need, slack))


@triton.jit
def _kth_key_kernel(score_ptr, n, need, out_ptr, scratch_ptr, BLOCK: tl.constexpr, SCRATCH: tl.constexpr):
    j = tl.arange(0, BLOCK)
    ok = j < n
    keys = ordered_key(tl.load(score_ptr + j, mask=ok, other=0.0))
    kth, n_above = kth_key(keys, ok, need, scratch_ptr, SCRATCH, False)
    tl.store(out_ptr, kth)
    tl.store(out_ptr + 1, n_above.to(tl.uint32))


def _integer_inputs(device, T, S, heads, dim):
    """Small integers and power-of-two weights: every score is exact in fp32, so ties are real."""
    q = torch.randint(-3, 4, (T, heads, dim), device=device).to(torch.bfloat16)
    k = torch.randint(-3, 4, (S, dim), device=device).to(torch.bfloat16)
    w = torch.randint(-1, 2, (T, heads), device=device).float() * 2.0 ** torch.randint(-2, 2, (T, heads), device=device)
    return q, k, w


@pytest.mark.parametrize("T,S", [(48, 48), (24, 90)], ids=["square", "prefix_keys"])
def test_topk_equals_stable_reference_with_ties_and_short_rows(device, T, S):
    q, k, w = _integer_inputs(device, T, S, heads=4, dim=16)
    got = ix.indexer_topk(q, k, w, topk=32, chunk_rows=16)
    want = reference_indexer_topk(q, k, w, topk=32, stable=True)
    assert got.dtype == torch.int32 and got.shape == (T, 32)
    assert torch.equal(got, want)
    n_valid = torch.arange(T, device=device) + (S - T) + 1
    short = n_valid < 32
    if short.any():  # rows with fewer valid keys than k: 0..n-1 then -1
        row = int(torch.nonzero(short)[0])
        n = int(n_valid[row])
        assert got[row, :n].tolist() == list(range(n)) and (got[row, n:] == -1).all()


def test_scores_match_reference_on_random_floats(device):
    T, S = 20, 70
    q = torch.randn(T, 4, 32, device=device).to(torch.bfloat16)
    k = torch.randn(S, 32, device=device).to(torch.bfloat16)
    w = torch.randn(T, 4, device=device)
    out = torch.full((T, S), float("nan"), device=device)
    ix.indexer_scores_chunk(q, k, w, 0, T, S - T, out)
    want = reference_indexer_scores(q, k, w)
    causal = torch.isfinite(want)
    torch.testing.assert_close(out[causal], want[causal], atol=1e-4, rtol=1e-5)


VARIANTS = {
    "full_4bit": {"RADIX_BITS": 4, "COMPACT": 0},
    "full_8bit": {"RADIX_BITS": 8, "COMPACT": 0},
    "full_11bit": {"RADIX_BITS": 11, "COMPACT": 0},
    "compact_8bit": {"RADIX_BITS": 8, "COMPACT": 1, "FULL_PASSES": 2, "CAP": 128},
    "compact_6bit": {"RADIX_BITS": 6, "COMPACT": 1, "FULL_PASSES": 3, "CAP": 128},
    "compact_fallback": {"RADIX_BITS": 8, "COMPACT": 1, "FULL_PASSES": 2, "CAP": 4},  # bins overflow CAP
    "segmented_8bit": {"SEG": 64, "RADIX_BITS": 8, "FULL_PASSES": 2, "CAP": 128},
    "segmented_6bit": {"SEG": 256, "RADIX_BITS": 6, "FULL_PASSES": 3, "CAP": 128},
    "segmented_fallback": {"SEG": 64, "RADIX_BITS": 8, "FULL_PASSES": 2, "CAP": 4},
    "sampled": {"SAMPLES": 16, "RADIX_BITS": 8, "CAP": 192},  # threshold from 16 samples
    "sampled_short_rows": {"SAMPLES": 16, "RADIX_BITS": 8, "CAP": 256},  # rows <= CAP: every key a candidate
    "sampled_fallback": {"SAMPLES": 16, "RADIX_BITS": 8, "CAP": 64},  # candidates overflow: full select
    # filter then select (kernels/topk_filter.py): rows of 200 keys filtered into 128 slots (tied rows
    # overflow them: full select), or selected straight from the scores when CAP covers the row
    "filter": {"FILTER": 1, "SAMPLES": 32, "RUN": 4, "RADIX_BITS": 8, "CAP": 128, "SELECT_WARPS": 4},
    "filter_rows_within_cap": {"FILTER": 1, "SAMPLES": 16, "RUN": 1, "RADIX_BITS": 8, "CAP": 256, "SELECT_WARPS": 4},
    "filter_split_threshold": {"FILTER": 1, "SPLIT_T": 1, "SAMPLES": 32, "RUN": 4, "RADIX_BITS": 8, "CAP": 128,
                               "SELECT_WARPS": 4},
}


@pytest.mark.parametrize("variant", [{"SEG": 16, "FULL_PASSES": 2, "CAP": 64}, {"SAMPLES": 8, "CAP": 24},
                                     {"FILTER": 1, "SAMPLES": 8, "RUN": 2, "CAP": 16, "SELECT_WARPS": 4}],
                         ids=["segmented", "sampled", "filter"])
def test_segmented_and_sampled_topk_on_causal_rows_with_short_rows(device, variant):
    # offset 0: rows 0..K-1 have at most K keys (identity + -1 padding); later rows select
    rows, S, K = 40, 40, 16
    scores = torch.randint(0, 6, (rows, S), device=device).float()
    scores[::3] = torch.randn(len(range(0, rows, 3)), S, device=device)
    out = torch.empty((rows, K), device=device, dtype=torch.int32)
    cfg = ix.KernelConfig.make(BLOCK=16, RADIX_BITS=8, num_warps=4, num_stages=1, **variant)
    ix.topk_rows_chunk(scores, 0, rows, 0, S, K, out, config=cfg)
    masked = scores.masked_fill(torch.ones(rows, S, dtype=torch.bool, device=device).triu(1), float("-inf"))
    want = select_topk(masked, torch.arange(rows, device=device) + 1, K, stable=True)
    assert torch.equal(out, want)


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_topk_selection_alone_breaks_ties_toward_lower_index(device, variant):
    # Scores drawn from 5 levels: most of the k-th value's copies fall on the boundary;
    # plus a few distinct values (negative, tiny, huge) so every radix digit matters.
    rows, S, K = 6, 200, 64
    scores = torch.randint(0, 5, (rows, S), device=device).float() - 2.0
    scores[3:] = torch.randn(rows - 3, S, device=device)  # distinct values: few keys share a prefix
    scores[:, ::7] = torch.randn(rows, (S + 6) // 7, device=device) * torch.logspace(-30, 30, (S + 6) // 7,
                                                                                      device=device)
    out = torch.empty((rows, K), device=device, dtype=torch.int32)
    cfg = ix.KernelConfig.make(BLOCK=128, num_warps=4, num_stages=1, **VARIANTS[variant])
    ix.topk_rows_chunk(scores, 0, rows, S - 1, S, K, out, config=cfg)  # offset S-1: every key valid
    want = select_topk(scores, torch.full((rows,), S, device=device), K, stable=True)
    assert torch.equal(out, want)


def test_bad_inputs_name_the_argument(device):
    q, k, w = _integer_inputs(device, 8, 8, heads=2, dim=16)
    with pytest.raises(ValueError, match="k must be"):
        ix.indexer_topk(q, k[:, :8], w)
    with pytest.raises(ValueError, match="w must be"):
        ix.indexer_topk(q, k, w[:, :1])
    with pytest.raises(ValueError, match="topk must be a power of two"):
        ix.indexer_topk(q, k, w, topk=48)
    with pytest.raises(ValueError, match="offset"):
        ix.indexer_topk(q, k, w, offset=-1)


@pytest.mark.gpu
@gpu
def test_indexer_gpu_4k_context_k2048():
    T = S = 4096
    q = torch.randn(T, 32, 128, device="cuda").to(torch.bfloat16)
    k = torch.randn(S, 128, device="cuda").to(torch.bfloat16)
    w = torch.randn(T, 32, device="cuda") / 32
    got = ix.indexer_topk(q, k, w, topk=2048, chunk_rows=1024)
    # selection is exact given the kernel's own scores ...
    scores = torch.empty((T, S), device="cuda")
    ix.indexer_scores_chunk(q, k, w, 0, T, 0, scores)
    future = torch.arange(S, device="cuda")[None, :] > torch.arange(T, device="cuda")[:, None]
    scores.masked_fill_(future, float("-inf"))
    n_valid = torch.arange(T, device="cuda") + 1
    assert torch.equal(got, select_topk(scores, n_valid, 2048, stable=True))
    # ... and those scores agree with the fp32 reference
    ref = reference_indexer_scores(q[:256], k, w[:256], offset=0)
    ok = torch.isfinite(ref)
    torch.testing.assert_close(scores[:256][ok], ref[ok], atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
@gpu
def test_indexer_gpu_selects_on_their_own_stream_while_the_scores_are_overwritten():
    """indexer_topk runs each chunk's select on indexer.select_pipeline's stream while the next chunk's
    scoring overwrites the one scores buffer and the next filters reuse its two sets of candidate lists
    (chunks of rows longer than CAP; the refilter finishes the rows that miss): its output equals every row's exact top-k of the kernel's own scores, with ties and
    a planted row whose candidates overflow any threshold (the refilter's full select)."""
    T = S = 20480  # 5 chunks of 4096: the first has rows of <= CAP keys (its select stays in order)
    torch.manual_seed(0)
    q = torch.randn(T, 8, 64, device="cuda").to(torch.bfloat16)
    k = torch.randn(S, 64, device="cuda").to(torch.bfloat16)
    w = torch.randn(T, 8, device="cuda") / 8
    k[5000:] = k[5000]  # every key past 5000 scores alike: rows past it tie past CAP
    got = ix.indexer_topk(q, k, w, topk=2048, chunk_rows=4096)
    scores = torch.empty((T, S), device="cuda")
    ix.indexer_scores_chunk(q, k, w, 0, T, 0, scores)
    future = torch.arange(S, device="cuda")[None, :] > torch.arange(T, device="cuda")[:, None]
    scores.masked_fill_(future, float("-inf"))
    assert torch.equal(got, select_topk(scores, torch.arange(T, device="cuda") + 1, 2048, stable=True))


@pytest.mark.gpu
@gpu
def test_every_gpu_config_is_correct():
    T = S = 1024
    q = torch.randn(T, 32, 128, device="cuda").to(torch.bfloat16)
    k = torch.randn(S, 128, device="cuda").to(torch.bfloat16)
    w = torch.randn(T, 32, device="cuda") / 32
    ref = reference_indexer_scores(q, k, w, offset=0)
    finite = torch.isfinite(ref)
    for cfg in ix.SCORE_CONFIGS:
        out = torch.full((T, S), float("nan"), device="cuda")
        ix.SCORE_TUNER.records.clear()
        ix.SCORE_TUNER.configs = [cfg]
        ix.indexer_scores_chunk(q, k, w, 0, T, 0, out)
        torch.testing.assert_close(out[finite], ref[finite], atol=1e-3, rtol=1e-4, msg=cfg.describe)
    ix.SCORE_TUNER.configs = list(ix.SCORE_CONFIGS)
    ix.SCORE_TUNER.records.clear()
    n_valid = torch.arange(T, device="cuda") + 1
    want = select_topk(ref, n_valid, 256, stable=True)
    for cfg in ix.TOPK_CONFIGS + ix.EXPERIMENTAL_TOPK_CONFIGS:
        got = torch.empty((T, 256), device="cuda", dtype=torch.int32)
        ix.topk_rows_chunk(ref.clone(), 0, T, 0, S, 256, got, config=cfg)
        assert torch.equal(got, want), cfg.describe()


def test_sampled_threshold_path_is_exact_when_candidates_fit(device):
    rows, S, K, samples, cap = 12, 400, 16, 128, 128
    scores = torch.randn(rows, S, device=device)
    # the premise: every row's sampled threshold leaves between K and CAP candidates (no fallback)
    stride = -(-S // samples)
    r = (3 * K) // (2 * stride) + 4
    t = scores[:, ::stride].sort(dim=1, descending=True).values[:, r - 1:r]
    counts = (scores >= t).sum(dim=1)
    assert ((counts >= K) & (counts <= cap)).all(), counts
    out = torch.empty((rows, K), device=device, dtype=torch.int32)
    cfg = ix.KernelConfig.make(SAMPLES=samples, BLOCK=64, RADIX_BITS=8, CAP=cap, num_warps=4, num_stages=1)
    ix.topk_rows_chunk(scores, 0, rows, S - 1, S, K, out, config=cfg)
    assert torch.equal(out, select_topk(scores, torch.full((rows,), S, device=device), K, stable=True))


def _filter_case(device, rows=12, S=400):
    scores = torch.randn(rows, S, device=device)
    return scores, torch.full((rows,), S, device=device)


def _filtered_topk(scores, K, cap, samples=64, run=4, split_t=False, refilter=True, pair=False,
                   finish=False):
    """(the top-k by filter then select, the rows' final candidate counts, the path each row took);
    finish: the refilter runs the full select of the rows that still miss (else the select does)."""
    from kernels import topk_filter as tf
    from kernels.topk import _radix_schedule
    rows, S = scores.shape
    out = torch.full((rows, K), -2, device=scores.device, dtype=torch.int32)
    shifts, masks = _radix_schedule(8, scores.device)
    cand = tf.filter_rows(scores, 0, rows, S - 1, S, K, samples=samples, run=run, block=64, cap=cap,
                          warps=4, stages=1, split_t=split_t, refilter=refilter, pair=pair,
                          finish=(out, shifts, masks, 8) if finish else None)
    tf.select_rows(scores, cand, 0, rows, S - 1, S, K, out, shifts, masks, radix_bits=8, warps=4)
    return out, cand.counts, cand.paths


@pytest.mark.parametrize("split_t,pair", [(False, False), (True, False), (False, True)],
                         ids=["threshold_inline", "threshold_kernel", "pairs"])
def test_filter_select_is_exact_when_candidates_fit(device, split_t, pair):
    scores, n = _filter_case(device)
    out, count, _ = _filtered_topk(scores, K=16, cap=128, split_t=split_t, pair=pair)
    assert ((count >= 16) & (count <= 128)).all(), count  # the premise: no row took the fallback
    assert torch.equal(out, select_topk(scores, n, 16, stable=True))


# 437 = 6 whole blocks of 64 + a 53-key tail; in pairs (PAIR): 3 whole pairs + a tail within the first
# block of the last pair; 500 = 3 pairs + a tail through both blocks of the last pair (64 + 52)
@pytest.mark.parametrize("pair,S", [(False, 437), (True, 437), (True, 500)], ids=["blocks", "pairs", "pairs_tail2"])
def test_the_candidates_are_every_key_at_or_above_the_threshold_in_index_order(device, pair, S):
    from kernels import topk_filter as tf
    scores, _ = _filter_case(device, rows=4, S=S)
    t = tf.row_thresholds(scores, 0, 4, S - 1, S, 16, samples=64, run=4, cap=128)
    cand = tf.filter_rows(scores, 0, 4, S - 1, S, 16, samples=64, run=4, block=64, cap=128, warps=4, stages=1,
                          split_t=True, thresh=t, pair=pair)
    for r in range(4):
        t_f = torch.tensor([int(t[r])], dtype=torch.int64)
        t_f = (t_f ^ 0x80000000 if t_f >= 0x80000000 else ~t_f & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
        want = torch.nonzero(scores[r] >= t_f.to(device)).flatten()
        c = int(cand.counts[r])
        assert torch.equal(cand.indices[r, :c].long(), want), r
        assert torch.equal(cand.scores[r, :c], scores[r, want])


def _biased_sample_case(device, shift, S=1000, samples=256, run=4):
    """Rows whose sampled keys (sampled_threshold's positions) are all shifted by `shift`: the sample
    then misplaces the threshold (too high for shift > 0, too low for shift < 0)."""
    # drawn on the CPU: the premises below (which rows miss, where the refilter lands) were simulated
    # on the host, and CUDA's random stream differs
    scores = torch.randn(12, S).to(device)
    n = torch.full((12,), S, device=device)
    n_runs = samples // run
    stride = max(-(-S // n_runs), run)
    i = torch.arange(samples, device=device)
    pos = (i // run) * stride + i % run
    sampled = torch.zeros(S, dtype=torch.bool, device=device)
    sampled[pos[pos < S]] = True
    return torch.where(sampled, scores + shift, scores), n


@pytest.mark.parametrize("shift", [-0.5, 0.5], ids=["too_many", "too_few"])
@pytest.mark.parametrize("split_t,pair", [(False, False), (True, False), (False, True)],
                         ids=["threshold_inline", "threshold_kernel", "pairs"])
def test_filter_refilters_a_row_whose_sampled_threshold_missed(device, shift, split_t, pair):
    # K = 64 of 1000 keys, CAP 128, 256 samples: with the samples shifted the first threshold leaves
    # 150-240 keys (too many) or 49-72 (too few, most rows); the samples' count scaled by what the row
    # showed lands in [K, CAP] (a host simulation of this seed: every missed row)
    scores, n = _biased_sample_case(device, shift)
    want = select_topk(scores, n, 64, stable=True)
    out, first, paths = _filtered_topk(scores, K=64, cap=128, samples=256, split_t=split_t, refilter=False,
                                       pair=pair)
    missed = (first < 64) | (first > 128)
    assert missed.sum() >= 10, first
    assert (paths[missed] == 2).all() and (paths[~missed] == 0).all(), paths  # straight to the full select
    assert torch.equal(out, want)
    out, count, paths = _filtered_topk(scores, K=64, cap=128, samples=256, split_t=split_t, pair=pair)
    assert ((paths == 1) == missed).all(), (first, paths)
    assert ((count[missed] >= 64) & (count[missed] <= 128)).float().mean() >= 0.9, count
    assert torch.equal(out, want)


@pytest.mark.parametrize("finish", [False, True], ids=["in_select", "in_refilter"])
def test_filter_select_takes_the_full_select_when_the_refilter_cannot_help(device, finish):
    # every key tied: no threshold leaves between K and CAP of them (the refilter is not even tried:
    # its threshold cannot move)
    scores = torch.zeros(6, 400, device=device)
    n = torch.full((6,), 400, device=device)
    out, count, paths = _filtered_topk(scores, K=16, cap=32, finish=finish)
    assert (count == 400).all() and (paths == 2).all(), (count, paths)
    assert torch.equal(out, select_topk(scores, n, 16, stable=True))
    # the sampled keys are the row's largest by far: t sits above every other key, too few survive,
    # and no threshold from the samples reaches the rest: the full select finishes the row
    scores, n = _filter_case(device)
    pos = torch.arange(400, device=device)
    scores = torch.where((pos % 25) < 4, 100.0 + scores.abs(), scores)
    out, count, paths = _filtered_topk(scores, K=64, cap=128, finish=finish)
    assert (paths == 2).all(), (count, paths)
    # the scaled need passed the 64 samples: no refilter pass ran (one at "keep every key" would
    # leave more than CAP, and its NaN threshold kept nothing: count 0)
    assert ((count > 0) & (count < 64)).all(), count
    assert torch.equal(out, select_topk(scores, n, 64, stable=True))


@pytest.mark.gpu
@gpu
def test_filter_gpu_long_rows_equal_the_full_select():
    # 16K-key rows past every CAP: the sampled threshold, the pipelined filter and the register select
    rows, S, K = 512, 16384, 2048
    q = torch.randn(rows, 32, 128, device="cuda").to(torch.bfloat16)
    k = torch.randn(S, 128, device="cuda").to(torch.bfloat16)
    w = torch.randn(rows, 32, device="cuda") / 32
    scores = torch.empty((rows, S), device="cuda")
    ix.indexer_scores_chunk(q, k, w, 0, rows, S - rows, scores)
    want = torch.empty((S, K), device="cuda", dtype=torch.int32)
    # q's row r is query S - rows + r: the chunk starts there, with offset 0
    ix.topk_rows_chunk(scores, S - rows, rows, 0, S, K, want, config=ix.TOPK_CONFIGS[0])
    for cfg in [c for c in ix.TOPK_CONFIGS + ix.EXPERIMENTAL_TOPK_CONFIGS if "FILTER" in dict(c.params)]:
        got = torch.full((S, K), -2, device="cuda", dtype=torch.int32)
        ix.topk_rows_chunk(scores, S - rows, rows, 0, S, K, got, config=cfg)
        assert torch.equal(got[S - rows:], want[S - rows:]), cfg.describe()


def test_threshold_at_count_is_the_largest_key_with_enough_keys_at_or_above_it(device):
    """The ternary search over [min, max] (topk_common.threshold_at_count) against a brute force:
    ties, keys spanning the whole uint32 range, too few valid keys, need <= 0."""
    def brute(keys, need):
        if need <= 0:
            return 0xFFFFFFFF
        if len(keys) < need:
            return 0
        return sorted(keys, reverse=True)[need - 1]  # the need-th largest: count(>= it) >= need, and no larger

    gen = torch.Generator().manual_seed(0)
    cases = [
        torch.randint(0, 2**32, (50,), generator=gen, dtype=torch.int64),  # the whole range
        torch.randint(3_000_000_000, 3_000_000_040, (50,), generator=gen, dtype=torch.int64),  # a narrow span, ties
        torch.full((50,), 7, dtype=torch.int64),  # all equal
        torch.tensor([0, 2**32 - 1] * 25, dtype=torch.int64),  # the two ends
    ]
    for keys in cases:
        for n, need in [(50, 1), (50, 17), (50, 50), (30, 31), (40, 0), (1, 1)]:
            k32 = keys.to(torch.uint32).to(device)
            out = torch.zeros(1, dtype=torch.uint32, device=device)
            _threshold_at_count_kernel[(1,)](k32, n, torch.tensor([need], dtype=torch.int32, device=device), out, BLOCK=64)
            want = brute(keys[:n].tolist(), need)
            assert int(out.to(torch.int64).item()) & 0xFFFFFFFF == want, (keys[:4].tolist(), n, need)


def test_search_count_with_slack_stops_within_it_or_at_the_exact_threshold(device):
    """sampled_threshold's early stop: count(>= t) within need +- slack, or (ties) the exact threshold."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(6):
        keys = torch.randint(0, 2**32 if trial % 2 else 1000, (256,), generator=gen, dtype=torch.int64)
        for need, slack in [(40, 4), (100, 0), (10, 3), (200, 20)]:
            out = torch.zeros(1, dtype=torch.uint32, device=device)
            _search_count_kernel[(1,)](keys.to(torch.uint32).to(device), 256, need, slack, out, BLOCK=256)
            t = int(out.to(torch.int64).item()) & 0xFFFFFFFF
            count = int((keys >= t).sum())
            exact = sorted(keys.tolist(), reverse=True)[need - 1]
            assert abs(count - need) <= slack or t == exact, (trial, need, slack, count, t, exact)


def _ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """ordered_key on the host: int64 keys whose order is the fp32 order."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 2**31)


def test_kth_key_is_the_need_th_largest_key_for_any_score_distribution(device):
    """kth_key (the tail-model search, then a rank of the last <= 32 keys) against a sort, on score rows
    the model fits (a Gaussian's and an exponential's tail) and rows it does not (ties, two clusters,
    infinities and NaNs, one value), for every need from 1 to the valid keys, with a scratch of 16 or
    32 keys."""
    gen = torch.Generator().manual_seed(3)
    n = 400
    g = torch.randn(n, generator=gen)
    rows = {
        "gauss": g,
        "exp_tail": -torch.log(torch.rand(n, generator=gen)),
        "bf16_ties": g.to(torch.bfloat16).float(),
        "quarter_steps": torch.round(g * 4) / 4,
        "two_clusters": torch.cat([g[:300], 1e6 + g[300:]]),
        "inf_nan": torch.where(torch.arange(n) % 7 == 0, torch.tensor(float("inf")),
                               torch.where(torch.arange(n) % 11 == 0, torch.tensor(float("nan")), g)),
        "negative": -1.0 - torch.rand(n, generator=gen),
        "one_value": torch.full((n,), 2.5),
    }
    for name, x in rows.items():
        want_sorted = sorted(_ordered_keys(x).tolist(), reverse=True)
        for slots in (16, 64):
            for need in (1, 2, 17, 200, 333, 399, 400):
                out = torch.zeros(2, dtype=torch.uint32, device=device)
                scratch = torch.zeros(slots, dtype=torch.int32, device=device)
                _kth_key_kernel[(1,)](x.to(device), n, need, out, scratch, BLOCK=512, SCRATCH=slots)
                got, n_above = (int(v) & 0xFFFFFFFF for v in out.to(torch.int64).tolist())
                assert got == want_sorted[need - 1], (name, slots, need)
                assert n_above == sum(key > got for key in want_sorted), (name, slots, need)
