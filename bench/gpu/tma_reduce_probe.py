"""How fast one GPU scatter-adds fp32 rows, and what slows it: the reductions of the split backward's dkv
pass alone (bench/results/tma_reduce_probe_gpu.json).

Over the kernels benchmark's indices (2048 tokens x top-2048 of 64K keys, one chunk; random order, or each
token's keys sorted where `sorted`), adding 1.0 so that the result is checkable (dkv[key, :] = how many
times key was picked):
- `atomic`: one program per (token, COLS columns), tl.atomic_add of [BLOCK_N, COLS] tiles (16-byte
  reductions); `hog` KB of shared memory held so that one program (128) or two (96) run a SM, as in the
  dkv pass; `sync` 1: a block barrier after each tile, 2: a CTA-scope release fence (what an mbarrier
  arrive implies);
- `reducer`: the Gluon dkv pass's reducer alone, one program per token walking all of a 576-column row
  (9 blocks of 64) per key tile, values from registers or (`src` 1) shared memory, `wait` 1 an mbarrier
  wait a block;
- `tma`, `tma_row`: the tile in shared memory, one TMA bulk reduce (`cp.reduce.async.bulk.tensor`) per
  picked key of [1, COLS] or of the whole row.
`python bench/gpu/tma_reduce_probe.py --out X.json` on a GPU; `--compile-only` compiles each for sm_90 here.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu.probe_cli import run_probe  # noqa: E402


@builtin
def async_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[tensor_desc at coord, the box] += src, a shared memory descriptor of the box's shape
    (`cp.reduce.async.bulk.tensor ... .add`): Gluon 3.6 exposes TMA loads and stores for Hopper but not
    the reduction its builder has (`create_async_tma_reduce`, what Triton's tensor_descriptor.atomic_add
    lowers to). Completes as a bulk group, like a TMA store (`tma.store_wait`)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


D = gl.constexpr(512)  # the value columns (the rope's 64 would be one more, smaller box)


@gluon.jit
def _hog(HOG: gl.constexpr):
    """HOG KB (a multiple of 32) of shared memory held: 128 leaves room for one program a SM, as the dkv pass
    holds; 96 for two."""
    if HOG > 0:
        fill_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [gl.num_warps(), 1], [1, 0])
        hog = gl.allocate_shared_memory(gl.float32, [HOG // 32, 128, 64], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        hog.index(HOG // 32 - 1).slice(0, 16, dim=0).store(gl.zeros([16, 64], gl.float32, fill_l))


@gluon.jit
def atomic_kernel(idx_ptr, dkv_ptr, n_idx, stride_it, BLOCK_N: gl.constexpr, COLS: gl.constexpr,
                  TPW_C: gl.constexpr, HOG: gl.constexpr, SYNC: gl.constexpr):
    t = gl.program_id(0).to(gl.int64)
    c0 = gl.program_id(1) * COLS
    _hog(HOG)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TPW_C, TPW_C], [gl.num_warps(), 1], [1, 0])
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = c0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    ones = gl.full([BLOCK_N, COLS], 1.0, gl.float32, layout)
    for k0 in range(0, n_idx, BLOCK_N):
        j = k0 + keys
        ids = gl.load(idx_ptr + t * stride_it + j, mask=j < n_idx, other=-1)
        rows = dkv_ptr + gl.where(ids >= 0, ids, 0).to(gl.int64) * D
        gl.atomic_add(rows[:, None] + cols[None, :], ones, mask=(ids >= 0)[:, None], sem="relaxed")
        if SYNC == 1:  # what a pipelined kernel does between tiles: a block barrier ...
            gl.thread_barrier()
        if SYNC == 2:  # ... or a CTA-scope release (what an mbarrier arrive implies)
            gl.inline_asm_elementwise("fence.acq_rel.cta; mov.u32 $0, $1;", "=r,r", [k0], dtype=gl.int32,
                                      is_pure=False, pack=1)


@gluon.jit
def reducer_kernel(idx_ptr, dkv_ptr, n_idx, stride_it, stride_dkv, BLOCK_N: gl.constexpr, NBLK: gl.constexpr,
                   SRC: gl.constexpr, WAIT: gl.constexpr):
    """The Gluon dkv pass's reducer alone: per token (one program, hog 128 KB), per 64-key tile, NBLK blocks of
    64 columns of rows stride_dkv apart. SRC 1: the values from an fp32 tile in shared memory (the acc
    ring's layout), else registers; WAIT 1: an mbarrier wait (acquire) before each block."""
    t = gl.program_id(0).to(gl.int64)
    _hog(128)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [gl.num_warps(), 1], [1, 0])
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    ones = gl.full([BLOCK_N, 64], 1.0, gl.float32, layout)
    tile = gl.allocate_shared_memory(gl.float32, [BLOCK_N, 64], gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.float32))
    tile.store(ones)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.arrive(bar, count=1)  # phase 0 complete: every wait below passes at once
    gl.thread_barrier()
    for k0 in range(0, n_idx, BLOCK_N):
        j = k0 + keys
        ids = gl.load(idx_ptr + t * stride_it + j, mask=j < n_idx, other=-1)
        rows = dkv_ptr + gl.where(ids >= 0, ids, 0).to(gl.int64) * stride_dkv
        live = (ids >= 0)[:, None] & (cols >= 0)[None, :]
        for c in gl.static_range(NBLK):
            if WAIT:
                mbarrier.wait(bar, 0)
            if SRC:
                vals = tile.load(layout)
            else:
                vals = ones
            gl.atomic_add(rows[:, None] + (c * 64 + cols)[None, :], vals, mask=live, sem="relaxed")


