"""Where the whole context's top-k time goes, chunk by chunk: `python bench/gpu/topk_chunks.py --out X.json`.

The kernels benchmark's top-k phase (bench/kernel_cases._indexer_phase_ms) runs topk_rows_chunk over
every 4096-row chunk of a causal context on one buffer of scores (the last chunk's: row r of chunk c
reads its first n = row0 + r + 1 keys of it). This replays that with the default FILTER config's
phases timed apart per chunk (thresholds, filter given them, select) beside the whole call, and counts
each chunk's rows whose candidates missed [k, CAP] (the refilter kernel filters them again; `paths` counts the rows
the refilter served and those left to the full radix select; the thresholds are timed apart, as
SPLIT_T would run them; on the longest chunk, the select's stages alone: stream_floor.select_floor).
Then, on the longest chunk, a grid of (SAMPLES, RUN): the thresholds alone, their loads alone
(stream_floor.threshold_floor), and the rows each leaves outside [k, CAP]. Then the whole context's
top-k per FILTER variant (VARIANTS), each checked equal to the default's output. Last (`overlap`), the
whole context with every select in order against the selects on their own stream (indexer_topk's way).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

COPY_GBPS = 4240.0
THRESHOLD_GRID = [(4096, 8), (4096, 16), (4096, 32), (2048, 8), (2048, 16), (1024, 8), (1024, 16), (512, 8)]
# whole-context runs: changes to the default FILTER config (2048 samples inline since run 15). Runs
# 13-15 (H100): session 17's default (4096 samples, SPLIT_T) 8.66-8.76 ms; 2048 inline 7.40-7.51, 1024
# inline 7.39-7.85 (more rows refiltered), RUN 4 / 16 no better, thresholds apart at 2 warps 7.74-8.18,
# the select at 8 warps 7.85.
# Runs 16-17 (H200): 1024 samples and AIM_PCT 125-140 within ~4% at 64K (noise ~0.1 ms), worse at 128K;
# the select's rank over 16 keys the same, searching on to one key instead 19% slower (both removed).
# PAIR: the filter's two blocks a step.
VARIANTS = [{"PAIR": 0}, {"BLOCK": 512}, {"SAMPLES": 1024}]
PARTS = ("breakdown", "thresholds", "variants", "overlap")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    ns = ap.parse_args()
    parts = set(ns.parts.split(","))

    import torch

    from bench.gpu.stream_floor import SELECT_STAGES, select_floor, threshold_floor
    from bench.kernels import Timer
    from bench.machine import machine
    from kernels import indexer as ix
    from kernels import topk_filter as tf
    from kernels.topk import TOPK_CONFIGS, _radix_schedule

    dev = torch.device("cuda")
    timer = Timer(torch, dev)
    S = T = ns.context
    K, R = ns.topk, ns.rows
    cfg = next(c for c in TOPK_CONFIGS if "FILTER" in dict(c.params))
    p = dict(cfg.params)
    cap, samples, run = p["CAP"], p["SAMPLES"], p["RUN"]
    report: dict = {"machine": machine(), "what": __doc__.splitlines()[0], "context": S, "rows": R, "topk": K,
                    "config": cfg.describe(), "chunks": []}

    def save() -> None:
        ns.out.write_text(json.dumps(report, indent=1) + "\n")

    torch.manual_seed(0)
    q = torch.randn(R, 32, 128, device=dev).to(torch.bfloat16)
    k = torch.randn(S, 128, device=dev).to(torch.bfloat16)
    w = torch.randn(R, 32, device=dev) / 32
    scores = torch.empty((R, S), device=dev)
    ix.indexer_scores_chunk(q, k, w, 0, R, T - R, scores)  # the last chunk's rows, as the phase timing leaves them
    out = torch.full((T, K), -2, device=dev, dtype=torch.int32)
    shifts, masks = _radix_schedule(8, dev)
    totals = {"whole": 0.0, "thresholds": 0.0, "filter": 0.0, "select": 0.0, "fallback_rows": 0}
    all_bytes = 0.0
    for row0 in range(0, T, R):
        rows = min(R, T - row0)
        n = torch.clamp(torch.arange(rows, device=dev) + row0 + 1, max=S)
        all_bytes += float(4 * n[n > K].sum())
        if "breakdown" not in parts:
            continue
        whole = timer(lambda: ix.topk_rows_chunk(scores, row0, rows, 0, S, K, out, config=cfg), min_iters=5)
        entry = {"row0": row0, "max_keys": int(n.max()), "whole_ms": round(whole, 4)}
        if int(n.max()) > cap:
            th = tf.row_thresholds(scores, row0, rows, 0, S, K, samples=samples, run=run, cap=cap)
            fkw = dict(samples=samples, run=run, block=p["BLOCK"], cap=cap, warps=cfg.num_warps,
                       stages=cfg.num_stages, split_t=True, thresh=th)
            cand = tf.filter_rows(scores, row0, rows, 0, S, K, **fkw)
            torch.cuda.synchronize()
            long_rows = n > cap
            c = cand.counts[long_rows]  # after the refilter
            entry["fallback_rows"] = int(((c < K) | (c > cap)).sum())
            entry["candidates"] = {"mean": round(float(c.float().mean()), 1), "min": int(c.min()), "max": int(c.max())}
            entry["thresholds_ms"] = round(timer(lambda: tf.row_thresholds(
                scores, row0, rows, 0, S, K, samples=samples, run=run, cap=cap), min_iters=5), 4)
            entry["filter_ms"] = round(timer(lambda: tf.filter_rows(scores, row0, rows, 0, S, K, **fkw), min_iters=5), 4)
            tf.select_rows(scores, cand, row0, rows, 0, S, K, out, shifts, masks, radix_bits=8, warps=p["SELECT_WARPS"])
            entry["paths"] = {"refilter": int((cand.paths == 1).sum()), "full_select": int((cand.paths == 2).sum())}
            entry["select_ms"] = round(timer(lambda: tf.select_rows(scores, cand, row0, rows, 0, S, K, out, shifts,
                                                                    masks, radix_bits=8, warps=p["SELECT_WARPS"]),
                                             min_iters=5), 4)
            if row0 + rows == T:  # the longest chunk: the select's stages alone (stream_floor.select_floor)
                entry["select_stages_ms"] = {st: round(timer(lambda st=st: select_floor(
                    cand, rows, K, warps=p["SELECT_WARPS"], stage=st), min_iters=5), 4) for st in SELECT_STAGES}
            for key in ("thresholds", "filter", "select"):
                totals[key] += entry[f"{key}_ms"]
            totals["fallback_rows"] += entry["fallback_rows"]
        totals["whole"] += whole
        report["chunks"].append(entry)
        print(json.dumps(entry), flush=True)
        save()
    if "breakdown" in parts:
        report["totals_ms"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in totals.items()}
        report["read_fraction_of_copy"] = round(all_bytes / totals["whole"] / 1e6 / COPY_GBPS, 4)
        print("totals", report["totals_ms"], report["read_fraction_of_copy"], flush=True)
        save()

    row0, rows = T - R, R  # the longest chunk: thresholds per (SAMPLES, RUN)
    n = torch.clamp(torch.arange(rows, device=dev) + row0 + 1, max=S)
    for smp, rn in THRESHOLD_GRID if "thresholds" in parts else []:
        try:
            th = tf.row_thresholds(scores, row0, rows, 0, S, K, samples=smp, run=rn, cap=cap)
            cand = tf.filter_rows(scores, row0, rows, 0, S, K, samples=smp, run=rn, block=p["BLOCK"], cap=cap,
                                  warps=cfg.num_warps, stages=cfg.num_stages, split_t=True, thresh=th)
            torch.cuda.synchronize()
            c = cand.counts[n > cap]
            row = {"samples": smp, "run": rn,
                   "thresholds_ms": round(timer(lambda: tf.row_thresholds(
                       scores, row0, rows, 0, S, K, samples=smp, run=rn, cap=cap), min_iters=5), 4),
                   "loads_ms": round(timer(lambda: threshold_floor(
                       scores, row0, rows, 0, S, samples=smp, run=rn, cap=cap), min_iters=5), 4),
                   "fallback_rows": int(((c < K) | (c > cap)).sum()),
                   "candidates": {"mean": round(float(c.float().mean()), 1), "min": int(c.min()), "max": int(c.max())}}
        except Exception as exc:  # noqa: BLE001 -- a shape the compiler refuses is a finding
            row = {"samples": smp, "run": rn, "error": f"{type(exc).__name__}: {exc}"[:300]}
        report.setdefault("threshold_grid", []).append(row)
        print(json.dumps(row), flush=True)
        save()

    from kernels.topk import KernelConfig

    chunks = [(r0, min(R, T - r0)) for r0 in range(0, T, R)]
    ref = torch.full((T, K), -2, device=dev, dtype=torch.int32)
    for r0, rows in chunks:
        ix.topk_rows_chunk(scores, r0, rows, 0, S, K, ref, config=cfg)
    for change in [{}] + VARIANTS if "variants" in parts else []:
        params = {**p, **change}
        vcfg = KernelConfig.make(cfg.num_warps, cfg.num_stages, **params)
        got = torch.full((T, K), -2, device=dev, dtype=torch.int32)

        def whole(vcfg=vcfg, got=got):
            for r0, rows in chunks:
                ix.topk_rows_chunk(scores, r0, rows, 0, S, K, got, config=vcfg)

        try:
            whole()
            torch.cuda.synchronize()
            ms = timer(whole, min_iters=3)
            n_paths = [0, 0, 0]
            for r0, rows in chunks:  # untimed: which path each row took
                cand = tf.filter_rows(scores, r0, rows, 0, S, K, samples=params["SAMPLES"], run=params["RUN"],
                                      block=params["BLOCK"], cap=params["CAP"], warps=vcfg.num_warps,
                                      stages=vcfg.num_stages, split_t=True, t_warps=params.get("T_WARPS", 4),
                                      refilter=bool(params.get("REFILTER", 1)), aim=params.get("AIM_PCT", tf.AIM_PCT) / 100)
                tf.select_rows(scores, cand, r0, rows, 0, S, K, got, shifts, masks, radix_bits=8,
                               warps=params["SELECT_WARPS"])
                for i in range(3):
                    n_paths[i] += int((cand.paths == i).sum())
            row = {"change": change, "ms": round(ms, 4), "read_fraction_of_copy": round(all_bytes / ms / 1e6 / COPY_GBPS, 4),
                   "rows_same": int((got == ref).all(dim=1).sum()), "rows": T,
                   "paths": {"candidates": n_paths[0], "refilter": n_paths[1], "full_select": n_paths[2]}}
        except Exception as exc:  # noqa: BLE001
            row = {"change": change, "error": f"{type(exc).__name__}: {exc}"[:300]}
        report.setdefault("variants", []).append(row)
        print(json.dumps(row), flush=True)
        save()
    if "overlap" in parts:
        report["overlap"] = overlap_rows(torch, ix, timer, scores, chunks, S, K, cfg, ref)
        print(json.dumps(report["overlap"]), flush=True)
        save()
    return 0


def overlap_rows(torch, ix, timer, scores, chunks, S, K, cfg, ref) -> dict:
    """The whole context as the kernels benchmark times it, each chunk's select on the current stream
    (sequential) and on indexer.select_pipeline's stream (what indexer_topk does: the select, latency-bound, beside
    the next chunk's filter, bandwidth-bound), side by side."""
    result = {}
    for name, piped in (("sequential", False), ("select_stream", True)):
        got = torch.full(ref.shape, -2, device=ref.device, dtype=torch.int32)

        def whole(piped=piped, got=got):
            pipeline = ix.select_pipeline(scores.device) if piped else None
            for r0, rows in chunks:
                ix.topk_rows_chunk(scores, r0, rows, 0, S, K, got, config=cfg, pipeline=pipeline)
            if pipeline is not None:
                pipeline.join(scores.device)

        whole()
        torch.cuda.synchronize()
        result[name] = {"ms": round(timer(whole, min_iters=5), 4), "rows_same": int((got == ref).all(dim=1).sum())}
    return result

if __name__ == "__main__":
    sys.exit(main())
