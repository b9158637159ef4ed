"""Top-k configs side by side on one GPU: `python bench/gpu/topk_sweep.py --out X.json [--contexts 65536]`.

Scores: the indexer's own fp32 rows (random bf16 q, k; w / heads) of the last (longest) 4096-row
chunk of each context. For every config of kernels/topk.py's lists, and for a grid of filter-then-
select shapes (kernels/topk_filter.py) with the two phases also timed apart, it records the time,
the read rate of the rows' score bytes against the 4,240 GB/s copy rate, and whether every row's
selection equals the first config's (the full radix select). Then `indexer_topk` over the whole
context, the tuner restricted to the sampled configs (the fastest before) against the best filter shape, with the
score / top-k phase split the kernels benchmark reports (topk_read_fraction_of_copy).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

COPY_GBPS = 4240.0
# What each run found is in bench/results/topk_filter_gpu.json (a note per run) and kernels/README.md.
# Session 16's last grid: the filter with split and inline thresholds (stores by inline PTX, ASM), and
# tl.store's path beside the first (ASM False); the select at 4 and 8 warps.
FILTER_GRID = [  # (BLOCK, filter warps, filter stages, SAMPLES, RUN, SPLIT_T, ASM)
    (1024, 4, 3, 4096, 8, True, True), (1024, 4, 3, 4096, 8, False, True), (1024, 4, 3, 4096, 8, True, False),
]
SELECT_GRID = [(4096, 4), (4096, 8)]  # (CAP, select warps)
FILTER_CAP = 4096  # candidate slots per row in the filter grid


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--contexts", default="65536")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--pipeline", action="store_true", help="also time indexer_topk over the whole context")
    ap.add_argument("--fused", action="store_true", help="also time the fused impl's selects on the same rows")
    ap.add_argument("--search", choices=("model", "ternary"), default="model",
                    help="the searches' cuts: the tail model (the kernels' own) or thirds only (what it replaced: "
                         "run both on one machine to compare)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to try the script under TRITON_INTERPRET=1")
    ns = ap.parse_args()

    import torch

    from bench.kernel_cases import _indexer_phase_ms
    from bench.kernels import GLM52, Timer
    from bench.machine import machine
    from kernels import indexer as ix
    from kernels import topk_filter as tf
    from kernels.topk import TOPK_CONFIGS, TOPK_TUNER, KernelConfig, _radix_schedule

    if ns.search == "ternary":  # before any kernel compiles: Triton reads these module constants then
        import triton.language as tl

        from kernels import topk_common
        topk_common.MODEL_MISSES = tl.constexpr(0)  # every cut in thirds
        topk_common.LAST_KEYS = tl.constexpr(1)  # ... down to one key, as before the model cuts
    dev = torch.device(ns.device)
    timer = Timer(torch, dev)
    report: dict = {"machine": machine(), "what": __doc__.splitlines()[0], "search": ns.search, "contexts": []}

    def save() -> None:
        ns.out.write_text(json.dumps(report, indent=1) + "\n")

    for S in [int(c) for c in ns.contexts.split(",")]:
        T, K = S, ns.topk
        rows = min(ns.rows, T)
        row0 = T - rows
        torch.manual_seed(0)
        q = torch.randn(rows, 32, 128, device=dev).to(torch.bfloat16)
        k = torch.randn(S, 128, device=dev).to(torch.bfloat16)
        w = torch.randn(rows, 32, device=dev) / 32
        scores = torch.empty((rows, S), device=dev)
        # query rows row0.. of a T = S context: q's row r sits at key row0 + r, so in the top-k calls
        # the chunk starts at row0 with offset 0 (row r has row0 + r + 1 valid keys)
        ix.indexer_scores_chunk(q, k, w, 0, rows, row0, scores)
        n_valid = torch.clamp(torch.arange(rows, device=dev) + row0 + 1, max=S)
        read_bytes = float(4 * n_valid[n_valid > K].sum())
        entry: dict = {"context": S, "rows": rows, "topk": K, "row_bytes": read_bytes, "configs": []}
        report["contexts"].append(entry)
        ref = torch.full((T, K), -2, device=dev, dtype=torch.int32)
        ix.topk_rows_chunk(scores, row0, rows, 0, S, K, ref, config=TOPK_CONFIGS[0])

        def run(label, fn, **extra):
            out = torch.full((T, K), -2, device=dev, dtype=torch.int32)
            try:
                fn(out)
                torch.cuda.synchronize() if dev.type == "cuda" else None
                same = int((out[row0:] == ref[row0:]).all(dim=1).sum())
                ms = timer(lambda: fn(out), min_iters=5)
            except Exception as exc:  # noqa: BLE001 -- a config the compiler refuses is a finding
                entry["configs"].append({"config": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                print(label, "ERROR", exc, flush=True)
                save()
                return None
            row = {"config": label, "ms": round(ms, 4), "rows_same": same, "rows": rows,
                   "read_fraction_of_copy": round(read_bytes / ms / 1e6 / COPY_GBPS, 4), **extra}
            entry["configs"].append(row)
            print(json.dumps(row), flush=True)
            save()
            return row

        for cfg in TOPK_CONFIGS:
            run(cfg.describe(), lambda out, cfg=cfg: ix.topk_rows_chunk(scores, row0, rows, 0, S, K, out, config=cfg))

        # the filter's access pattern alone (bench/gpu/stream_floor.py): loads only, then loads + compare
        from bench.gpu.stream_floor import stream_floor
        for block, warps, stages, *_ in FILTER_GRID[:1]:
            for count in (0, 1):
                kw = dict(block=block, warps=warps, stages=stages, count=count)
                try:
                    stream_floor(scores, row0, rows, 0, S, **kw)
                    ms = timer(lambda kw=kw: stream_floor(scores, row0, rows, 0, S, **kw), min_iters=5)
                except Exception as exc:  # noqa: BLE001
                    entry.setdefault("stream_floor", []).append({**kw, "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                entry.setdefault("stream_floor", []).append(
                    {**kw, "ms": round(ms, 4), "read_fraction_of_copy": round(read_bytes / ms / 1e6 / COPY_GBPS, 4)})
                print("floor", kw, ms, flush=True)
                save()

        shifts8, masks8 = _radix_schedule(8, dev)
        best_filter = None
        for block, warps, stages, samples, run_len, split_t, asm in FILTER_GRID:
            kw = dict(samples=samples, run=run_len, block=block, cap=FILTER_CAP, warps=warps, stages=stages,
                      split_t=split_t, asm_store=asm)
            try:
                counts = tf.filter_rows(scores, row0, rows, 0, S, K, **kw).counts
                torch.cuda.synchronize() if dev.type == "cuda" else None
                f_ms = timer(lambda kw=kw: tf.filter_rows(scores, row0, rows, 0, S, K, **kw), min_iters=5)
            except Exception as exc:  # noqa: BLE001
                entry["configs"].append({"config": f"filter {kw}", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            long_rows = n_valid > FILTER_CAP
            filtered = counts[long_rows].float()
            cand_stats = {"rows_filtered": filtered.numel()}
            if filtered.numel():
                cand_stats.update(mean=round(float(filtered.mean()), 1), max=int(filtered.max()), min=int(filtered.min()),
                                  fallback_rows=int(((filtered < K) | (filtered > FILTER_CAP)).sum()))
            label = (f"FILTER block={block} warps={warps} stages={stages} samples={samples} run={run_len} "
                     f"split_t={int(split_t)} asm={int(asm)} cap={FILTER_CAP} sel_warps={SELECT_GRID[0][1]}")
            row = run(label, lambda out, kw=kw, asm=asm: tf.select_rows(
                scores, tf.filter_rows(scores, row0, rows, 0, S, K, **kw), row0, rows, 0, S, K, out,
                shifts8, masks8, radix_bits=8, warps=SELECT_GRID[0][1], asm_store=asm),
                filter_ms=round(f_ms, 4), candidates=cand_stats)
            if asm and row and row["rows_same"] == rows and (best_filter is None or row["ms"] < best_filter[0]):
                best_filter = (row["ms"], kw)
        if best_filter is not None:  # the best shape's phases alone, and the select's floors beside it
            from bench.gpu.stream_floor import select_floor
            kw = best_filter[1]
            tkw = dict(samples=kw["samples"], run=kw["run"], cap=kw["cap"])
            th = tf.row_thresholds(scores, row0, rows, 0, S, K, **tkw)
            cand = tf.filter_rows(scores, row0, rows, 0, S, K, **{**kw, "split_t": True}, thresh=th)
            out = torch.full((T, K), -2, device=dev, dtype=torch.int32)
            phases = {
                "thresholds": timer(lambda: tf.row_thresholds(scores, row0, rows, 0, S, K, **tkw), min_iters=5),
                "filter_given_thresholds": timer(lambda: tf.filter_rows(
                    scores, row0, rows, 0, S, K, **{**kw, "split_t": True}, thresh=th), min_iters=5),
                "select": timer(lambda: tf.select_rows(scores, cand, row0, rows, 0, S, K, out, shifts8, masks8,
                                                       radix_bits=8, warps=4), min_iters=5),
                "select_floor_load": timer(lambda: select_floor(cand, rows, K, warps=4, stage="load"), min_iters=5),
                "select_floor_search": timer(lambda: select_floor(cand, rows, K, warps=4, stage="kth"), min_iters=5),
            }
            entry["phases_ms"] = {k: round(v, 4) for k, v in phases.items()}
            print("phases", entry["phases_ms"], flush=True)
            save()
            for cap, sw in SELECT_GRID:
                kwc = {**kw, "cap": cap}
                cand = tf.filter_rows(scores, row0, rows, 0, S, K, **kwc)
                out = torch.full((T, K), -2, device=dev, dtype=torch.int32)
                try:
                    tf.select_rows(scores, cand, row0, rows, 0, S, K, out, shifts8, masks8, radix_bits=8, warps=sw)
                    s_ms = timer(lambda: tf.select_rows(scores, cand, row0, rows, 0, S, K, out, shifts8, masks8,
                                                        radix_bits=8, warps=sw), min_iters=5)
                except Exception as exc:  # noqa: BLE001
                    entry.setdefault("select", []).append({"cap": cap, "warps": sw,
                                                           "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                same = int((out[row0:] == ref[row0:]).all(dim=1).sum())
                entry.setdefault("select", []).append({"cap": cap, "warps": sw, "asm": True,
                                                       "ms": round(s_ms, 4), "rows_same": same, "filter": kwc})
                print("select", cap, sw, s_ms, same, flush=True)
                save()

        # the fused impl's select (kernels/indexer_fused.py) on the same rows: each select config,
        # after its thresholds and candidate phases (its candidates: survivors of the scoring tiles)
        if ns.fused:
            from kernels import indexer_fused as fx
            job = fx.FusedIndexerTopk(q, k, w, K, row0, rows)
            job.thresholds(0, rows)
            job.candidates(0, rows)
            torch.cuda.synchronize() if dev.type == "cuda" else None
            counts = job.count[:rows].float()
            entry["fused_candidates"] = {"mean": round(float(counts.mean()), 1), "max": int(counts.max())}
            for cfg in fx.FUSED_SELECT_CONFIGS:
                fx.FUSED_SELECT_TUNER.configs = [cfg]
                fx.FUSED_SELECT_TUNER.records.clear()
                job.out.fill_(-2)
                job.select(0, rows)
                same = int((job.out[:rows] == ref[row0:]).all(dim=1).sum())
                ms = timer(lambda: job.select(0, rows), min_iters=5)
                entry.setdefault("fused_select", []).append({"config": cfg.describe(), "ms": round(ms, 4), "rows_same": same})
                print("fused select", cfg.describe(), ms, same, flush=True)
                save()
            fx.FUSED_SELECT_TUNER.configs = list(fx.FUSED_SELECT_CONFIGS)
            fx.FUSED_SELECT_TUNER.records.clear()

        if ns.pipeline and best_filter is not None:
            kw = best_filter[1]
            sel = min((e for e in entry.get("select", []) if "ms" in e and e["rows_same"] == rows),
                      key=lambda e: e["ms"], default={"cap": 4096, "warps": 4})
            fcfg = KernelConfig.make(FILTER=1, SPLIT_T=int(kw["split_t"]),
                                     SAMPLES=kw["samples"], RUN=kw["run"],
                                     BLOCK=kw["block"],
                                     CAP=sel["cap"], RADIX_BITS=8, SELECT_WARPS=sel["warps"],
                                     num_warps=kw["warps"], num_stages=kw["stages"])
            qf = torch.randn(T, 32, 128, device=dev).to(torch.bfloat16)
            wf = torch.randn(T, 32, device=dev) / 32
            valid = torch.clamp(torch.arange(T, device=dev) + 1, max=S)
            all_bytes = float(4 * valid[valid > K].sum())
            outs = {}
            sampled = [c for c in TOPK_CONFIGS if "SAMPLES" in dict(c.params) and "FILTER" not in dict(c.params)]
            for name, configs in (("sampled", sampled), ("filter", [fcfg])):
                TOPK_TUNER.configs = configs
                TOPK_TUNER.records.clear()
                outs[name] = ix.indexer_topk(qf, k, wf, K, chunk_rows=4096)
                score_ms, topk_ms = _indexer_phase_ms(torch, dev, qf, k, wf, dataclasses.replace(GLM52, topk=K), timer)
                total = timer(lambda: ix.indexer_topk(qf, k, wf, K, chunk_rows=4096), min_iters=2)
                entry.setdefault("pipeline", {})[name] = {
                    "ms": round(total, 3), "score_ms": round(score_ms, 3), "topk_ms": round(topk_ms, 3),
                    "topk_read_fraction_of_copy": round(all_bytes / topk_ms / 1e6 / COPY_GBPS, 4),
                    "tuned": TOPK_TUNER.summary()}
                print(name, entry["pipeline"][name]["ms"], score_ms, topk_ms, flush=True)
                save()
            entry["pipeline"]["outputs_equal"] = bool(torch.equal(outs["sampled"], outs["filter"]))
            TOPK_TUNER.configs = list(TOPK_CONFIGS)
            TOPK_TUNER.records.clear()
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
