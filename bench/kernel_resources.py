"""What a Triton kernel costs on Hopper, without a GPU: `python -m bench.kernel_resources [--only NAME]`.

Compiles a kernel for sm_90 the way the JIT would specialise it at the benchmark's shapes
(pointers and integer arguments divisible by 16 marked so), runs Triton's bundled ptxas, and
reports per config: registers per thread, spill stack bytes, shared memory, and the instruction
mix that decides its speed (wgmma vs mma.sync, cp.async, vector vs scalar reductions). The GPU
machine is 30 minutes a session; this is how a config is checked to fit before it is timed there.
Imports triton and kernels/ only (no CUDA device, no agentrl).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Ptr:
    """A pointer argument of element type dtype ("bf16", "fp32", "i32"), 16-byte aligned."""

    dtype: str


# PTX instructions counted in the compiled kernel (static counts, not executions): the MMA kind, the
# asynchronous copies the pipeliner made, and the fp32 reductions: scalar (red_f32, atom_f32) or
# 16-byte (atom_v4_f32, what tl.atomic_add becomes when Triton proves the alignment; red_v4_f32, the
# inline-asm form with an L2 cache policy); warp shuffles and block barriers (what a reduction or a prefix
# sum costs).
INSTRUCTIONS = {"wgmma": r"wgmma\.mma_async", "mma_sync": r"\bmma\.sync", "cp_async": r"cp\.async\.",
                "red_f32": r"red\.global[\w.]*\.add\.f32",
                "atom_v4_f32": r"atom\.global[\w.]*\.add\.v4\.f32", "atom_f32": r"atom\.global[\w.]*\.add\.f32",
                "red_v4_f32": r"\bred\.[\w.:]*global[\w.:]*\.v4\.f32",
                "shfl": r"\bshfl\.sync", "bar_sync": r"\bbar\.sync"}


def compile_sm90(fn, args: dict[str, Any], constexprs: dict[str, Any], num_warps: int, num_stages: int) -> dict:
    """Registers, spills, shared memory and instruction counts of fn compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    missing = [n for n in names if n not in args and n not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for {missing}")
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, Ptr):
            signature[name] = "*" + value.dtype
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}: give an int, a float or a Ptr, got {value!r}")
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # a @gluon.jit kernel (its layouts are written out)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    usage = _resource_usage(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    counts = {k: len(re.findall(p, ptx)) for k, p in INSTRUCTIONS.items()}
    extra = {}
    if counts["wgmma"]:
        extra = {"wgmma_serialized": _wgmma_serialized(ptx), "partitions": _partitions(compiled.asm["cubin"])}
    return {**usage, "shared_bytes": compiled.metadata.shared, **counts, **extra}


def _nv_tool(name: str) -> Path:
    from triton.backends.nvidia import compiler as nv

    return Path(nv.__file__).parent / "bin" / name


def _wgmma_serialized(ptx: str) -> bool:
    """Whether ptxas serialises the kernel's wgmmas (its C7514 warning: each waits for the one before, as when a
    non-wgmma instruction may touch an accumulator in flight). Triton does not show ptxas' warnings, so the PTX
    is assembled again with -v."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        text = subprocess.run([str(_nv_tool("ptxas")), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True, check=True).stderr
    return "C7514" in text


def _partitions(cubin: bytes) -> list[dict[str, int]]:
    """A warp-specialised kernel's partitions as the SASS shows them: the code after each register
    reallocation (setmaxnreg), with its register count and its spill stores and wgmmas, in SASS order
    (a total spill count does not say whether the producer or a consumer spills), and `loop_spill_ops`: the
    local-memory stores and loads inside its innermost loops, the ones that run every tile (a spill around a
    loop runs once a program)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(_nv_tool("cuobjdump")), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;\n]*);", sass)]
    loops = [(int(b.group(1), 16), addr) for addr, text in code
             if (b := re.search(r"\bBRA\b[^;]*?(0x[0-9a-f]+)", text)) and int(b.group(1), 16) < addr]
    innermost = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    parts = [{"registers": 0, "spill_stores": 0, "wgmma": 0, "loop_spill_ops": 0}]
    for addr, text in code:
        found = re.search(r"USETMAXREG\.\w+\.CTAPOOL\s+(?:U?P\w+,\s*)?(0x[0-9a-f]+)", text)
        if found:
            parts.append({"registers": int(found.group(1), 16), "spill_stores": 0, "wgmma": 0, "loop_spill_ops": 0})
            continue
        local = re.search(r"\b(STL|LDL)(\.\w+)*\s", text)
        if local and local.group(1) == "STL":
            parts[-1]["spill_stores"] += 1
        elif "HGMMA" in text:
            parts[-1]["wgmma"] += 1
        if local and any(lo <= addr <= hi for lo, hi in innermost):
            parts[-1]["loop_spill_ops"] += 1
    return [p for p in parts if p["spill_stores"] or p["wgmma"]]


