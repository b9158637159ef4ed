"""One benchmark case per kernel family, used by bench/kernels.py.

Each case builds inputs at the given shapes, checks the kernel against its torch reference on a
slice that fits in memory, times kernel and reference, and yields report entries (see
``make_entry``). FLOP and byte counts are the minimum work: they are what the entries' rates
and ceiling fractions are computed from.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Ceilings (REFERENCE.md section 7, measured on the project's H200): bf16 GEMM 799 TFLOP/s,
# fp8 GEMM 1458 TFLOP/s, device copy 4.24 TB/s.
CEILINGS = {"bf16_tflops": 799.0, "fp8_tflops": 1458.0, "copy_gbps": 4240.0}


def make_entry(name: str, shape: dict, ms: float, *, flops: float | None = None, nbytes: float | None = None,
               ceiling: str = "bf16_tflops", reference_ms: float | None = None, correct: bool | None = None,
               **extra: Any) -> dict:
    """One report entry: the time, the rate from the minimum FLOPs (or bytes) and its fraction of
    the ceiling, and the speedup over the torch reference."""
    entry: dict[str, Any] = {"name": name, "shape": shape, "ms": round(ms, 4)}
    if flops is not None:
        entry["tflops"] = round(flops / ms / 1e9, 2)
        entry["fraction_of_ceiling"] = round(entry["tflops"] / CEILINGS[ceiling], 4)
    else:
        entry["gbps"] = round(nbytes / ms / 1e6, 1)
        entry["fraction_of_ceiling"] = round(entry["gbps"] / CEILINGS["copy_gbps"], 4)
    entry["ceiling"] = ceiling if flops is not None else "copy_gbps"
    entry["reference_ms"] = None if reference_ms is None else round(reference_ms, 4)
    entry["speedup"] = None if reference_ms is None else round(reference_ms / ms, 3)
    entry["correct"] = correct
    entry.update(extra)
    return entry


def _rel(torch, a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def bench_logprobs(torch, dev, sh, timer) -> Iterator[dict]:
    from kernels.logprobs import fused_logprobs
    from kernels.logprobs_torch import chunked_logprobs, reference_logprobs

    T, H, V = sh.lp_tokens, sh.hidden, sh.vocab
    shape = {"tokens": T, "hidden": H, "vocab": V, "dtype": "bf16"}
    hidden = torch.randn(T, H, device=dev).to(torch.bfloat16)
    weight = (torch.randn(V, H, device=dev) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, V, (T,), device=dev)
    n = min(sh.check_rows, T)
    with torch.no_grad():
        logp = fused_logprobs(hidden, weight, targets)
        ref = reference_logprobs(hidden[:n], weight, targets[:n])
        err = float((logp[:n] - ref).abs().max())
        ms = timer(lambda: fused_logprobs(hidden, weight, targets))
        ref_ms = timer(lambda: chunked_logprobs(hidden, weight, targets, chunk_tokens=2048), min_iters=2)
    yield make_entry("logprobs_fwd", shape, ms, flops=2.0 * T * V * H, reference_ms=ref_ms,
                     correct=err < 1e-2, max_abs_err_vs_fp32=err, reference="chunked_logprobs (torch, bf16 GEMM)")

    # forward with entropy + backward (grad wrt hidden and weight): 2 + 2 (recompute) + 4 (two GEMMs)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    g_lp = torch.randn(T, device=dev)
    g_ent = torch.randn(T, device=dev) * 0.1

    def step(fn):
        lp, ent = fn(h, w, targets, return_entropy=True)
        gh, gw = torch.autograd.grad([lp, ent], [h, w], [g_lp, g_ent])
        return lp.detach(), ent.detach(), gh, gw

    fused = step(fused_logprobs)
    chunk = step(lambda *a, **k: chunked_logprobs(*a, chunk_tokens=2048, **k))
    with torch.no_grad():  # values vs the fp32 definition (the bf16 torch path rounds its logits)
        ref_lp, ref_ent = reference_logprobs(hidden[:n], weight, targets[:n], return_entropy=True)
    errs = {"logp_abs_vs_fp32": float((fused[0][:n] - ref_lp).abs().max()),
            "entropy_abs_vs_fp32": float((fused[1][:n] - ref_ent).abs().max()),
            "logp_abs_vs_chunked_bf16": float((fused[0] - chunk[0]).abs().max()),
            "grad_hidden_rel": _rel(torch, fused[2], chunk[2]), "grad_weight_rel": _rel(torch, fused[3], chunk[3])}
    del fused, chunk
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    ms = timer(lambda: step(fused_logprobs), min_iters=2)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    ref_ms = timer(lambda: step(lambda *a, **k: chunked_logprobs(*a, chunk_tokens=2048, **k)), min_iters=2)
    ok = errs["logp_abs_vs_fp32"] < 1e-2 and errs["entropy_abs_vs_fp32"] < 1e-2 and max(
        errs["grad_hidden_rel"], errs["grad_weight_rel"]) < 3e-2
    yield make_entry("logprobs_entropy_fwd_bwd", shape, ms, flops=8.0 * T * V * H, reference_ms=ref_ms,
                     correct=ok, errors=errs, peak_memory_gb=peak,
                     reference="chunked_logprobs fwd+bwd (torch autograd, checkpointed)")


def _indexer_inputs(torch, dev, sh, ctx):
    q = torch.randn(ctx, sh.idx_heads, sh.idx_dim, device=dev).to(torch.bfloat16)
    k = torch.randn(ctx, sh.idx_dim, device=dev).to(torch.bfloat16)
    w = torch.randn(ctx, sh.idx_heads, device=dev) / sh.idx_heads
    return q, k, w


def _indexer_phase_ms(torch, dev, q, k, w, sh, timer):
    """Time the scoring kernel and the top-k kernel separately, over all chunks."""
    from kernels import indexer as ix

    T = S = q.shape[0]
    rows = min(sh.idx_chunk_rows, T)
    scores = torch.empty((rows, S), device=dev, dtype=torch.float32)
    out = torch.empty((T, sh.topk), device=dev, dtype=torch.int32)
    chunks = [(r0, min(rows, T - r0)) for r0 in range(0, T, rows)]

    def score_all():
        for r0, n in chunks:
            ix.indexer_scores_chunk(q, k, w, r0, n, 0, scores)

    def topk_all():  # the buffer holds the last chunk's scores: every read entry was written
        pipeline = ix.select_pipeline(dev)  # as indexer_topk runs them: the selects on their own stream
        for r0, n in chunks:
            ix.topk_rows_chunk(scores, r0, n, 0, S, sh.topk, out, pipeline=pipeline)
        if pipeline is not None:
            pipeline.join(dev)

    score_all()
    return timer(score_all, min_iters=2), timer(topk_all, min_iters=2)


def bench_indexer(torch, dev, sh, timer) -> Iterator[dict]:
    first = None
    for i, ctx in enumerate(sh.idx_contexts):
        entry = _bench_indexer_one(torch, dev, sh, timer, ctx, with_reference=(i == 0))
        first = first or entry
        yield entry
        if i == 0:
            yield _bench_topk_variants(torch, dev, sh, timer, ctx)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    # last: the untimed impl="fused" cannot take the default's entries down with it if it faults
    yield _bench_indexer_fused(torch, dev, sh, timer, sh.idx_contexts[0], first)


def _bench_topk_variants(torch, dev, sh, timer, ctx) -> dict:
    """Every top-k config, the default list and the experimental one (segment-parallel, sampled
    threshold), timed on the same last-chunk scores and checked for the same selection as the
    first default config (all variants are exact; ties go to the lower index in each)."""
    from kernels import indexer as ix
    from kernels.topk import EXPERIMENTAL_TOPK_CONFIGS, TOPK_CONFIGS

    T = S = ctx
    q, k, w = _indexer_inputs(torch, dev, sh, ctx)
    rows = min(sh.idx_chunk_rows, T)
    r0 = T - rows  # the longest rows: every one reads about S keys
    scores = torch.empty((rows, S), device=dev, dtype=torch.float32)
    ix.indexer_scores_chunk(q, k, w, r0, rows, 0, scores)
    ref = torch.empty((T, sh.topk), device=dev, dtype=torch.int32)
    ix.topk_rows_chunk(scores, r0, rows, 0, S, sh.topk, ref, config=TOPK_CONFIGS[0])
    want = ref[r0:].sort(dim=1).values
    read_bytes = 4.0 * sum(min(r + 1, S) for r in range(r0, T))
    variants = []
    for cfg in TOPK_CONFIGS + EXPERIMENTAL_TOPK_CONFIGS:
        out = torch.full((T, sh.topk), -2, device=dev, dtype=torch.int32)
        try:
            ix.topk_rows_chunk(scores, r0, rows, 0, S, sh.topk, out, config=cfg)
            ms = timer(lambda cfg=cfg, out=out: ix.topk_rows_chunk(scores, r0, rows, 0, S, sh.topk, out, config=cfg),
                       min_iters=3)
        except Exception as exc:  # noqa: BLE001 - one config that fails to compile is recorded, not fatal
            variants.append({"config": cfg.describe(), "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        same = int((out[r0:].sort(dim=1).values == want).all(dim=1).sum())
        variants.append({"config": cfg.describe(), "experimental": cfg in EXPERIMENTAL_TOPK_CONFIGS,
                         "ms": round(ms, 3), "rows_same_as_default": same, "rows": rows,
                         "read_fraction_of_copy": round(read_bytes / ms / 1e6 / 4240.0, 4)})
    timed = [v for v in variants if "ms" in v]
    best = min(timed, key=lambda v: v["ms"]) if timed else None
    return {"name": "indexer_topk_variants", "shape": {"rows": rows, "context": S, "topk": sh.topk},
            "ms": best["ms"] if best else None, "best": best, "variants": variants,
            "correct": bool(timed) and all(v["rows_same_as_default"] == rows for v in timed),
            "note": "one chunk of the longest rows; read_fraction_of_copy = score bytes read / ms "
                    "against the H200's measured 4,240 GB/s copy rate"}


def _bench_indexer_fused(torch, dev, sh, timer, ctx, default: dict) -> dict:
    """impl="fused" (no score rows written) at the default entry's shapes, beside its time and its torch
    baseline (same run); every row must equal the default impl's. Its top-k share is the pipeline time
    minus the default's scoring phase, so topk_read_fraction_of_copy compares with the default's."""
    from kernels import indexer_fused as fx
    from kernels.indexer import indexer_topk

    T = S = ctx
    q, k, w = _indexer_inputs(torch, dev, sh, ctx)
    want = indexer_topk(q, k, w, sh.topk, chunk_rows=sh.idx_chunk_rows)
    stats: dict = {}
    got = fx.indexer_topk_fused(q, k, w, sh.topk, 0, sh.idx_chunk_rows, stats=stats)
    same = int((got == want).all(dim=1).sum())
    del got, want
    ms = timer(lambda: indexer_topk(q, k, w, sh.topk, chunk_rows=sh.idx_chunk_rows, impl="fused"), min_iters=2)
    job = fx.FusedIndexerTopk(q, k, w, sh.topk, 0, sh.idx_chunk_rows)
    r0, rows = job.chunks()[0]  # the longest rows
    phases = {name: round(timer(lambda f=fn: f(r0, rows), min_iters=2), 3)  # in order: each needs the last
              for name, fn in (("thresholds", job.thresholds), ("candidates", job.candidates),
                               ("select", job.select))}
    counts = job.count[:rows].float()
    valid = torch.arange(1, T + 1, dtype=torch.float64).clamp(max=S)
    read_bytes = float(4 * valid[valid > sh.topk].sum())
    topk_ms = ms - default["score_ms"]
    return make_entry(
        "indexer_topk_fused", {"tokens": T, "context": S, "heads": sh.idx_heads, "dim": sh.idx_dim, "topk": sh.topk},
        ms, flops=2.0 * sh.idx_heads * sh.idx_dim * T * (T + 1) / 2, reference_ms=default["reference_ms"],
        correct=same == T, impl="fused", rows_same_as_default=same, fallback_rows=stats["fallback_rows"],
        default_ms=default["ms"], speedup_over_default=round(default["ms"] / ms, 3), phase_ms_last_chunk=phases,
        candidates_per_row_last_chunk={"mean": round(float(counts.mean()), 1), "max": int(counts.max())},
        topk_ms_effective=round(topk_ms, 3),
        topk_read_fraction_of_copy=round(read_bytes / topk_ms / 1e6 / 4240.0, 4) if topk_ms > 0 else None,
        scratch_bytes={"fused": job.ckey.numel() * 8 + job.samp.numel() * 4,
                       "default": min(sh.idx_chunk_rows, T) * S * 4},
        reference="torch: bf16 GEMM scores per 256-row chunk + torch.topk (timed in the indexer_topk entry)",
        note="topk_ms_effective = this pipeline - the default's scoring phase (which also writes the scores); "
             "read fraction: the default's score bytes over it, against the 4,240 GB/s copy rate")


def _bench_indexer_one(torch, dev, sh, timer, ctx, with_reference) -> dict:
    from kernels.indexer import indexer_topk
    from kernels.indexer_torch import reference_indexer_topk

    T = S = ctx
    shape = {"tokens": T, "context": S, "heads": sh.idx_heads, "dim": sh.idx_dim, "topk": sh.topk}
    q, k, w = _indexer_inputs(torch, dev, sh, ctx)
    out = indexer_topk(q, k, w, sh.topk, chunk_rows=sh.idx_chunk_rows)
    ms = timer(lambda: indexer_topk(q, k, w, sh.topk, chunk_rows=sh.idx_chunk_rows), min_iters=2)
    score_ms, topk_ms = _indexer_phase_ms(torch, dev, q, k, w, sh, timer)
    # correctness: the longest rows and the first rows past the k boundary, vs the fp32 reference
    n = min(sh.check_rows, T)
    picks = [(T - n, n), (sh.topk - 8, min(16, T - sh.topk + 8))] if T > sh.topk else [(0, T)]
    exact = total = 0
    worst = 0
    for r0, cnt in picks:
        ref = reference_indexer_topk(q[r0:r0 + cnt], k, w[r0:r0 + cnt], sh.topk, offset=r0, chunk_rows=32)
        for a, b in zip(out[r0:r0 + cnt].tolist(), ref.tolist()):
            diff = len(set(a) ^ set(b))
            exact += diff == 0
            worst = max(worst, diff)
            total += 1
    causal_pairs = T * (T + 1) / 2
    valid = torch.arange(1, T + 1, dtype=torch.float64).clamp(max=S)
    read_bytes = float(4 * valid[valid > sh.topk].sum())  # rows with <= k keys read nothing
    ref_ms = None
    if with_reference:
        ref_ms = timer(lambda: reference_indexer_topk(q, k, w, sh.topk, chunk_rows=256, stable=False,
                                                      fast=True), warmup=1, min_iters=1, max_iters=1)
    return make_entry(
        "indexer_topk", shape, ms, flops=2.0 * sh.idx_heads * sh.idx_dim * causal_pairs, reference_ms=ref_ms,
        correct=(exact / total >= 0.9 and worst <= 4), rows_checked=total, rows_exact=exact,
        worst_row_set_difference=worst, score_ms=round(score_ms, 3), topk_ms=round(topk_ms, 3),
        score_tflops=round(2.0 * sh.idx_heads * sh.idx_dim * causal_pairs / score_ms / 1e9, 2),
        topk_read_gbps=round(read_bytes / topk_ms / 1e6, 1),
        topk_read_fraction_of_copy=round(read_bytes / topk_ms / 1e6 / 4240.0, 4),
        reference=None if ref_ms is None else "torch: bf16 GEMM scores per 256-row chunk + torch.topk",
        note="tflops counts causal scoring FLOPs over the whole pipeline time")


def bench_sparse_mla(torch, dev, sh, timer) -> Iterator[dict]:
    # the long context gathers from HBM (75 MB of latents); the short one is L2-resident (9.4 MB)
    for S in (sh.mla_context, min(sh.mla_context, 8192)):
        yield _bench_sparse_mla_one(torch, dev, sh, timer, S)
        if S <= 8192:
            break


def _bench_sparse_mla_one(torch, dev, sh, timer, S) -> dict:
    from kernels.sparse_mla import (
        GLUON_FWD_IMPLS,
        default_forward_impl,
        default_sm_scale,
        gluon_runs,
        reference_sparse_mla,
        sparse_mla_flops,
        sparse_mla_forward,
    )

    T, Hh, dv, dr, K = sh.mla_tokens, sh.mla_heads, sh.mla_dv, sh.mla_dr, sh.topk
    shape = {"tokens": T, "context": S, "heads": Hh, "d_qk": dv + dr, "d_v": dv, "topk": K}
    q = torch.randn(T, Hh, dv + dr, device=dev).to(torch.bfloat16)
    kv = torch.randn(S, dv + dr, device=dev).to(torch.bfloat16)
    idx = torch.randint(0, S, (T, K), device=dev, dtype=torch.int32).sort(dim=1).values
    scale = default_sm_scale()
    out, lse = sparse_mla_forward(q, kv, idx, scale, d_v=dv)
    n = min(sh.check_rows, T)
    ref_out, ref_lse = reference_sparse_mla(q[:n], kv, idx[:n], scale, d_v=dv, chunk_tokens=64)
    err_out = float((out[:n].float() - ref_out.float()).abs().max())
    err_lse = float((lse[:n] - ref_lse).abs().max())
    ms = timer(lambda: sparse_mla_forward(q, kv, idx, scale, d_v=dv))
    # the Triton kernel beside the default (the Gluon one where it runs), same inputs
    triton_ms = timer(lambda: sparse_mla_forward(q, kv, idx, scale, d_v=dv, impl="triton"))
    default = default_forward_impl(q, kv, dv)
    others = {}  # every other Gluon kernel that runs here, checked and timed on the same inputs
    for impl in GLUON_FWD_IMPLS if gluon_runs(q, kv, dv) else ():
        if impl == default:
            continue
        o_out, o_lse = sparse_mla_forward(q, kv, idx, scale, d_v=dv, impl=impl)
        o_err = float((o_out[:n].float() - ref_out.float()).abs().max())
        o_ms = timer(lambda impl=impl: sparse_mla_forward(q, kv, idx, scale, d_v=dv, impl=impl))
        others[impl] = {"ms": round(o_ms, 4), "tflops": round(sparse_mla_flops(T, Hh, K, dv, dr) / o_ms / 1e9, 1),
                        "speedup_over_default": round(ms / o_ms, 3), "max_abs_err_out": o_err,
                        "correct": o_err < 3e-2 and float((o_lse[:n] - ref_lse).abs().max()) < 1e-2}
    ref_ms = timer(lambda: reference_sparse_mla(q, kv, idx, scale, d_v=dv, chunk_tokens=256), min_iters=1,
                   max_iters=2)
    return make_entry("sparse_mla_fwd", shape, ms, flops=sparse_mla_flops(T, Hh, K, dv, dr), reference_ms=ref_ms,
                     impl=default, other_impls=others, triton_ms=round(triton_ms, 4),
                     speedup_over_triton=round(triton_ms / ms, 3),
                     correct=err_out < 3e-2 and err_lse < 1e-2, max_abs_err_out=err_out, max_abs_err_lse=err_lse,
                     flop_formula="2 * tokens * heads * topk * (d_qk + d_v)",
                     reference="torch gather + fp32 einsum softmax, 256-token chunks",
                     gathered_gbps=round(T * K * (dv + dr) * 2 / ms / 1e6, 1))


# (entry name, impl): the default first (DEFAULT_BWD_IMPL), then the others on the same inputs,
# each with its speedup over the first
BWD_VARIANTS = (("sparse_mla_bwd", "split"), ("sparse_mla_bwd_atomic", "atomic"),
                ("sparse_mla_bwd_keymajor", "keymajor"))


def bench_sparse_mla_bwd(torch, dev, sh, timer) -> Iterator[dict]:
    """Every backward variant (BWD_VARIANTS) on the same inputs, each checked against the fp32
    autograd; keymajor also reports its index inversion's time, split the time of its two passes."""
    from kernels.sparse_mla import default_sm_scale, reference_sparse_mla, sparse_mla_forward
    from kernels.sparse_mla_bwd import DEFAULT_BWD_IMPL, _delta, sparse_mla_backward, sparse_mla_bwd_flops
    from kernels.sparse_mla_bwd_keymajor import DKV_TUNER, invert_topk, tuning_keys
    from kernels.sparse_mla_bwd_split import DKV_TUNER as SPLIT_DKV_TUNER
    from kernels.sparse_mla_bwd_split import DQ_TUNER as SPLIT_DQ_TUNER
    from kernels.sparse_mla_bwd_dkv_gluon import SCHEDULE as DKV_SCHEDULE
    from kernels.sparse_mla_bwd_gluon import SCHEDULE as DQ_SCHEDULE
    from kernels.sparse_mla_bwd_split import default_dkv_impl, default_dq_impl, split_backward
    from kernels.sparse_mla_bwd_split import tuning_key as split_key

    T, S, Hh, dv, dr, K = sh.mla_tokens, sh.mla_context, sh.mla_heads, sh.mla_dv, sh.mla_dr, sh.topk
    shape = {"tokens": T, "context": S, "heads": Hh, "d_qk": dv + dr, "d_v": dv, "topk": K}
    q = torch.randn(T, Hh, dv + dr, device=dev).to(torch.bfloat16)
    kv = torch.randn(S, dv + dr, device=dev).to(torch.bfloat16)
    idx = torch.randint(0, S, (T, K), device=dev, dtype=torch.int32).sort(dim=1).values
    dout = torch.randn(T, Hh, dv, device=dev).to(torch.bfloat16)
    scale = default_sm_scale()
    out, lse = sparse_mla_forward(q, kv, idx, scale, d_v=dv)
    n = min(sh.check_rows, T)
    qr, kvr = q[:n].float().requires_grad_(), kv.float().requires_grad_()
    ref_out, _ = reference_sparse_mla(qr, kvr, idx[:n], scale, d_v=dv, chunk_tokens=64)
    ref_out.backward(dout[:n].float())
    ref_dq, ref_dkv = qr.grad, kvr.grad
    del qr, kvr, ref_out

    def ref_step():
        qa, kva = q.float().requires_grad_(), kv.float().requires_grad_()
        for s0 in range(0, T, 512):  # per chunk, so the gathered fp32 graph stays small
            o, _ = reference_sparse_mla(qa[s0:s0 + 512], kva, idx[s0:s0 + 512], scale, d_v=dv, chunk_tokens=256)
            o.backward(dout[s0:s0 + 512].float())

    ref_ms = timer(ref_step, warmup=0, min_iters=1, max_iters=1) if dev.type == "cuda" else None
    flops = sparse_mla_bwd_flops(T, Hh, K, dv, dr)
    if BWD_VARIANTS[0][1] != DEFAULT_BWD_IMPL:
        raise RuntimeError(f"BWD_VARIANTS must start with the default impl {DEFAULT_BWD_IMPL!r}")
    first_ms = None
    for name, impl in BWD_VARIANTS:
        def step(impl=impl, rows=T):
            return sparse_mla_backward(q[:rows], kv, idx[:rows], out[:rows], lse[:rows], dout[:rows], scale, dv,
                                       impl=impl)
        step()  # tune
        dq, dkv = step(rows=n)
        errs = {"dq_rel": _rel(torch, dq, ref_dq), "dkv_rel": _rel(torch, dkv, ref_dkv)}
        del dq, dkv
        ms = timer(step)
        first_ms = ms if first_ms is None else first_ms
        extra: dict[str, Any] = {"impl": impl, "speedup_over_default": round(first_ms / ms, 3)}
        if impl == "keymajor":
            block_k = DKV_TUNER.records[tuning_keys(q, kv, idx)[1]].best["BLOCK_K"]  # the tuned one
            inv = invert_topk(idx, S, block_k)
            extra.update(inversion_ms=round(timer(lambda bk=block_k: invert_topk(idx, S, bk)), 4),
                         inversion_block_k=block_k, key_block_token_pairs=int(inv.pair_tok.numel()))
            del inv
        if impl == "split":
            pass_ms: dict[str, float] = {}
            delta = _delta(dout, out)
            split_backward(q, kv, idx, dout, lse, delta, scale, dv, pass_ms=pass_ms)
            key = split_key(q, idx)
            dq_impl, dkv_impl = default_dq_impl(q, kv, dv), default_dkv_impl(q, kv, dv)
            tri_ms = pass_ms  # both Triton passes on the same inputs, in the same process (run already if default)
            if (dq_impl, dkv_impl) != ("triton", "triton"):
                tri_ms = {}
                split_backward(q, kv, idx, dout, lse, delta, scale, dv, dq_impl="triton", dkv_impl="triton")  # tunes
                split_backward(q, kv, idx, dout, lse, delta, scale, dv, pass_ms=tri_ms, dq_impl="triton",
                               dkv_impl="triton")

            def gluon(schedule: dict) -> str:
                return "gluon: " + ",".join(f"{k}={v}" for k, v in schedule.items())
            extra.update(pass_ms={k: round(v, 4) for k, v in pass_ms.items()},
                         delta_ms=round(timer(lambda: _delta(dout, out)), 4), dq_impl=dq_impl, dkv_impl=dkv_impl,
                         configs={"dq": gluon(DQ_SCHEDULE) if dq_impl == "gluon"
                                  else SPLIT_DQ_TUNER.records[key].best.describe(),
                                  "dkv": gluon(DKV_SCHEDULE) if dkv_impl == "gluon"
                                  else SPLIT_DKV_TUNER.records[key].best.describe()},
                         triton_pass_ms={k: round(v, 4) for k, v in tri_ms.items()},
                         triton_configs={"dq": SPLIT_DQ_TUNER.records[key].best.describe(),
                                         "dkv": SPLIT_DKV_TUNER.records[key].best.describe()},
                         pass_speedup_over_triton={k: round(tri_ms[k] / pass_ms[k], 3) for k in pass_ms})
        yield make_entry(name, shape, ms, flops=flops, reference_ms=ref_ms, correct=max(errs.values()) < 2e-2,
                         errors=errs, flop_formula="2 * tokens * heads * topk * (3 * d_qk + 2 * d_v)",
                         reference="torch autograd of gather + fp32 einsum softmax, 512-token chunks", **extra)


