"""The split sparse MLA backward with each chunk's dkv pass beside the next chunk's dq pass, on one GPU.

`python bench/gpu/split_overlap.py --out X.json` times kernels/sparse_mla_bwd_split.split_backward on
the kernels benchmark's inputs (4096 tokens x top-2048 of a 64K context, 64 heads, 576 / 512) serially
(overlap_programs 0) and with the dkv pass as P persistent programs on a side stream, for each P and
chunk size in VARIANTS, all in one process; each overlapped run's dq must equal the serial one's and
its dkv match it to fp32 summation order.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (persistent dkv programs, tokens a chunk); (0, 0): serial, the shipped schedule before this probe
VARIANTS = [(0, 0), (32, 1024), (64, 1024), (96, 1024), (132, 1024), (264, 1024), (64, 512), (96, 512),
            (64, 2048)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    import torch
    import triton

    from bench.gpu.split_dkv_floor import backward_inputs
    from bench.machine import machine
    from kernels import sparse_mla_bwd_split as spl
    from kernels.sparse_mla_bwd import sparse_mla_bwd_flops

    T, S, H, DV, K = 4096, 65536, 64, 512, 2048
    q, kv, idx, dout, scale, lse, delta = backward_inputs(T, S, H, K)
    flops = sparse_mla_bwd_flops(T, H, K, DV, 64)
    serial_dq, serial_dkv = spl.split_backward(q, kv, idx, dout, lse, delta, scale, DV, overlap_programs=0)  # tunes
    result = {"machine": machine(), "shape": {"tokens": T, "context": S, "heads": H, "topk": K}, "flops": flops,
              "dkv_config": spl.DKV_TUNER.records[spl.tuning_key(q, idx)].best.describe(),
              "dq_impl": spl.default_dq_impl(q, kv, DV), "variants": []}
    base_ms = None
    for programs, chunk in VARIANTS:
        row = {"programs": programs, "chunk_tokens": chunk}
        try:
            if chunk:
                spl.OVERLAP_CHUNK_TOKENS = chunk
            dq, dkv = spl.split_backward(q, kv, idx, dout, lse, delta, scale, DV, overlap_programs=programs)
            row |= {"dq_equal": bool(torch.equal(dq, serial_dq)),
                    "dkv_max_abs_diff": float((dkv - serial_dkv).abs().max())}
            del dq, dkv
            ms = triton.testing.do_bench(lambda p=programs: spl.split_backward(
                q, kv, idx, dout, lse, delta, scale, DV, overlap_programs=p), warmup=3, rep=60)
            pass_ms: dict[str, float] = {}
            spl.split_backward(q, kv, idx, dout, lse, delta, scale, DV, pass_ms=pass_ms, overlap_programs=programs)
            base_ms = base_ms or ms
            row |= {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "speedup_over_serial": round(base_ms / ms, 3),
                    "pass_ms": {k: round(v, 3) for k, v in pass_ms.items()}}
        except Exception as exc:  # noqa: BLE001 -- a variant that fails is a finding
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        result["variants"].append(row)
        print(json.dumps(row), flush=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