def _resource_usage(cubin: bytes) -> dict[str, int]:
    cuobjdump = _nv_tool("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)", text)
    if not found:
        raise RuntimeError(f"cuobjdump printed no resource usage: {text[:300]}")
    return {"registers": int(found.group(1)), "spill_stack_bytes": int(found.group(2))}


def _sparse_mla_bwd_cases() -> list[tuple[str, Any, dict, dict, list]]:
    from kernels import sparse_mla_bwd_dkv_gluon as gluon_dkv
    from kernels import sparse_mla_bwd_gluon as gluon_dq
    from kernels import sparse_mla_gluon as gluon_fwd
    from kernels import sparse_mla_gluon_pair as gluon_pair
    from kernels._tuning import KernelConfig
    from kernels.sparse_mla import CONFIGS as FWD_CONFIGS
    from kernels.sparse_mla import _sparse_mla_fwd_kernel
    from kernels.sparse_mla_bwd import BWD_CONFIGS
    from kernels.sparse_mla_bwd_rows import sparse_mla_bwd_rows_kernel
    from kernels.sparse_mla_bwd_split import DKV_CONFIGS, DQ_CONFIGS, _dkv_from_dsp_kernel

    H, DV, DR, K = 64, 512, 64, 2048  # the benchmark's GLM-5.2 shapes (strides do not depend on tokens)
    dims = {"HEADS": H, "D_V": DV, "D_R": DR}
    rows_args = {"q_ptr": Ptr("bf16"), "kv_ptr": Ptr("bf16"), "idx_ptr": Ptr("i32"), "do_ptr": Ptr("bf16"),
                 "lse_ptr": Ptr("fp32"), "delta_ptr": Ptr("fp32"), "dq_ptr": Ptr("bf16"), "dkv_ptr": Ptr("fp32"),
                 "ds_ptr": Ptr("bf16"), "p_ptr": Ptr("bf16"), "scale": 0.0625, "scale_log2": 0.09, "n_idx": K,
                 "stride_qt": H * (DV + DR), "stride_qh": DV + DR, "stride_kv": DV + DR, "stride_it": K,
                 "stride_dot": H * DV, "stride_doh": DV, "stride_lt": H, "stride_dqt": H * (DV + DR),
                 "stride_dqh": DV + DR, "stride_dkv": DV + DR, "stride_st": K * H}
    dkv_args = {k: rows_args[k] for k in ("q_ptr", "do_ptr", "idx_ptr", "ds_ptr", "p_ptr", "dkv_ptr", "n_idx",
                                          "stride_qt", "stride_qh", "stride_dot", "stride_doh", "stride_it",
                                          "stride_st", "stride_dkv")}
    gluon_dq_args = {k: v for k, v in rows_args.items() if k not in ("dkv_ptr", "stride_dkv")}
    fwd_args = {"q_ptr": Ptr("bf16"), "kv_ptr": Ptr("bf16"), "idx_ptr": Ptr("i32"), "out_ptr": Ptr("bf16"),
                "lse_ptr": Ptr("fp32"), "scale_log2": 0.09, "n_idx": K, "stride_qt": H * (DV + DR),
                "stride_qh": DV + DR, "stride_kv": DV + DR, "stride_it": K, "stride_ot": H * DV, "stride_oh": DV,
                "stride_lt": H}
    return [
        ("sparse_mla_fwd", _sparse_mla_fwd_kernel, fwd_args,
         {**dims, "WS": False}, [(c, {}) for c in FWD_CONFIGS if not dict(c.params).get("WS")]),
        ("sparse_mla_fwd_gluon", gluon_fwd._sparse_mla_fwd_gluon, fwd_args, {"HEADS": H, **gluon_fwd.constexprs()},
         [(KernelConfig.make(num_warps=8, num_stages=1), {})]),
        ("sparse_mla_fwd_gluon_pair", gluon_pair._sparse_mla_fwd_pair, fwd_args, {"HEADS": H, **gluon_pair.constexprs()},
         [(KernelConfig.make(num_warps=4, num_stages=1), {})]),
        ("sparse_mla_bwd_atomic", sparse_mla_bwd_rows_kernel, rows_args,
         {**dims, "WITH_DKV": True, "STORE_DSP": False}, [(c, {}) for c in BWD_CONFIGS]),
        ("sparse_mla_bwd_split_dq", sparse_mla_bwd_rows_kernel, rows_args,
         {**dims, "WITH_DKV": False, "STORE_DSP": True}, [(c, {}) for c in DQ_CONFIGS]),
        ("sparse_mla_bwd_split_dq_gluon", gluon_dq.dq_pass_kernel, gluon_dq_args, gluon_dq.constexprs(H),
         [(KernelConfig.make(num_warps=8, num_stages=1), {})]),
        ("sparse_mla_bwd_split_dkv", _dkv_from_dsp_kernel, dkv_args,
         {**dims, "BLOCK_H": 64}, [(c, {}) for c in DKV_CONFIGS]),
        ("sparse_mla_bwd_split_dkv_gluon", gluon_dkv.dkv_pass_kernel,
         {**dkv_args, "col_base": 0, "seg_ptr": Ptr("i32"), "stride_seg": 5}, gluon_dkv.constexprs(True),
         [(KernelConfig.make(num_warps=gluon_dkv.GEMM_WARPS.value, num_stages=1), change)
          for change in ({}, gluon_dkv.constexprs(True, True), gluon_dkv.constexprs(False))]),  # + banded; rope apart
    ]


