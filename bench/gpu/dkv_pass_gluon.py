"""The split backward's Gluon dkv pass (kernels/sparse_mla_bwd_dkv_gluon.py) against the Triton one, on one GPU.

`python bench/gpu/dkv_pass_gluon.py --out X.json` fills one 2048-token chunk's dS / P scratch with the
dq pass (4096 x top-2048 of a 64K context, the kernels benchmark's inputs), then runs the Triton dkv
pass (its tuned config) and each Gluon schedule in SCHEDULES from it, checks each dkv against the
Triton one (fp32 atomics: only the summation order differs) and times each beside it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# the default (128 value columns a program, 3 stages, 8-byte reductions from the accumulator's layout);
# 16-byte reductions through shared memory; 2 and 4 stages; 256 columns a program (with each reduction width)
SCHEDULES = [{}, {"V4": True}, {"STAGES": 2}, {"STAGES": 4}, {"COLS": 256}, {"COLS": 256, "V4": True}]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    import torch

    from bench.gpu.split_dkv_floor import backward_inputs
    from bench.machine import machine
    from kernels import sparse_mla_bwd_dkv_gluon as gdkv
    from kernels import sparse_mla_bwd_gluon as gdq
    from kernels import sparse_mla_bwd_split as spl

    T, S, H, DV, DR, K = 2048, 65536, 64, 512, 64, 2048
    q, kv, idx, dout, scale, lse, delta = backward_inputs(T, S, H, K, hole_rows=4)
    ds = torch.empty((T, H, K), device="cuda", dtype=torch.bfloat16)
    p = torch.empty_like(ds)
    gdq.dq_pass(q, kv, idx, dout, lse, delta, torch.empty_like(q), ds, p, scale)
    spl.split_backward(q, kv, idx, dout, lse, delta, scale, DV, dkv_impl="triton")  # tunes the Triton pass
    cfg = spl.DKV_TUNER.records[spl.tuning_key(q, idx)].best
    want = torch.zeros((S, DV + DR), device="cuda", dtype=torch.float32)
    spl.dkv_pass(cfg, q, dout, idx, ds, p, want, DV)
    scratch = torch.zeros_like(want)
    flops = 2.0 * T * H * K * (DV + DR + DV)
    tri_ms = triton.testing.do_bench(lambda: spl.dkv_pass(cfg, q, dout, idx, ds, p, scratch, DV), warmup=5, rep=60)
    result = {"machine": machine(), "shape": {"tokens": T, "context": S, "heads": H, "topk": K}, "flops": flops,
              "triton": {"config": cfg.describe(), "ms": round(tri_ms, 4), "tflops": round(flops / tri_ms / 1e9, 1)},
              "gluon": []}
    print(json.dumps(result["triton"]), flush=True)
    scale_ref = float(want.abs().max())
    for sch in SCHEDULES:
        row = {"schedule": sch}
        try:
            got = torch.zeros_like(want)
            gdkv.dkv_pass(q, dout, idx, ds, p, got, **sch)
            row["max_abs_diff"] = float((got - want).abs().max())
            row["max_abs_dkv"] = scale_ref
            row["correct"] = row["max_abs_diff"] <= 1e-3 * scale_ref
            ms = triton.testing.do_bench(lambda sch=sch: gdkv.dkv_pass(q, dout, idx, ds, p, scratch, **sch),
                                         warmup=5, rep=60)
            row |= {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "speedup_over_triton": round(tri_ms / ms, 3)}
        except Exception as exc:  # noqa: BLE001 -- a schedule that fails to compile or run is a finding
            row["error"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
        result["gluon"].append(row)
        print(json.dumps(row), flush=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