@gluon.jit
def tma_kernel(idx_ptr, dkv_ptr, n_keys, n_idx, stride_it, BLOCK_N: gl.constexpr, COLS: gl.constexpr,
               WHOLE_ROW: gl.constexpr, HOG: gl.constexpr):
    t = gl.program_id(0).to(gl.int64)
    c0 = gl.program_id(1) * COLS
    _hog(HOG)
    fill_l: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 2, 16], [gl.num_warps(), 1, 1], [2, 1, 0])
    ones = gl.full([BLOCK_N, 1, 64], 1.0, gl.float32, fill_l)
    if WHOLE_ROW:  # one reduce per key: the row as [1, D // 64, 64]
        sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
        desc = tma.make_tensor_descriptor(dkv_ptr, [n_keys, D // 64, 64], [D, 64, 1], [1, D // 64, 64], sl)
        buf = gl.allocate_shared_memory(gl.float32, [BLOCK_N, D // 64, 64], sl)
        for c in gl.static_range(D // 64):
            buf.slice(c, 1, dim=1).store(ones)
    else:
        sl2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        desc = tma.make_tensor_descriptor(dkv_ptr, [n_keys, D], [D, 1], [1, COLS], sl2)
        buf = gl.allocate_shared_memory(gl.float32, [BLOCK_N, COLS], sl2)
        for c in gl.static_range(COLS // 64):
            buf.slice(c * 64, 64, dim=1).store(gl.reshape(ones, [BLOCK_N, 64]))
    fence_async_shared()
    gl.thread_barrier()
    for k0 in range(0, n_idx, BLOCK_N):  # n_idx a multiple of BLOCK_N here
        for r in gl.static_range(BLOCK_N):
            key = gl.load(idx_ptr + t * stride_it + k0 + r)
            if key >= 0:
                if WHOLE_ROW:
                    async_reduce_add(desc, [key, 0, 0], buf.slice(r, 1))
                else:
                    async_reduce_add(desc, [key, c0], buf.slice(r, 1))
    tma.store_wait(0)


def _inputs(tokens: int, topk: int, n_keys: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.argsort(torch.rand(tokens, n_keys, device="cuda", generator=g), dim=1)[:, :topk].int().contiguous()
    counts = torch.bincount(idx.flatten().long(), minlength=n_keys).float()
    return idx, counts


def _launch(case: dict, idx, dkv):
    tokens, topk = idx.shape
    name, block_n, cols, hog = case["impl"], case["block_n"], case["cols"], case.get("hog", 0)
    if name == "reducer":
        reducer_kernel[(tokens, )](idx, dkv, topk, idx.stride(0), dkv.stride(0), BLOCK_N=block_n, NBLK=dkv.shape[1] // 64,
                                   SRC=case.get("src", 0), WAIT=case.get("wait", 0), num_warps=case["warps"])
    elif name == "atomic":
        atomic_kernel[(tokens, 512 // cols)](idx, dkv, topk, idx.stride(0), BLOCK_N=block_n, COLS=cols,
                                             TPW_C=case.get("tpw_c", 32), HOG=hog, SYNC=case.get("sync", 0),
                                             num_warps=case["warps"])
    else:
        whole = name == "tma_row"
        tma_kernel[(tokens, 1 if whole else 512 // cols)](idx, dkv, dkv.shape[0], topk, idx.stride(0), BLOCK_N=block_n,
                                                        COLS=cols, WHOLE_ROW=whole, HOG=hog,
                                                        num_warps=case["warps"])


def _case(impl, block_n, cols, warps, hog=0, **kw):
    return {"impl": impl, "block_n": block_n, "cols": cols, "warps": warps, "hog": hog, **kw}


# high occupancy (no hog: up to 64 warps a SM) against the dkv pass's one program of 8 warps a SM (hog 128 KB)
# and two (96 KB); the thread layout (16 or 32 threads along the columns) and warps a program
# the dkv pass's reducer alone, 576-column rows (row576): registers / shared memory, an mbarrier wait or not
CASES = [_case("reducer", 64, 576, 4, 128, row576=True), _case("reducer", 64, 576, 4, 128, row576=True, src=1),
         _case("reducer", 64, 576, 4, 128, row576=True, wait=1),
         _case("reducer", 64, 576, 4, 128, row576=True, src=1, wait=1),
         _case("reducer", 64, 512, 4, 128), _case("reducer", 64, 576, 4, 128, row576=True, sorted=True),
         _case("atomic", 64, 64, 4, 128, tpw_c=16), _case("atomic", 64, 64, 4, 128, tpw_c=16, sync=1),
         _case("atomic", 64, 64, 4, 128, tpw_c=16, sync=2), _case("atomic", 64, 128, 8, 128, sync=1),
         _case("atomic", 64, 128, 8, 128, sync=2), _case("atomic", 64, 64, 4, 0, tpw_c=16, sync=1),
         _case("atomic", 64, 64, 4, 128, tpw_c=16, sorted=True),
         _case("atomic", 64, 64, 4, 128, tpw_c=16, sync=1, sorted=True),
         _case("atomic", 64, 64, 4), _case("atomic", 64, 64, 4, tpw_c=16), _case("atomic", 64, 128, 4),
         _case("atomic", 64, 128, 8, 128), _case("atomic", 64, 128, 8, 96),
         _case("atomic", 64, 64, 8, 128, tpw_c=16), _case("atomic", 64, 128, 16, 128),
         _case("atomic", 64, 128, 32, 128), _case("atomic", 64, 128, 16, 96),
         _case("tma", 32, 128, 4), _case("tma", 32, 128, 4, 128), _case("tma", 32, 128, 8, 96),
         _case("tma", 32, 64, 4, 128), _case("tma_row", 16, 512, 4, 128)]


def measure(tokens: int = 2048, topk: int = 2048, n_keys: int = 65536) -> dict:
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    idx, counts = _inputs(tokens, topk, n_keys)
    sorted_idx = idx.sort(dim=1).values  # each token's keys in order, as the kernels benchmark gives them
    dkv512 = torch.zeros(n_keys, 512, device="cuda", dtype=torch.float32)
    dkv576 = torch.zeros(n_keys, 576, device="cuda", dtype=torch.float32)
    rows = []
    for case in CASES:
        row = dict(case)
        dkv = dkv576 if case.get("row576") else dkv512
        red_bytes = tokens * topk * dkv.shape[1] * 4
        try:
            dkv.zero_()
            ix = sorted_idx if case.get("sorted") else idx
            _launch(case, ix, dkv)
            torch.cuda.synchronize()
            row["max_err"] = (dkv - counts[:, None]).abs().max().item()
            ms = triton.testing.do_bench(lambda: _launch(case, ix, dkv), warmup=3, rep=30)
            row |= {"ms": round(ms, 3), "reduce_gb_s": round(red_bytes / ms / 1e6, 1)}
        except Exception as exc:  # report and go on: one impl failing to build says something too
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    props = torch.cuda.get_device_properties(0)
    return {"what": "fp32 scatter-add rate: thread atomics vs TMA bulk reduce from shared memory",
            "machine": {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                        "triton": triton.__version__},
            "shape": {"tokens": tokens, "topk": topk, "n_keys": n_keys, "cols": 512},
            "rows": rows}


def compile_only() -> int:
    from bench.kernel_resources import Ptr, compile_sm90
    args = {"idx_ptr": Ptr("i32"), "dkv_ptr": Ptr("fp32"), "n_keys": 65536, "n_idx": 2048, "stride_it": 2048}
    for case in CASES:
        cx = {"BLOCK_N": case["block_n"], "COLS": case["cols"], "HOG": case["hog"]}
        if case["impl"] == "reducer":
            a = {k: v for k, v in args.items() if k != "n_keys"} | {"stride_dkv": 576}
            print(json.dumps({**case, **compile_sm90(reducer_kernel, a, {"BLOCK_N": 64, "NBLK": 9, "SRC": case.get("src", 0),
                                                                         "WAIT": case.get("wait", 0)}, 4, 1)}))
            continue
        if case["impl"] == "atomic":
            fn, a = atomic_kernel, {k: v for k, v in args.items() if k != "n_keys"}
            cx = cx | {"TPW_C": case.get("tpw_c", 32), "SYNC": case.get("sync", 0)}
        else:
            fn, a, cx = tma_kernel, args, cx | {"WHOLE_ROW": case["impl"] == "tma_row"}
        print(json.dumps({**case, **compile_sm90(fn, a, cx, case["warps"], 1)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_probe(__doc__, argv, compile_only, measure)


if __name__ == "__main__":
    sys.exit(main())