def _topk_cases() -> list[tuple[str, Any, dict, dict, list]]:
    """The filter-then-select top-k's two kernels for each FILTER shape of both tuner lists (the last
    4096 rows of a 64K context, k = 2048)."""
    from kernels._tuning import KernelConfig
    from kernels.topk import EXPERIMENTAL_TOPK_CONFIGS, TOPK_CONFIGS
    from kernels.topk_filter import AIM_PCT, _filter_kernel, _refilter_kernel, _select_kernel

    S, K = 65536, 2048
    shapes = [dict(c.params) | {"warps": c.num_warps, "stages": c.num_stages}
              for c in TOPK_CONFIGS + EXPERIMENTAL_TOPK_CONFIGS if "FILTER" in dict(c.params)]
    common = {"score_ptr": Ptr("fp32"), "ckey_ptr": Ptr("fp32"), "cidx_ptr": Ptr("i32"), "count_ptr": Ptr("i32"),
              "t_ptr": Ptr("u32"), "path_ptr": Ptr("i32"),
              "row0": S - 4096, "offset": 0, "S": S, "stride_s": S}
    cases = []
    for p in shapes:
        cap = p["CAP"]
        # the kernels' constexprs and launch, from the tuner config that drives both
        filt = KernelConfig.make(p["warps"], p["stages"], BLOCK=p["BLOCK"], SAMPLES=p["SAMPLES"], RUN=p["RUN"],
                                 CAP=cap, STAGES=p["stages"], SPLIT_T=bool(p.get("SPLIT_T", 0)),
                                 ASM_STORE=True, AIM=p.get("AIM_PCT", AIM_PCT) / 100, PAIR=bool(p.get("PAIR", 0)))
        sel = KernelConfig.make(p["SELECT_WARPS"], 1, CAP=cap, BLOCK=1024, RADIX_BITS=p["RADIX_BITS"],
                                N_PASSES=-(-32 // p["RADIX_BITS"]), ASM_STORE=True)
        cases.append(("topk_filter", _filter_kernel, {**common, "stride_c": cap}, {"K": K}, [(filt, {})]))
        refilt = KernelConfig.make(p["warps"], p["stages"], BLOCK=p["BLOCK"], SAMPLES=p["SAMPLES"], RUN=p["RUN"],
                                   CAP=cap, STAGES=p["stages"], ASM_STORE=True, AIM=p.get("AIM_PCT", AIM_PCT) / 100,
                                   PAIR=bool(p.get("PAIR", 0)), FULL=True, RADIX_BITS=p["RADIX_BITS"],
                                   N_PASSES=-(-32 // p["RADIX_BITS"]))
        cases.append(("topk_refilter", _refilter_kernel,
                      {**common, "out_ptr": Ptr("i32"), "shift_ptr": Ptr("i32"), "dmask_ptr": Ptr("i32"),
                       "stride_c": cap, "stride_o": K}, {"K": K}, [(refilt, {})]))
        cases.append(("topk_select", _select_kernel,
                      {**common, "out_ptr": Ptr("i32"), "shift_ptr": Ptr("i32"), "dmask_ptr": Ptr("i32"),
                       "stride_c": cap, "stride_o": K}, {"K": K}, [(sel, {})]))
    return cases


CASES = {"sparse_mla": _sparse_mla_bwd_cases, "topk": _topk_cases}


def run(only: set[str] | None = None) -> list[dict]:
    rows = []
    for family in CASES.values():
        for name, fn, args, constexprs, configs in family():
            if only and name not in only:
                continue
            for cfg, extra in configs:
                const = {**constexprs, **dict(cfg.params), **extra}
                label = cfg.describe() + "".join(f",{k}={v}" for k, v in extra.items())
                try:
                    res = compile_sm90(fn, args, const, cfg.num_warps, cfg.num_stages)
                except Exception as exc:  # noqa: BLE001 -- a config the compiler refuses is a finding
                    res = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[-1][:200]}"}
                rows.append({"kernel": name, "config": label, **res})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated kernel names (default: all)")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    ns = parser.parse_args(argv)
    rows = run({s for s in ns.only.split(",") if s} or None)
    if ns.out:
        ns.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
