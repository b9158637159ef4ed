"""Sparse MLA backward as two kernels: dq with dS and P written out, then dkv from them.

Same math and semantics as kernels/sparse_mla_bwd.py (duplicate keys in a row add twice, -1 slots
add nothing). Why split: the fused atomic kernel must hold a [heads, 576] fp32 dq accumulator and
a [keys, 576] fp32 dkv tile at once, which at 64 heads needs 311-418 KB of shared memory and
registers, so it runs 32 heads x 32 keys on mma.sync, two programs per token, each scatter-adding
its own partial dkv. Here:
- dq pass (on sm_90 with bf16 and 64-head blocks: kernels/sparse_mla_bwd_gluon.py, 1.8x faster,
  same contract; elsewhere kernels/sparse_mla_bwd_rows.py with STORE_DSP): one program per (token, heads block)
  recomputes S and P from lse, accumulates dq, and stores the bf16 dS and P tiles it already
  needed for its own dots into a [tokens, heads, topk] scratch (keys contiguous, the order of
  its accumulator's rows). No dkv tile, so it runs 64 heads x 64 keys on wgmma (one stage: two
  stages of KV rows need 295 KB of shared memory, bench/kernel_resources.py).
- dkv pass (on sm_90 with bf16 and exactly 64 heads: kernels/sparse_mla_bwd_dkv_gluon.py, loads, GEMMs
  and reductions in separate warps, whole dkv rows a program over bands of keys (this function sorts each
  idx row first when it bands), 1.41x on an H100, same contract; elsewhere ``_dkv_from_dsp_kernel``):
  one program per (token, column group) loads its q and dO
  columns once and, per key tile, reads dS^T and P^T [keys, heads] back and computes dK = dS^T q
  and dV = P^T dO: two
  GEMMs over all heads of the token, so each selected key gets one reduction per token (half the
  fused kernel's two programs per token). tl.atomic_add issues them as atom.global.add.v4.f32
  (16 bytes each; Triton proves the alignment from the JIT's divisibility marks). An inline-asm
  red.global.add.v2.f32 from the accumulator's own layout, which saves the layout change through
  shared memory, measured slower on the H200: this pass 11.6 vs 9.2 ms.
The scratch costs 4 bytes per (token, head, slot) written once and read once (2 GiB at 4096
tokens x 2048 x 64 heads); tokens are processed in chunks so that it stays under
SCRATCH_BYTES. dS and P are rounded to bf16 exactly where the fused kernel rounds them for its
dkv dots, so both impls compute the same products and differ only in summation order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import sparse_mla_bwd_dkv_gluon, sparse_mla_bwd_gluon, sparse_mla_gluon
from kernels._tuning import Autotuner, KernelConfig
from kernels.sparse_mla import LOG2E, _bucket, gluon_runs
from kernels.sparse_mla_bwd_rows import sparse_mla_bwd_rows_kernel

# Upper bound of the dS + P scratch: 1 GiB is 2048 tokens at top-2048 x 64 heads.
SCRATCH_BYTES = 1 << 30
# H200, one 2048-token chunk of the benchmark (4096 x top-2048 of 64K), ms; shared memory from
# bench/kernel_resources.py (the limit is 227 KB). Configs measured slower are left out.
# dq pass, 64 heads x 64 keys: 1 stage 4.66-4.69 (221 KB; 2 stages need 295 KB), 16 warps 11.2;
# 64 x 32: 2 stages 6.43-6.47 (217 KB), 3 stages 6.81; 32 heads x 32 keys (mma.sync) 10.3-10.4.
# dkv pass, 64 keys: one program per token, 4 column blocks of 128, 1 stage 4.64-4.67 (188 KB);
# 2 programs per token 5.07-5.10 (2 stages, 139 KB), 5.42-5.58 (1 stage); 4 programs (106 KB,
# two per SM) 4.77-4.86; 128 keys, 2 programs 5.21-5.28. With plain stores instead of the atomics
# (bench/gpu/split_dkv_floor.py) the 4-program layout takes 3.31 ms. On an H100 (session 22,
# bench/results/tma_reduce_probe_gpu.json) the 4-program layout is the tuner's pick: programs running
# at once add into a band of dkv columns L2 holds (128 of 576 columns: 33.5 MB), and whole rows (151
# MB) halve the reductions' rate there; the H200's 1.4x faster HBM makes those L2 misses cheaper.
DQ_CONFIGS = [
    KernelConfig.make(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1),
    KernelConfig.make(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2),
    KernelConfig.make(BLOCK_H=32, BLOCK_N=32, num_warps=8, num_stages=1),  # the smallest footprint
]
DKV_CONFIGS = [
    KernelConfig.make(BLOCK_N=64, N_COLS=4, COL_SPLIT=1, num_warps=8, num_stages=1),
    KernelConfig.make(BLOCK_N=64, N_COLS=1, COL_SPLIT=4, num_warps=8, num_stages=2),
    KernelConfig.make(BLOCK_N=64, N_COLS=2, COL_SPLIT=2, num_warps=8, num_stages=2),
]
# "gluon": kernels/sparse_mla_bwd_gluon.py (bf16, 512 + 64 columns, sm_90); "triton": DQ_CONFIGS, tuned
DQ_IMPLS = ("gluon", "triton")
# "gluon": kernels/sparse_mla_bwd_dkv_gluon.py (the dq pass's rule and exactly 64 heads); "triton": DKV_CONFIGS
DKV_IMPLS = ("gluon", "triton")
DQ_TUNER = Autotuner("sparse_mla_bwd_split_dq", DQ_CONFIGS)
DKV_TUNER = Autotuner("sparse_mla_bwd_split_dkv", DKV_CONFIGS)


@triton.jit
def _dkv_columns(rows, cols, ds_t, p_t, q_c, do_c, valid):
    """dkv[rows, cols] += dS^T q[:, cols] + P^T dO[:, cols] for one key tile and column block."""
    dk = tl.dot(ds_t, q_c)
    dk = tl.dot(p_t, do_c, dk)
    tl.atomic_add(rows[:, None] + cols[None, :], dk, mask=valid[:, None], sem="relaxed")


@triton.jit
def _dkv_from_dsp_kernel(q_ptr, do_ptr, idx_ptr, ds_ptr, p_ptr, dkv_ptr, n_idx,
                         stride_qt, stride_qh, stride_dot, stride_doh, stride_it, stride_st, stride_dkv,
                         HEADS: tl.constexpr, D_V: tl.constexpr, D_R: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, N_COLS: tl.constexpr,
                         COL_SPLIT: tl.constexpr):
    # Program (token, s) owns value columns [s, s + 1) * D_V / COL_SPLIT in N_COLS (1, 2 or 4)
    # blocks, and the last one also the rope columns: a whole [keys, 512] fp32 tile spills (2.7 KB
    # a thread at 64 keys, 8 warps: bench/kernel_resources.py). Its q / dO column blocks are loaded
    # once, before the key loop, so they stay in shared memory; COL_SPLIT 2 halves that footprint
    # (and reads each dS / P tile twice).
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    dr = tl.arange(0, D_R)
    BLOCK_C: tl.constexpr = D_V // (N_COLS * COL_SPLIT)
    c = part * (D_V // COL_SPLIT) + tl.arange(0, BLOCK_C)
    for h0 in tl.static_range(0, HEADS, BLOCK_H):  # one block at GLM-5.2's 64 heads
        heads = h0 + tl.arange(0, BLOCK_H)
        head_ok = heads < HEADS
        q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
        do_row = do_ptr + t * stride_dot + heads[:, None] * stride_doh
        q_rope = tl.load(q_row + D_V + dr[None, :], mask=head_ok[:, None], other=0.0)
        q0 = tl.load(q_row + c[None, :], mask=head_ok[:, None], other=0.0)
        do0 = tl.load(do_row + c[None, :], mask=head_ok[:, None], other=0.0)
        if N_COLS >= 2:
            q1 = tl.load(q_row + BLOCK_C + c[None, :], mask=head_ok[:, None], other=0.0)
            do1 = tl.load(do_row + BLOCK_C + c[None, :], mask=head_ok[:, None], other=0.0)
        if N_COLS == 4:
            q2 = tl.load(q_row + 2 * BLOCK_C + c[None, :], mask=head_ok[:, None], other=0.0)
            do2 = tl.load(do_row + 2 * BLOCK_C + c[None, :], mask=head_ok[:, None], other=0.0)
            q3 = tl.load(q_row + 3 * BLOCK_C + c[None, :], mask=head_ok[:, None], other=0.0)
            do3 = tl.load(do_row + 3 * BLOCK_C + c[None, :], mask=head_ok[:, None], other=0.0)
        for start in range(0, n_idx, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            in_row = j < n_idx
            ids = tl.load(idx_ptr + t * stride_it + j, mask=in_row, other=-1)
            valid = ids >= 0
            slot = t * stride_st + heads[:, None] * n_idx + j[None, :]
            keep = head_ok[:, None] & in_row[None, :]
            ds_t = tl.trans(tl.load(ds_ptr + slot, mask=keep, other=0.0))  # [keys, heads]
            p_t = tl.trans(tl.load(p_ptr + slot, mask=keep, other=0.0))
            rows = dkv_ptr + tl.where(valid, ids, 0).to(tl.int64) * stride_dkv
            _dkv_columns(rows, c, ds_t, p_t, q0, do0, valid)
            if N_COLS >= 2:
                _dkv_columns(rows, BLOCK_C + c, ds_t, p_t, q1, do1, valid)
            if N_COLS == 4:
                _dkv_columns(rows, 2 * BLOCK_C + c, ds_t, p_t, q2, do2, valid)
                _dkv_columns(rows, 3 * BLOCK_C + c, ds_t, p_t, q3, do3, valid)
            if part == COL_SPLIT - 1:
                tl.atomic_add(rows[:, None] + D_V + dr[None, :], tl.dot(ds_t, q_rope), mask=valid[:, None],
                              sem="relaxed")


def _n_cols(n_cols: int, col_split: int, d_v: int) -> tuple[int, int]:
    """The config's (column blocks, programs per token), fewer where a block would be under
    tl.dot's 16 columns."""
    while n_cols > 1 and d_v // (n_cols * col_split) < 16:
        n_cols //= 2
    while col_split > 1 and d_v // (n_cols * col_split) < 16:
        col_split //= 2
    return n_cols, col_split


