"""The split backward's Gluon dq pass (kernels/sparse_mla_bwd_gluon.py) against the Triton one, on one GPU.

On a GPU, `python bench/gpu/dq_pass_gluon.py --out X.json` checks dq, dS and P of every schedule in
SCHEDULES against the Triton pass (sparse_mla_bwd_rows.py with STORE_DSP, its tuned config) on one
2048-token chunk (4096 x top-2048 of a 64K context, the kernels benchmark's inputs) and times each
beside it; `--compile-only` compiles every schedule for sm_90 here (bench/kernel_resources.py) and
prints its registers, spills and shared memory.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu.probe_cli import run_probe, schedule_row  # noqa: E402
from kernels.sparse_mla_bwd_gluon import constexprs, dq_pass, dq_pass_kernel  # noqa: E402

# the default; 16-row copies; 88 producer registers (the consumers get 208 and spill 40 bytes); 40 and 72; a
# 2-warp producer; q and dO at a constant index (312 bytes spilled); 64-key tiles in one slot (80 bytes spilled);
# the dS / P scratch stores and then also q / dO / dq with an L2 evict-first policy
# session 29: q and dO copied by the producer (Q_ROWS) against before it starts, with and without the evict-first
# scratch stores; the default and Q_ROWS 32 once more at the end (drift). Sessions 21-28's sweeps (ROW_GROUP,
# PRODUCER_REGS / _WARPS, OPAQUE_Q, 64-key tiles) are in bench/results/dq_pass_gluon_gpu.json.
SCHEDULES = [{}, {"Q_ROWS": 32}, {"Q_ROWS": 16}, {"SCRATCH_EVICT": "evict_first"},
             {"Q_ROWS": 32, "SCRATCH_EVICT": "evict_first"},
             {"Q_ROWS": 32, "SCRATCH_EVICT": "evict_first", "IO_EVICT": "evict_first"}, {}, {"Q_ROWS": 32}]


def compile_only() -> int:
    from bench.kernel_resources import Ptr, compile_sm90
    H, K = 64, 2048
    args = {"q_ptr": Ptr("bf16"), "kv_ptr": Ptr("bf16"), "idx_ptr": Ptr("i32"), "do_ptr": Ptr("bf16"),
            "lse_ptr": Ptr("fp32"), "delta_ptr": Ptr("fp32"), "dq_ptr": Ptr("bf16"), "ds_ptr": Ptr("bf16"),
            "p_ptr": Ptr("bf16"), "scale": 0.0625, "scale_log2": 0.09, "n_idx": K, "stride_qt": H * 576,
            "stride_qh": 576, "stride_kv": 576, "stride_it": K, "stride_dot": H * 512, "stride_doh": 512,
            "stride_lt": H, "stride_dqt": H * 576, "stride_dqh": 576, "stride_st": K * H}
    for sch in SCHEDULES:
        print(json.dumps({"schedule": sch, **compile_sm90(dq_pass_kernel, args, constexprs(H, **sch), 8, 1)}))
    return 0


def measure() -> dict:
    """Time and check every schedule on this GPU: the report."""
    import torch

    from bench.machine import machine
    from bench.gpu.split_dkv_floor import backward_inputs
    from kernels import sparse_mla_bwd_split as spl
    from kernels.sparse_mla import LOG2E
    from kernels.sparse_mla_bwd_rows import sparse_mla_bwd_rows_kernel

    T, S, H, DV, DR, K = 2048, 65536, 64, 512, 64, 2048
    dev = torch.device("cuda")
    q, kv, idx, dout, scale, lse, delta = backward_inputs(T, S, H, K, hole_rows=4)  # -1 slots past 1000
    ds0, p0 = (torch.empty((T, H, K), device=dev, dtype=torch.bfloat16) for _ in range(2))
    dq0 = torch.empty_like(q)
    spl.split_backward(q, kv, idx, dout, lse, delta, scale, DV, dq_impl="triton")  # tunes the Triton dq pass
    cfg = spl.DQ_TUNER.records[spl.tuning_key(q, idx)].best

    def triton_pass():
        sparse_mla_bwd_rows_kernel[(T, 1)](
            q, kv, idx, dout, lse, delta, dq0, dq0, ds0, p0, scale, scale * LOG2E, K,
            q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), dout.stride(0), dout.stride(1), lse.stride(0),
            dq0.stride(0), dq0.stride(1), 0, ds0.stride(0), HEADS=H, D_V=DV, D_R=DR, BLOCK_H=64,
            BLOCK_N=cfg["BLOCK_N"], WITH_DKV=False, STORE_DSP=True, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)

    triton_pass()
    flops = 2.0 * T * H * K * (DV + DR + DV + DV + DR)  # S, dP and dq
    result = {"machine": machine(), "shape": {"tokens": T, "context": S, "heads": H, "topk": K}, "flops": flops,
              "triton": {"config": cfg.describe(), "ms": round(triton.testing.do_bench(triton_pass, warmup=10, rep=100), 4)},
              "gluon": []}
    result["triton"]["tflops"] = round(flops / result["triton"]["ms"] / 1e9, 1)
    print(json.dumps(result["triton"]), flush=True)
    for sch in SCHEDULES:
        ds, p, dq = torch.empty_like(ds0), torch.empty_like(p0), torch.empty_like(q)
        result["gluon"].append(schedule_row(
            sch, lambda ds=ds, p=p, dq=dq, **s: dq_pass(q, kv, idx, dout, lse, delta, dq, ds, p, scale, **s),
            lambda ds=ds, p=p, dq=dq: {"max_abs_diff_dq": float((dq.float() - dq0.float()).abs().max()),
                                       "max_abs_dq": float(dq0.float().abs().max()),
                                       "max_abs_diff_ds": float((ds.float() - ds0.float()).abs().max()),
                                       "max_abs_diff_p": float((p.float() - p0.float()).abs().max())},
            flops, result["triton"]["ms"], warmup=10, rep=100))
    return result


def main(argv: list[str] | None = None) -> int:
    return run_probe(__doc__, argv, compile_only, measure, SCHEDULES)


if __name__ == "__main__":
    raise SystemExit(main())
