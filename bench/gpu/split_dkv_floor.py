"""What bounds the split backward's dkv pass (GPU only): `python3 bench/gpu/split_dkv_floor.py --out X`.

Times, on the benchmark's inputs (4096 tokens x top-2048 of 64K keys, 64 heads, 576 / 512), the
dkv pass of kernels/sparse_mla_bwd_split.py as it is, and two copies of its source compiled with
the writes changed: plain stores to the same scattered rows (no read-modify-write: what the
atomics cost), and stores to the program's own row of a scratch (no scatter: what the GEMMs and
the dS / P reads cost); then the shipped kernel with every key among the first 8192 (its rows in
L2: what the atomics cost without DRAM traffic). The copies' outputs are wrong on purpose and only
timed. Each with every DKV_CONFIGS entry, the best reported; the dq pass is run once before to fill
the scratch.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _variant(src: str, name: str, scatter: bool):
    """The split module with its two atomic adds replaced by stores (to the rows, or one own row)."""
    body = src.replace('tl.atomic_add(rows[:, None] + cols[None, :], dk, mask=valid[:, None], sem="relaxed")',
                       "tl.store(rows[:, None] + cols[None, :], dk, mask=valid[:, None])" if scatter else
                       "tl.store(own[:, None] + cols[None, :], dk, mask=valid[:, None])")
    body = body.replace('''                tl.atomic_add(rows[:, None] + D_V + dr[None, :], tl.dot(ds_t, q_rope), mask=valid[:, None],
                              sem="relaxed")''', '''                tl.store((rows if SCATTER else own)[:, None] + D_V + dr[None, :], tl.dot(ds_t, q_rope),
                         mask=valid[:, None])''')
    body = body.replace("def _dkv_columns(rows, cols, ds_t, p_t, q_c, do_c, valid):",
                        "def _dkv_columns(rows, cols, ds_t, p_t, q_c, do_c, valid, own):")
    body = body.replace("_dkv_columns(rows, ", "_dkv_columns(rows, ").replace(", valid)\n", ", valid, own)\n")
    body = body.replace("            rows = dkv_ptr + tl.where(valid, ids, 0).to(tl.int64) * stride_dkv\n",
                        "            rows = dkv_ptr + tl.where(valid, ids, 0).to(tl.int64) * stride_dkv\n"
                        "            own = dkv_ptr + (t * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64) % 65536 * stride_dkv\n")
    body = body.replace("                         COL_SPLIT: tl.constexpr):",
                        f"                         COL_SPLIT: tl.constexpr, SCATTER: tl.constexpr = {scatter}):")
    if "tl.atomic_add(rows" in body:
        raise RuntimeError(f"{name}: the kernel's atomics changed shape; update this probe")
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(body)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def backward_inputs(tokens: int, context: int = 65536, heads: int = 64, topk: int = 2048, hole_rows: int = 0):
    """The kernels benchmark's sparse MLA backward inputs on CUDA (seed 0): q, kv, idx (sorted random
    keys; the first hole_rows rows -1 past slot 1000), dO, the scale, and the forward's lse and Delta."""
    import torch

    from kernels.sparse_mla import default_sm_scale, sparse_mla_forward
    from kernels.sparse_mla_bwd import _delta

    dev = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(tokens, heads, 576, device=dev).to(torch.bfloat16)
    kv = torch.randn(context, 576, device=dev).to(torch.bfloat16)
    idx = torch.randint(0, context, (tokens, topk), device=dev, dtype=torch.int32).sort(dim=1).values
    idx[:hole_rows, 1000:] = -1
    dout = torch.randn(tokens, heads, 512, device=dev).to(torch.bfloat16)
    scale = default_sm_scale()
    out, lse = sparse_mla_forward(q, kv, idx, scale)
    return q, kv, idx, dout, scale, lse, _delta(dout, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch
    import triton

    from bench.machine import machine
    from kernels import sparse_mla_bwd_split as spl

    T, S, H, DV, DR, K = 4096, 65536, 64, 512, 64, 2048
    dev = torch.device("cuda")
    q, kv, idx, dout, scale, lse, delta = backward_inputs(T, S, H, K)
    n = 2048  # one chunk of the default scratch
    ds = torch.empty((n, H, K), device=dev, dtype=torch.bfloat16)
    p = torch.empty_like(ds)
    spl.split_backward(q[:n], kv, idx[:n], dout[:n], lse[:n], delta[:n], scale, DV)  # tunes the dq pass
    from kernels.sparse_mla import LOG2E
    from kernels.sparse_mla_bwd_rows import sparse_mla_bwd_rows_kernel
    cfg = spl.DQ_TUNER.records[spl.tuning_key(q[:n], idx[:n])].best
    sparse_mla_bwd_rows_kernel[(n, 1)](
        q, kv, idx, dout, lse, delta, q.clone(), q, ds, p, scale, scale * LOG2E, K,
        q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), dout.stride(0), dout.stride(1), lse.stride(0),
        q.stride(0), q.stride(1), 0, ds.stride(0), HEADS=H, D_V=DV, D_R=DR, BLOCK_H=64, BLOCK_N=cfg["BLOCK_N"],
        WITH_DKV=False, STORE_DSP=True, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    src = Path(spl.__file__).read_text()
    # the last case: the shipped kernel with every selected key among the first 8192, so that the
    # rows its atomics hit (19 MB of fp32) stay in L2: what the atomics cost without DRAM traffic
    near = torch.randint(0, 8192, (n, K), device=dev, dtype=torch.int32).sort(dim=1).values
    modules = {"atomic_adds (as shipped)": (spl, idx), "stores_to_the_same_rows": (_variant(src, "dkv_store", True), idx),
               "stores_to_own_rows": (_variant(src, "dkv_own", False), idx),
               "atomic_adds, keys among the first 8192": (spl, near)}
    result = {"machine": machine(), "shape": {"tokens": n, "context": S, "heads": H, "topk": K},
              "flops": 2.0 * n * H * K * (DV + DR + DV), "variants": {}}
    for label, (mod, rows) in modules.items():
        dkv = torch.zeros((S, DV + DR), device=dev, dtype=torch.float32)
        times = {}
        for c in spl.DKV_CONFIGS:
            def launch(c=c):
                mod.dkv_pass(c, q[:n], dout[:n], rows[:n], ds, p, dkv, DV)
            try:
                times[c.describe()] = round(triton.testing.do_bench(launch, warmup=5, rep=40), 4)
            except Exception as exc:  # noqa: BLE001 -- a config this copy cannot run: say so
                times[c.describe()] = f"{type(exc).__name__}: {str(exc)[:120]}"
        best = min((v for v in times.values() if isinstance(v, float)), default=None)
        result["variants"][label] = {"best_ms": best, "tflops": round(result["flops"] / best / 1e9, 1) if best else None,
                                     "ms": times}
        print(label, best, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
