"""The split backward's warp-specialised Gluon dkv pass (kernels/sparse_mla_bwd_dkv_gluon.py) against the
Triton one, on one GPU; then the whole backward with each.

On a GPU, `python bench/gpu/dkv_pass_gluon.py --out X.json`: on one 2048-token chunk of the kernels
benchmark's inputs (4096 x top-2048 of a 64K context; four rows with -1 slots, the rows sorted as
split_backward sorts them for bands), dS / P from the dq pass, each schedule in SCHEDULES is checked against
the Triton pass (its tuned config) and timed beside it; then `split_backward` over all 4096 tokens with each
of BACKWARDS, timed one after the other, with the backward's TFLOP/s. `--compile-only` compiles each schedule
for sm_90 here (bench/kernel_resources.py) and prints its registers, spills and shared memory.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu.probe_cli import run_probe, schedule_row  # noqa: E402
from kernels import sparse_mla_bwd_dkv_gluon as dg  # noqa: E402
from kernels.sparse_mla_bwd_dkv_gluon import GEMM_WARPS, _launches, constexprs, dkv_pass, dkv_pass_kernel  # noqa: E402

# the default: whole rows a program (8 value blocks and the rope block, one launch; dS / P read once), over
# bands of keys so that the programs running at once add into at most BAND_BYTES of dkv (5 bands at 64K keys);
# other band counts (on the H200, whose HBM is 1.4x faster, fewer may do); the rope columns in a launch of their
# own; q / dO loaded through registers with an L2 policy; session 22's layout (groups of 2 x 64 value columns,
# no bands: 33.5 MB at once, dS / P read 5 times) and its groups of 4; PROBE bits, each making the result wrong
# by design: 1 no reductions (the GEMM side's rate), 4 no dS / P copies (what streaming them through L2 costs)
S22 = {"VALUE_BLOCKS": 2, "ROPE_WITH_VALUES": False, "STAGES": 3, "ACC_STAGES": 3}
SCHEDULES = [{}, {"KEY_BANDS": 3}, {"KEY_BANDS": 4}, {"KEY_BANDS": 6}, {"KEY_BANDS": 8},
             {"ROPE_WITH_VALUES": False, "KEY_BANDS": 4}, {"QDO_EVICT": "evict_first"},
             {"QDO_EVICT": "evict_first", "KEY_BANDS": 4},
             S22, S22 | {"VALUE_BLOCKS": 4}, {"PROBE": 1}, {"PROBE": 4}]
# the whole backward with the Triton dkv pass, the default and session 22's layout (through SCHEDULE, as
# split_backward reads it)
BACKWARDS = [("triton", {}), ("gluon", {}), ("gluon", S22)]


def compile_only() -> int:
    from bench.kernel_resources import Ptr, compile_sm90
    H, K = 64, 2048
    args = {"q_ptr": Ptr("bf16"), "do_ptr": Ptr("bf16"), "idx_ptr": Ptr("i32"), "ds_ptr": Ptr("bf16"),
            "p_ptr": Ptr("bf16"), "dkv_ptr": Ptr("fp32"), "n_idx": K, "stride_qt": H * 576, "stride_qh": 576,
            "stride_dot": H * 512, "stride_doh": 512, "stride_it": K, "stride_st": H * K, "stride_dkv": 576,
            "col_base": 0, "seg_ptr": Ptr("i32"), "stride_seg": 5}
    for sch in SCHEDULES:
        for with_p, _ in _launches(sch):
            print(json.dumps({"schedule": sch, "value_columns": with_p,
                              **compile_sm90(dkv_pass_kernel, args, constexprs(with_p, **sch), GEMM_WARPS.value, 1)}))
    return 0


def measure() -> dict:
    """Time and check every schedule on this GPU: the report."""
    import torch
    import triton

    from bench.gpu.split_dkv_floor import backward_inputs
    from bench.machine import machine
    from kernels import sparse_mla_bwd_gluon
    from kernels import sparse_mla_bwd_split as spl
    from kernels.sparse_mla_bwd import sparse_mla_bwd_flops

    T, S, H, DV, K = 4096, 65536, 64, 512, 2048
    n = 2048
    dev = torch.device("cuda")
    q, kv, idx, dout, scale, lse, delta = backward_inputs(T, S, H, K, hole_rows=4)
    idx = idx.sort(dim=1).values  # -1 slots first: what split_backward does before its dq pass for bands
    ds = torch.empty((n, H, K), device=dev, dtype=torch.bfloat16)
    p = torch.empty_like(ds)
    sparse_mla_bwd_gluon.dq_pass(q[:n], kv, idx[:n], dout[:n], lse[:n], delta[:n], torch.empty_like(q[:n]), ds, p,
                                 scale)
    spl.split_backward(q[:n], kv, idx[:n], dout[:n], lse[:n], delta[:n], scale, DV, dkv_impl="triton")  # tunes
    cfg = spl.DKV_TUNER.records[spl.tuning_key(q[:n], idx[:n])].best
    dkv0 = torch.zeros((S, 576), device=dev, dtype=torch.float32)

    def triton_pass(out=dkv0):
        spl.dkv_pass(cfg, q[:n], dout[:n], idx[:n], ds, p, out, DV)

    triton_pass()  # the reference; the timings below add into another buffer
    scale_ref = float(dkv0.abs().max())
    dkv_t = torch.zeros_like(dkv0)
    flops = 2.0 * n * H * K * (DV + 64 + DV)
    result = {"machine": machine(), "shape": {"tokens": n, "context": S, "heads": H, "topk": K}, "flops": flops,
              "triton": {"config": cfg.describe(), "ms": round(triton.testing.do_bench(lambda: triton_pass(dkv_t), warmup=5, rep=50), 4)},
              "gluon": []}
    print(json.dumps(result["triton"]), flush=True)
    for sch in SCHEDULES:
        dkv = torch.zeros_like(dkv0)
        result["gluon"].append(schedule_row(
            sch, lambda dkv=dkv, **s: dkv_pass(q[:n], dout[:n], idx[:n], ds, p, dkv, **s),
            lambda dkv=dkv: {"max_abs_diff": float((dkv - dkv0).abs().max()), "max_abs": scale_ref},
            flops, result["triton"]["ms"], warmup=5, rep=50))
    bwd_flops = sparse_mla_bwd_flops(T, H, K)
    result["backward"] = {"tokens": T, "flops": bwd_flops}
    grads = {}
    saved = dict(dg.SCHEDULE)
    for impl, sch in BACKWARDS:
        name = impl + ("" if not sch else "_" + ",".join(f"{k}={v}" for k, v in sch.items()))

        def backward(impl=impl, pass_ms=None):
            return spl.split_backward(q, kv, idx, dout, lse, delta, scale, DV, pass_ms=pass_ms, dkv_impl=impl)
        dg.SCHEDULE.update(sch)
        try:
            grads[name] = backward()
            ms = triton.testing.do_bench(backward, warmup=3, rep=30)
            passes: dict[str, float] = {}
            backward(pass_ms=passes)
            result["backward"][name] = {"ms": round(ms, 3), "tflops": round(bwd_flops / ms / 1e9, 1),
                                        "pass_ms": {k: round(v, 3) for k, v in passes.items()}}
        except Exception as exc:  # noqa: BLE001
            result["backward"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            dg.SCHEDULE.clear()
            dg.SCHEDULE.update(saved)
        print(name, json.dumps(result["backward"][name]), flush=True)
    ref = grads.get("triton")
    for name, g in grads.items():
        if ref is not None and name != "triton":
            result["backward"][name]["max_abs_diff_dkv"] = float((g[1] - ref[1]).abs().max())
            result["backward"][name]["dq_identical"] = bool(torch.equal(g[0], ref[0]))
    if ref is not None:
        result["backward"]["max_abs_dkv"] = float(ref[1].abs().max())
    return result


def main(argv: list[str] | None = None) -> int:
    return run_probe(__doc__, argv, compile_only, measure)


if __name__ == "__main__":
    raise SystemExit(main())
