"""The Gluon sparse MLA forward (kernels/sparse_mla_gluon.py) against the Triton one, on one GPU.

First exactness against the fp32 torch definition on small cases (heads 64 and 48, -1 slots, a
top-k that is not a multiple of the tile, rows with no valid key) for each schedule in SCHEDULES
(the kernel's defaults first), then the Triton kernel and every schedule timed on the kernels
benchmark's shape (4096 tokens, 64 heads, top-2048 of a 64K and an 8K context, the same random
inputs for all), ms and TFLOP/s side by side. Writes JSON to --out.
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
from kernels.sparse_mla_gluon_pair import sparse_mla_forward_pair  # noqa: E402

# a schedule's "kernel": sparse_mla_gluon.py's ("gluon", the default) or sparse_mla_gluon_pair.py's ("pair"); its
# other keys: that kernel's constants
KERNELS = {"gluon": sparse_mla_forward_gluon, "pair": sparse_mla_forward_pair}


def _forward(q, kv, idx, scale, schedule):
    change = dict(schedule)
    return KERNELS[change.pop("kernel", "gluon")](q, kv, idx, scale, **change)


def _case(T, heads, S, K, holes, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(T, heads, 576, device=dev, generator=g).to(torch.bfloat16)
    kv = torch.randn(S, 576, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, S, (T, K), device=dev, generator=g, dtype=torch.int32)
    if holes:
        idx[torch.rand(T, K, device=dev, generator=g) < 0.2] = -1
        idx[0] = -1  # a row with no valid key: out 0, lse -inf
    return q, kv, idx


# schedule variants (kernels/sparse_mla_gluon.constexprs), the defaults first: 32-key tiles in 4 slots (the
# producer 3 tiles ahead, 16-column wgmmas); session 20's first producer (56 registers, 16-row copies); a
# 2-warp producer with more registers; the paired kernel (its defaults; warpgroup 0 at 240 registers; 16-row
# copies)
SCHEDULES = [{}, {"BLOCK_N": 32, "STAGES": 4}, {"PRODUCER_REGS": 56, "ROW_GROUP": 16},
             {"PRODUCER_WARPS": 2, "PRODUCER_REGS": 120}, {"kernel": "pair"},
             {"kernel": "pair", "CONSUMER_REGS": 208}, {"kernel": "pair", "ROW_GROUP": 16}]


# (T, heads, S, K, holes); 140 tokens and the last two give a persistent kernel's programs several tokens each (one
# program an SM on 132 SMs)
CASES = [(140, 64, 4096, 2048, True), (64, 64, 4096, 2048, True), (40, 48, 3000, 300, True), (33, 128, 9000, 2048, False), (16, 64, 512, 64, False),
         (16, 64, 512, 1, False), (600, 64, 4096, 300, True), (300, 128, 9000, 2048, False)]


def check(dev, schedule, cases) -> list[dict]:
    rows = []
    for T, heads, S, K, holes in cases:
        q, kv, idx = _case(T, heads, S, K, holes, dev, seed=T + heads + K)
        scale = default_sm_scale()
        try:
            out, lse = _forward(q, kv, idx, scale, schedule)
        except Exception as exc:  # noqa: BLE001 -- a variant that does not compile or run is a finding
            rows.append({"schedule": schedule, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[-300:]}"})
            print(json.dumps(rows[-1]), flush=True)
            return rows
        ref_out, ref_lse = reference_sparse_mla(q, kv, idx, scale, chunk_tokens=16)
        fin = torch.isfinite(ref_lse)
        row = {"schedule": schedule, "T": T, "heads": heads, "S": S, "topk": K, "holes": holes,
               "max_abs_err_out": float((out.float() - ref_out.float()).abs().max()),
               "max_abs_err_lse": float((lse[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0,
               "lse_inf_rows_match": bool(torch.equal(torch.isinf(lse), torch.isinf(ref_lse)))}
        row["ok"] = row["max_abs_err_out"] < 3e-2 and row["max_abs_err_lse"] < 1e-2 and row["lse_inf_rows_match"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def timed(dev, schedules, tokens=(4096, ), rounds=1, contexts=(65536, 8192)) -> list[dict]:
    rows = []
    heads, K = 64, 2048
    for T, S in [(T, S) for S in contexts for T in tokens]:
        q, kv, idx = _case(T, heads, S, K, False, dev, seed=1)
        idx = idx.sort(dim=1).values
        scale = default_sm_scale()
        flops = sparse_mla_flops(T, heads, K)
        want = sparse_mla_forward(q, kv, idx, scale, impl="triton")
        t_ms = triton.testing.do_bench(lambda: sparse_mla_forward(q, kv, idx, scale, impl="triton"), warmup=50,
                                       rep=400)
        base = {"tokens": T, "heads": heads, "context": S, "topk": K}
        rows.append({**base, "kernel": "triton", "ms": round(t_ms, 3), "tflops": round(flops / t_ms / 1e9, 1)})
        print(json.dumps(rows[-1]), flush=True)
        for rnd, sch in [(r, sch) for r in range(rounds) for sch in schedules]:  # interleaved: drift hits each alike
            got = _forward(q, kv, idx, scale, sch)
            ms = triton.testing.do_bench(lambda sch=sch: _forward(q, kv, idx, scale, sch),
                                         warmup=50, rep=400)
            rows.append({**base, "kernel": "gluon", "schedule": sch, "round": rnd, "ms": round(ms, 3),
                         "tflops": round(flops / ms / 1e9, 1), "speedup_over_triton": round(t_ms / ms, 3),
                         "max_abs_diff_vs_triton": float((got[0].float() - want[0].float()).abs().max())})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="check,time", help="comma-separated: check, time")
    ap.add_argument("--schedules", type=json.loads, default=SCHEDULES, help="JSON list of schedule dicts")
    ap.add_argument("--tokens", default="4096", help="comma-separated token counts to time (132 SMs: 4092 is 31 "
                    "full waves of one program an SM, 4096 adds a 32nd of 4)")
    ap.add_argument("--contexts", default="65536,8192", help="comma-separated context lengths to time")
    ap.add_argument("--check-all", action="store_true", help="every check case for every schedule (default: all "
                    "for each kernel's first schedule, two for the others)")
    ap.add_argument("--rounds", type=int, default=1, help="times each schedule is timed, the schedules interleaved "
                    "(differences of ~1%% need a few rounds to tell from drift)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version()}
    parts = a.parts.split(",")
    try:
        ok = list(a.schedules)  # without the check part, every schedule is timed
        if "check" in parts:
            # every case for each kernel's first schedule; for the others the 64-head ones (one compile each)
            firsts = {sch.get("kernel", "gluon"): i for i, sch in reversed(list(enumerate(a.schedules)))}
            result["check"] = [row for i, sch in enumerate(a.schedules)
                               for row in check(dev, sch, CASES if a.check_all or i in firsts.values() else [CASES[0], CASES[5]])]
            ok = [sch for sch in a.schedules if all(r["ok"] for r in result["check"] if r["schedule"] == sch)]
        if "time" in parts and ok:
            result["time"] = timed(dev, ok, [int(t) for t in a.tokens.split(",")], a.rounds,
                                   [int(c) for c in a.contexts.split(",")])
    finally:
        a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