def dkv_pass(cfg: KernelConfig, q: torch.Tensor, grad_out: torch.Tensor, idx: torch.Tensor, ds: torch.Tensor,
             p: torch.Tensor, dkv: torch.Tensor, d_v: int) -> None:
    """dkv += the dkv pass over q's tokens from their dS / P scratch rows (cfg: a DKV_CONFIGS entry);
    bench/gpu/split_dkv_floor.py runs it from copies of this module."""
    n, heads, dim = q.shape
    n_cols, col_split = _n_cols(cfg["N_COLS"], cfg["COL_SPLIT"], d_v)
    _dkv_from_dsp_kernel[(n, col_split)](
        q, grad_out, idx, ds, p, dkv, idx.shape[1],
        q.stride(0), q.stride(1), grad_out.stride(0), grad_out.stride(1), idx.stride(0), ds.stride(0),
        dkv.stride(0), HEADS=heads, D_V=d_v, D_R=dim - d_v, BLOCK_H=min(64, max(16, triton.next_power_of_2(heads))),
        BLOCK_N=cfg["BLOCK_N"], N_COLS=n_cols, COL_SPLIT=col_split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _chunk_tokens(n_idx: int, heads: int, itemsize: int) -> int:
    per_token = max(1, 2 * n_idx * heads * itemsize)
    return max(1, SCRATCH_BYTES // per_token)


def tuning_key(q: torch.Tensor, idx: torch.Tensor) -> tuple:
    T, heads, dim = q.shape
    return (min(_bucket(T), 4096), heads, dim, idx.shape[1], q.dtype)


def default_dq_impl(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> str:
    """The DQ_IMPLS entry split_backward takes when none is named: "gluon" where the forward's Gluon kernels
    would be taken (sparse_mla.gluon_runs: they run and no 64-head block is padded), else "triton"."""
    return "gluon" if gluon_runs(q, kv, d_v) else "triton"


def default_dkv_impl(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> str:
    """The DKV_IMPLS entry split_backward takes when none is named: "gluon" where the Gluon kernels run
    and a token has exactly the 64 heads its GEMMs take as K."""
    return "gluon" if _dkv_gluon_runs(q, kv, d_v) else "triton"


def _dkv_gluon_runs(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> bool:
    return sparse_mla_gluon.supports(q, kv, d_v) and q.shape[1] == sparse_mla_bwd_dkv_gluon.HEADS


def _check_impl(what: str, impl: str, impls: tuple[str, ...], runs: bool, needs: str, q: torch.Tensor,
                d_v: int) -> None:
    if impl not in impls:
        raise ValueError(f"{what} must be one of {impls}, got {impl!r}")
    if impl != "triton" and not runs:
        raise ValueError(f"{what}={impl!r} needs {needs}; got q {q.dtype} {tuple(q.shape)} on {q.device}, "
                         f"d_v={d_v} (use {what}='triton')")


def split_backward(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, grad_out: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, sm_scale: float, d_v: int,
                   pass_ms: dict[str, float] | None = None, dq_impl: str | None = None,
                   dkv_impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dkv fp32) from contiguous inputs, fp32 lse and Delta = rowsum(dO * out) [T, heads]
    (the checks and preparation are sparse_mla_backward's). pass_ms, if given, receives the
    summed CUDA time of each pass ("dq", "dkv"; the benchmark's breakdown, it synchronises).
    dq_impl / dkv_impl: a DQ_IMPLS / DKV_IMPLS entry (None: default_dq_impl's / default_dkv_impl's choice)."""
    T, heads, dim = q.shape
    n_idx = idx.shape[1]
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, device=kv.device, dtype=torch.float32)
    if T == 0 or n_idx == 0:
        return dq.zero_(), dkv
    chunk = min(T, _chunk_tokens(n_idx, heads, q.element_size()))
    ds = torch.empty((chunk, heads, n_idx), device=q.device, dtype=q.dtype)
    p = torch.empty_like(ds)
    key = tuning_key(q, idx)
    dq_impl = dq_impl or default_dq_impl(q, kv, d_v)
    dkv_impl = dkv_impl or default_dkv_impl(q, kv, d_v)
    gpu_rule = "bf16 q and kv on an sm_90 GPU with 512 + 64 columns"
    _check_impl("dq_impl", dq_impl, DQ_IMPLS, sparse_mla_gluon.supports(q, kv, d_v), gpu_rule, q, d_v)
    _check_impl("dkv_impl", dkv_impl, DKV_IMPLS, _dkv_gluon_runs(q, kv, d_v), gpu_rule + " and 64 heads", q, d_v)

    if dkv_impl == "gluon" and sparse_mla_bwd_dkv_gluon.needs_sorted_rows(kv.shape[0]):
        # its programs take bands of keys, found by a search in each row; a row's slot order changes no
        # gradient (dS / P follow idx), only the order of additions into dq
        idx = idx.sort(dim=1).values
    timed = pass_ms is not None and q.is_cuda
    marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def run(name: str, fn) -> None:
        if not timed:
            fn()
            return
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        marks.append((name, start, stop))

    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        qc, ic, gc, lc, dc, dqc = q[c0:c1], idx[c0:c1], grad_out[c0:c1], lse[c0:c1], delta[c0:c1], dq[c0:c1]
        n = c1 - c0

        def launch_dq(cfg: KernelConfig) -> None:
            bh = min(cfg["BLOCK_H"], max(16, triton.next_power_of_2(heads)))
            sparse_mla_bwd_rows_kernel[(n, triton.cdiv(heads, bh))](  # dkv unused: WITH_DKV off
                qc, kv, ic, gc, lc, dc, dqc, dqc, ds, p, sm_scale, sm_scale * LOG2E, n_idx,
                qc.stride(0), qc.stride(1), kv.stride(0), ic.stride(0), gc.stride(0), gc.stride(1),
                lc.stride(0), dqc.stride(0), dqc.stride(1), 0, ds.stride(0),
                HEADS=heads, D_V=d_v, D_R=dim - d_v, BLOCK_H=bh, BLOCK_N=cfg["BLOCK_N"], WITH_DKV=False,
                STORE_DSP=True, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

        def launch_dkv(cfg: KernelConfig, out: torch.Tensor) -> None:
            dkv_pass(cfg, qc, gc, ic, ds, p, out, d_v)

        if dq_impl == "gluon":
            run("dq", lambda: sparse_mla_bwd_gluon.dq_pass(qc, kv, ic, gc, lc, dc, dqc, ds, p, sm_scale))
        else:
            dq_cfg = DQ_TUNER.choose(key, q.device, launch_dq)
            run("dq", lambda: launch_dq(dq_cfg))
        if dkv_impl == "gluon":
            run("dkv", lambda: sparse_mla_bwd_dkv_gluon.dkv_pass(qc, gc, ic, ds, p, dkv))
            continue
        if key not in DKV_TUNER.records:  # tuning adds several times: into a scratch of its own
            scratch = torch.zeros_like(dkv)
            DKV_TUNER.choose(key, q.device, lambda cfg: launch_dkv(cfg, scratch))
            del scratch
        run("dkv", lambda: launch_dkv(DKV_TUNER.records[key].best, dkv))
    if timed:
        torch.cuda.synchronize(q.device)
        for name, start, stop in marks:
            pass_ms[name] = pass_ms.get(name, 0.0) + start.elapsed_time(stop)
    return dq, dkv
