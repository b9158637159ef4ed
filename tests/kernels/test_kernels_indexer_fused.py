"""The fused indexer top-k (kernels/indexer_fused.py): the same output as indexer_topk's default impl
and the stable torch reference, on the main path (sampled thresholds, survivors in any order) and
on both exact fallbacks (too few candidates, candidates over CAP)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels.indexer as ix
import kernels.indexer_fused as fx
from bench import kernel_cases
from bench import kernels as kb
from kernels.indexer_torch import reference_indexer_topk

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _random_inputs(device, T, S, heads=4, dim=16, dtype=torch.bfloat16):
    q = torch.randn(T, heads, dim, device=device).to(dtype)
    k = torch.randn(S, dim, device=device).to(dtype)
    w = torch.randn(T, heads, device=device) / heads
    return q, k, w


def _n_valid(T, S, offset):
    return [min(t + offset + 1, S) for t in range(T)]


def _fused(q, k, w, topk, offset, chunk_rows, samples, cap):
    stats: dict = {}
    off = k.shape[0] - q.shape[0] if offset is None else offset
    out = fx.indexer_topk_fused(q.contiguous(), k.contiguous(), w.contiguous(), topk, off, chunk_rows,
                                samples=samples, cap=cap, stats=stats)
    return out, stats["fallback_rows"]


# Shapes: K=8 or 16, 8 or 16 samples. Rows with <= K keys are taken whole, rows with <= CAP keys keep
# every key as a candidate, the rest select among sampled-threshold survivors (1.5 K + 4 strides of
# them expected: about 30 here, so CAP is 48 where the sampled path must do the work). The Triton
# interpreter costs ~0.3 s per selecting row, so the rows are few.

def test_fused_equals_default_with_cp_offset_bf16(device):
    T, S, offset = 16, 96, 60  # a context-parallel rank's queries at positions 60..75
    q, k, w = _random_inputs(device, T, S)
    got, fallback = _fused(q, k, w, 8, offset, 8, samples=16, cap=48)
    want = ix.indexer_topk(q, k, w, topk=8, offset=offset, chunk_rows=8)
    assert got.dtype == torch.int32 and got.shape == (T, 8)
    assert torch.equal(got, want)
    assert torch.equal(got, reference_indexer_topk(q, k, w, topk=8, offset=offset, stable=True))
    assert fallback <= T // 4, fallback  # the sampled path did the work


def test_fused_impl_on_square_fp32_with_rows_shorter_than_k(device):
    T = S = 32
    q, k, w = _random_inputs(device, T, S, dtype=torch.float32)
    stats: dict = {}
    got = fx.indexer_topk_fused(q, k, w, 8, 0, 16, samples=16, cap=24, stats=stats)
    assert torch.equal(got, reference_indexer_topk(q, k, w, topk=8, stable=True))
    assert torch.equal(ix.indexer_topk(q, k, w, topk=8, chunk_rows=16, impl="fused"), got)
    for t in range(8):  # t + 1 <= K keys: 0..t, then -1
        assert got[t, :t + 1].tolist() == list(range(t + 1)) and (got[t, t + 1:] == -1).all()
    assert stats["fallback_rows"] <= 8, stats  # at most the 8 sampled rows


@pytest.fixture(params=range(len(fx.FUSED_SELECT_CONFIGS)), ids=lambda i: fx.FUSED_SELECT_CONFIGS[i].describe())
def select_config(request):
    """Each select config in turn (the radix passes over memory, the register tile)."""
    fx.FUSED_SELECT_TUNER.records.clear()
    fx.FUSED_SELECT_TUNER.configs = [fx.FUSED_SELECT_CONFIGS[request.param]]
    yield fx.FUSED_SELECT_CONFIGS[request.param]
    fx.FUSED_SELECT_TUNER.configs = list(fx.FUSED_SELECT_CONFIGS)
    fx.FUSED_SELECT_TUNER.records.clear()


def test_partial_ties_go_to_the_lowest_index_whatever_the_candidate_order(device, select_config):
    # small integers and power-of-two weights: exact fp32 scores, many equal at the k-th key, so the
    # bitwise lowest-index search over the unordered candidates decides which ties are taken
    T, S = 12, 64
    q = torch.randint(-2, 3, (T, 2, 16), device=device).to(torch.bfloat16)
    k = torch.randint(-1, 2, (S, 16), device=device).to(torch.bfloat16)
    w = 2.0 ** torch.randint(-1, 1, (T, 2), device=device).float()
    want = reference_indexer_topk(q, k, w, topk=8, stable=True)
    got, _ = _fused(q, k, w, 8, None, 12, samples=16, cap=40)
    assert torch.equal(got, want)
    # the atomics may deliver survivors in any order (the interpreter runs tiles in index order):
    # reverse and shuffle each row's candidates before the select, same output
    job = fx.FusedIndexerTopk(q, k, w, 8, S - T, 12, samples=16, cap=40)
    (row0, rows), = job.chunks()
    job.thresholds(row0, rows)
    job.candidates(row0, rows)
    for r, n in enumerate(job.count[:rows].tolist()):
        assert 8 <= n <= 40
        perm = torch.randperm(n, device=device) if r % 2 else torch.arange(n - 1, -1, -1, device=device)
        job.ckey[r, :n] = job.ckey[r, :n][perm]
        job.cidx[r, :n] = job.cidx[r, :n][perm]
    job.select(row0, rows)
    assert torch.equal(job.out, want) and int(job.flags.sum()) == 0


def test_all_tied_rows_overflow_cap_and_fall_back_exactly(device):
    # every score is 0: each sampled row's threshold keeps all of its n keys, more than CAP
    T = S = 40
    q, _, w = _random_inputs(device, T, S)
    k = torch.zeros(S, 16, device=device).to(torch.bfloat16)
    got, fallback = _fused(q, k, w, 8, None, 16, samples=16, cap=16)
    assert fallback == sum(n > 16 for n in _n_valid(T, S, 0))
    assert torch.equal(got, reference_indexer_topk(q, k, w, topk=8, stable=True))
    assert torch.equal(got[8:], torch.arange(8, device=device, dtype=torch.int32).expand(T - 8, 8))


def test_adversarial_sample_leaves_too_few_candidates_and_falls_back(device):
    # one chunk, 8 samples of the 64 keys: stride 8, and exactly the sampled keys (0, 8, ...) score
    # highest, so a row with >= 7 samples gets a threshold that keeps only them (< K = 16 candidates)
    # and one with fewer keeps everything (> CAP): every row past CAP falls back, both ways
    T = S = 64
    q = torch.ones(T, 2, 16, device=device).to(torch.bfloat16)
    k = (torch.rand(S, 16, device=device) * 0.25).to(torch.bfloat16)
    k[::8] = (4.0 + torch.rand(S // 8, 1, device=device)).to(torch.bfloat16)
    w = torch.ones(T, 2, device=device)
    got, fallback = _fused(q, k, w, 16, None, T, samples=8, cap=32)
    assert fallback == sum(n > 32 for n in _n_valid(T, S, 0))
    assert torch.equal(got, reference_indexer_topk(q, k, w, topk=16, stable=True))


def test_merge_runs_and_bad_arguments(device):
    assert fx.merge_runs([]) == []
    assert fx.merge_runs([3, 4, 5, 9, 200], gap=4) == [(3, 6), (9, 10), (200, 201)]
    assert fx.merge_runs([3, 6], gap=4) == [(3, 7)]
    q, k, w = _random_inputs(device, 8, 8)
    with pytest.raises(ValueError, match="impl must be one of"):
        ix.indexer_topk(q, k, w, topk=4, impl="nope")
    with pytest.raises(ValueError, match="cap"):
        fx.indexer_topk_fused(q, k, w, 16, 0, 8, cap=8)
    with pytest.raises(ValueError, match="samples"):
        fx.indexer_topk_fused(q, k, w, 4, 0, 8, samples=12)


def test_bench_entry_times_fused_beside_default_and_torch(device):
    shapes = dataclasses.replace(kb.TINY, idx_contexts=(24,), topk=16, idx_chunk_rows=16)
    default = {"ms": 4.0, "reference_ms": 8.0, "score_ms": 1.0}
    entry = kernel_cases._bench_indexer_fused(torch, device, shapes, lambda fn, **_: (fn(), 2.0)[1], 24, default)
    assert entry["name"] == "indexer_topk_fused" and entry["impl"] == "fused" and entry["correct"] is True
    assert entry["rows_same_as_default"] == 24 and entry["default_ms"] == 4.0 and entry["speedup"] == 4.0
    assert entry["speedup_over_default"] == 2.0 and entry["topk_ms_effective"] == 1.0
    assert entry["topk_read_fraction_of_copy"] is not None and entry["fallback_rows"] == 0
    assert set(entry["phase_ms_last_chunk"]) == {"thresholds", "candidates", "select"}


@pytest.mark.gpu
@gpu
def test_fused_gpu_16k_context_every_config_equals_default():
    T = S = 16384  # rows past CAP = 8192 keys take the sampled threshold
    q, k, w = _random_inputs("cuda", T, S, heads=32, dim=128)
    want = ix.indexer_topk(q, k, w, topk=2048)
    pairs = [(c, fx.FUSED_SELECT_CONFIGS[0]) for c in fx.FUSED_SCORE_CONFIGS]
    pairs += [(fx.FUSED_SCORE_CONFIGS[0], c) for c in fx.FUSED_SELECT_CONFIGS[1:]]
    try:
        for score_cfg, select_cfg in pairs:
            for tuner, cfg in ((fx.FUSED_SCORE_TUNER, score_cfg), (fx.FUSED_SELECT_TUNER, select_cfg)):
                tuner.records.clear()
                tuner.configs = [cfg]
            stats: dict = {}
            got = fx.indexer_topk_fused(q, k, w, 2048, 0, 4096, stats=stats)
            assert torch.equal(got, want), (score_cfg.describe(), select_cfg.describe())
            assert stats["fallback_rows"] < T // 100, stats
    finally:
        for tuner, cfgs in ((fx.FUSED_SCORE_TUNER, fx.FUSED_SCORE_CONFIGS),
                            (fx.FUSED_SELECT_TUNER, fx.FUSED_SELECT_CONFIGS)):
            tuner.configs = list(cfgs)
            tuner.records.clear()
