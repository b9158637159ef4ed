"""Passes of the top-k searches, counted by a host model: `python bench/gpu/topk_search_model.py [--rows 8]`.

kernels/topk_common.search_bracket's arithmetic, restated in numpy on indexer score rows (random bf16
q, k, w / heads, as bench/gpu/topk_sweep.py scores them), to pick its cut constants on a CPU: it counts
the reductions over the tile each search costs (the kernel's time per pass is measured on the GPU:
bench/results/topk_filter_gpu.json). Two searches per row: the sampled threshold (4096 samples in runs
of 8, need ~1.5 k keys' worth, slack need / 32) and the select's k-th key over the keys >= it (exact;
the model search stops at <= 32 keys and ranks them, counted as 2.5 passes: a prefix sum, a store,
a rank). Each row is also searched by the ternary search it replaced, so the output is a ratio.
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np

SAMPLES, RUN, K = 4096, 8, 2048


def ordered(x: np.ndarray) -> np.ndarray:
    b = x.astype(np.float32).view(np.uint32).astype(np.int64)
    return np.where(b & 0x80000000, b ^ 0xFFFFFFFF, b | 0x80000000)


def to_float(key: int) -> np.float32:
    b = (key ^ 0x80000000) if key & 0x80000000 else (key ^ 0xFFFFFFFF)
    return np.array([b & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]


def search(keys, need, slack, model, *, first=0.2, z=1.5, misses_max=2, stop=0):
    """(threshold, passes): search_bracket with model cuts, or thirds only (model False)."""
    lo, hi, n_lo, n_hi = int(keys.min()), int(keys.max()) + 1, len(keys), 0
    passes, use, misses = 0, model, 0
    while hi - lo > 1 and n_lo - n_hi > stop and (slack < 0 or (n_lo - need > slack and need - n_hi > slack)):
        span, w = hi - lo, n_lo - n_hi
        cut_model = use and misses < misses_max
        if cut_model:
            p = (n_lo - need + 0.5) / w
            margin = need * first if n_hi == 0 else z * math.sqrt(w * p * (1 - p)) + 1
            margin = max(margin, slack)
            f_lo, f_hi = float(to_float(lo)), float(to_float(hi if n_hi else hi - 1))
            ln = math.log(n_lo) - math.log(max(n_hi, 1))

            def cut(c):
                with np.errstate(all="ignore"):
                    x = np.float32(f_lo + (math.log(n_lo) - math.log(max(c, 1.0))) / ln * (f_hi - f_lo)) if ln else f_lo
                return int(ordered(np.array([x]))[0])
            c1, c2 = cut(need + margin), cut(need - margin)
        else:
            third = max(span // 3, 1)
            c1, c2 = lo + third, hi - third
        c1 = min(max(c1, lo + 1), hi - 1)
        c2 = min(max(c2, c1), hi - 1)
        n1, n2 = int((keys >= c1).sum()), int((keys >= c2).sum())
        passes += 1
        if n2 >= need:
            lo, n_lo = c2, n2
        elif n1 >= need:
            lo, n_lo, hi, n_hi = c1, n1, c2, n2
        else:
            hi, n_hi = c1, n1
        halved = (hi - lo) * 2 <= span
        if cut_model and not halved:
            misses += 1
        use = (not cut_model) or halved if model else False
    if slack >= 0:
        return (hi if n_lo - need > slack and need - n_hi <= slack else lo), passes
    if hi - lo > 1:  # the rank of the last few keys
        window = np.sort(keys[(keys >= lo) & (keys < hi)])[::-1]
        return int(window[need - n_hi - 1]), passes + 2.5
    return lo, passes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--contexts", default="65536,40000,20000,9000")
    ns = ap.parse_args()
    import torch
    torch.manual_seed(0)
    S = max(int(c) for c in ns.contexts.split(","))
    q = torch.randn(ns.rows, 32, 128).bfloat16().float()
    k = torch.randn(S, 128).bfloat16().float()
    w = torch.randn(ns.rows, 32) / 32
    scores = (torch.einsum("rhd,sd->rhs", q, k).relu() * w[:, :, None]).sum(1).numpy()
    stats = {name: [] for name in ("thresh_model", "thresh_ternary", "select_model", "select_ternary", "survivors")}
    for row in scores:
        for n in (int(c) for c in ns.contexts.split(",")):
            keys = ordered(row[:n])
            stride = max(-(-n // (SAMPLES // RUN)), RUN)
            pos = (np.arange(SAMPLES) // RUN) * stride + np.arange(SAMPLES) % RUN
            sample = keys[pos[pos < n]]
            need = (3 * K * RUN) // (2 * stride) + 4
            t, p_model = search(sample, need, need // 32, True)
            stats["thresh_ternary"].append(search(sample, need, need // 32, False)[1])
            stats["thresh_model"].append(p_model)
            cand = keys[keys >= t] if (keys >= t).sum() >= K else keys
            kth, p_sel = search(cand, K, -1, True, stop=32)
            exact, p_tern = search(cand, K, -1, False)
            assert kth == exact == np.sort(keys)[-K]
            stats["select_model"].append(p_sel)
            stats["select_ternary"].append(p_tern)
            stats["survivors"].append(len(cand))
    report = {name: {"mean": round(float(np.mean(v)), 2), "max": float(np.max(v))} for name, v in stats.items()}
    report["note"] = "passes over the tile; + 2 more each for the min and max every search starts with"
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
