"""The Gluon sparse MLA forward (kernels/sparse_mla_gluon.py) against the Triton one, on one GPU.

First exactness against the fp32 torch definition on small cases (heads 64 and 48, -1 slots, a
top-k that is not a multiple of the tile, rows with no valid key), then both kernels timed on the
kernels benchmark's shape (4096 tokens, 64 heads, top-2048 of a 64K and an 8K context, the same
random inputs for both), ms and TFLOP/s side by side. Writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.sparse_mla import (default_sm_scale, reference_sparse_mla, sparse_mla_flops,  # noqa: E402
                                sparse_mla_forward)
from kernels.sparse_mla_gluon import sparse_mla_forward_gluon  # noqa: E402


def _case(T, heads, S, K, holes, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(T, heads, 576, device=dev, generator=g).to(torch.bfloat16)
    kv = torch.randn(S, 576, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, S, (T, K), device=dev, generator=g, dtype=torch.int32)
    if holes:
        idx[torch.rand(T, K, device=dev, generator=g) < 0.2] = -1
        idx[0] = -1  # a row with no valid key: out 0, lse -inf
    return q, kv, idx


def check(dev) -> list[dict]:
    rows = []
    for T, heads, S, K, holes in [(64, 64, 4096, 2048, True), (40, 48, 3000, 300, True), (33, 128, 9000, 2048, False),
                                  (16, 64, 512, 64, False), (16, 64, 512, 1, False)]:
        q, kv, idx = _case(T, heads, S, K, holes, dev, seed=T + heads + K)
        scale = default_sm_scale()
        out, lse = sparse_mla_forward_gluon(q, kv, idx, scale)
        ref_out, ref_lse = reference_sparse_mla(q, kv, idx, scale, chunk_tokens=16)
        fin = torch.isfinite(ref_lse)
        row = {"T": T, "heads": heads, "S": S, "topk": K, "holes": holes,
               "max_abs_err_out": float((out.float() - ref_out.float()).abs().max()),
               "max_abs_err_lse": float((lse[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0,
               "lse_inf_rows_match": bool(torch.equal(torch.isinf(lse), torch.isinf(ref_lse)))}
        row["ok"] = row["max_abs_err_out"] < 3e-2 and row["max_abs_err_lse"] < 1e-2 and row["lse_inf_rows_match"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def timed(dev) -> list[dict]:
    rows = []
    T, heads, K = 4096, 64, 2048
    for S in (65536, 8192):
        q, kv, idx = _case(T, heads, S, K, False, dev, seed=1)
        idx = idx.sort(dim=1).values
        scale = default_sm_scale()
        flops = sparse_mla_flops(T, heads, K)
        got, want = sparse_mla_forward_gluon(q, kv, idx, scale), sparse_mla_forward(q, kv, idx, scale)
        row = {"tokens": T, "heads": heads, "context": S, "topk": K,
               "max_abs_diff_vs_triton": float((got[0].float() - want[0].float()).abs().max())}
        for name, fn in (("triton", sparse_mla_forward), ("gluon", sparse_mla_forward_gluon)):
            ms = triton.testing.do_bench(lambda fn=fn: fn(q, kv, idx, scale), warmup=50, rep=400)
            row[f"{name}_ms"] = round(ms, 3)
            row[f"{name}_tflops"] = round(flops / ms / 1e9, 1)
        row["speedup"] = round(row["triton_ms"] / row["gluon_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="check,time")
    a = ap.parse_args()
    dev = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version()}
    parts = a.parts.split(",")
    try:
        if "check" in parts:
            result["check"] = check(dev)
        if "time" in parts and all(r["ok"] for r in result.get("check", [])):
            result["time"] = timed(dev)
    finally:
        a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