def bench_fp8(torch, dev, sh, timer) -> Iterator[dict]:
    from kernels import fp8_quant as fq

    M, N = sh.quant_shape
    shape = {"rows": M, "cols": N, "block": 128}
    w = (torch.randn(M, N, device=dev) * 0.02).to(torch.bfloat16)
    q, s = fq.fp8_block_quant(w)
    rq, rs = fq.reference_fp8_block_quant(w)
    ok = bool(torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs))
    del rq, rs
    nbytes = 3.0 * M * N + 4.0 * s.numel()
    ms = timer(lambda: fq.fp8_block_quant(w))
    ref_ms = timer(lambda: fq.reference_fp8_block_quant(w), min_iters=2)
    yield make_entry("fp8_block_quant", shape, ms, nbytes=nbytes, reference_ms=ref_ms, correct=ok,
                     check="bitwise equal codes and scales", bytes_formula="M*N*(2 read + 1 write) + scales")
    y = fq.fp8_block_dequant(q, s)
    ok = bool(torch.equal(y, fq.reference_fp8_block_dequant(q, s)))
    ms = timer(lambda: fq.fp8_block_dequant(q, s))
    ref_ms = timer(lambda: fq.reference_fp8_block_dequant(q, s), min_iters=2)
    yield make_entry("fp8_block_dequant", shape, ms, nbytes=nbytes, reference_ms=ref_ms, correct=ok,
                     check="bitwise equal bf16 output", bytes_formula="M*N*(1 read + 2 write) + scales")


CASES = {"fp8": bench_fp8, "logprobs": bench_logprobs, "sparse_mla": bench_sparse_mla,
         "sparse_mla_bwd": bench_sparse_mla_bwd, "indexer": bench_indexer}


def tuning_summary() -> dict[str, Any]:
    from kernels import (
        fp8_quant,
        indexer,
        indexer_fused,
        logprobs,
        sparse_mla,
        sparse_mla_bwd,
        sparse_mla_bwd_keymajor,
        sparse_mla_bwd_split,
    )

    tuners = [logprobs.FWD_TUNER, logprobs.BWD_TUNER, indexer.SCORE_TUNER, indexer.TOPK_TUNER,
              indexer_fused.FUSED_SCORE_TUNER, indexer_fused.FUSED_SELECT_TUNER,
              sparse_mla.TUNER, sparse_mla_bwd.BWD_TUNER, sparse_mla_bwd_keymajor.DQ_TUNER,
              sparse_mla_bwd_keymajor.DKV_TUNER, sparse_mla_bwd_split.DQ_TUNER, sparse_mla_bwd_split.DKV_TUNER,
              fp8_quant.QUANT_TUNER, fp8_quant.DEQUANT_TUNER]
    return {t.name: t.summary() for t in tuners}
