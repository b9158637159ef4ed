"""The sparse MLA forward's last wave: its items cut into pieces of key-tile pairs, a program each, and the pieces'
partials merged after (flash-decoding's split of the key loop, for the tail only).

Why: the Gluon forwards hold one program an SM (their shared memory is full), a program per item (a token's block
of 64 heads). At 4096 tokens on 132 SMs that is 31 full waves and a 32nd of 4 programs, which holds the run for a
whole program's time with 128 SMs idle: on the H200 4092 tokens took 2.919 ms against 3.022 for 4096
(bench/results/sparse_mla_gluon_gpu.json run 7). `tail_split` keeps a program per item for the full waves and cuts
each of the last wave's items into `split` pieces of about pairs / split key-tile pairs (128 keys a pair), as many
as fit on the SMs beside each other; piece k writes a partial (its output unnormalised in fp32, the running max in
base 2 and the row sum) to workspace slot k, and `combine_partials` merges each cut item's partials into out and
lse. A persistent kernel with the work split evenly over the SMs (Stream-K) was tried first and dropped: an item's
finish inside its loop over pairs cost it 15-20% (runs 7-9).

This module is plain Triton and Python; kernels/sparse_mla_gluon_pair.py cuts its tail with it.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
COMBINE_COLS = 128  # value columns a merge program takes: [64, 128] fp32, 32 KB of registers for 4 warps


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    """The SMs of device: a wave of programs where each holds a whole SM (the Gluon forwards' shared memory
    admits one)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def tail_split(items: int, pairs: int, sms: int) -> tuple[int, int]:
    """(whole, split) for a launch of a program per item, one program an SM: the first `whole` items fill
    whole waves, a program each; each of the rest (the last wave's) is cut into `split` pieces of about
    pairs / split key-tile pairs, a program each, as many as fit beside each other on the SMs. split is 1
    (nothing cut) where the last wave is full or too full to cut (more than half the SMs)."""
    if items < 0 or pairs < 1 or sms < 1:
        raise ValueError(f"need items >= 0, pairs >= 1, sms >= 1; got {items}, {pairs}, {sms}")
    rest = items % sms
    split = min(pairs, sms // rest) if rest else 1
    return (items - rest, split) if split > 1 else (items, 1)


def tail_piece(k: int, pairs: int, split: int) -> tuple[int, int]:
    """Piece k % split's pairs [p0, p1) of its item: what the kernel computes for tail program k."""
    c = k % split
    return c * pairs // split, (c + 1) * pairs // split


@functools.lru_cache(maxsize=64)
def tail_cut_items(items: int, pairs: int, sms: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """tail_split's cut items with their workspace slots (tail program k writes slot k)."""
    whole, split = tail_split(items, pairs, sms)
    return tuple((whole + r, tuple(range(r * split, (r + 1) * split))) for r in range((items - whole) if split > 1
                                                                                      else 0))


@functools.lru_cache(maxsize=64)
def _cut_table(cut: tuple[tuple[int, tuple[int, ...]], ...], device: str) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
    """A cut list as three int32 tensors on device: the cut items, offsets into the slots (CSR), the slots."""
    offsets = [0]
    for _, slots in cut:
        offsets.append(offsets[-1] + len(slots))
    as_t = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    return as_t([i for i, _ in cut]), as_t(offsets), as_t([s for _, slots in cut for s in slots])


@triton.jit
def _combine(ws_ptr, ml_ptr, cut_ptr, off_ptr, slot_ptr, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt,
             HEADS: tl.constexpr, HB: tl.constexpr, BLOCK_H: tl.constexpr, D_V: tl.constexpr, COLS: tl.constexpr):
    """out[t, h0 + r, cols] = sum_c 2^(m_c - M) o_c / sum_c 2^(m_c - M) den_c over the item's partials c
    (M their max; rows with no valid key anywhere give 0 and lse -inf, as the kernels do)."""
    n = tl.program_id(0)
    cb = tl.program_id(1)
    item = tl.load(cut_ptr + n)
    lo = tl.load(off_ptr + n)
    hi = tl.load(off_ptr + n + 1)
    t = (item // HB).to(tl.int64)
    h0 = (item % HB) * BLOCK_H
    r = tl.arange(0, BLOCK_H)
    cols = cb * COLS + tl.arange(0, COLS)
    big = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for k in range(lo, hi):
        slot = tl.load(slot_ptr + k).to(tl.int64)
        big = tl.maximum(big, tl.load(ml_ptr + slot * 2 * BLOCK_H + r))
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, COLS], tl.float32)
    for k in range(lo, hi):
        slot = tl.load(slot_ptr + k).to(tl.int64)
        w = tl.exp2(tl.load(ml_ptr + slot * 2 * BLOCK_H + r) - big_safe)  # 0 for a partial with no valid key
        den += w * tl.load(ml_ptr + slot * 2 * BLOCK_H + BLOCK_H + r)
        acc += w[:, None] * tl.load(ws_ptr + slot * BLOCK_H * D_V + r[:, None] * D_V + cols[None, :])
    den_safe = tl.where(den > 0, den, 1.0)
    heads = h0 + r
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :],
             (acc / den_safe[:, None]).to(out_ptr.dtype.element_ty), mask=(heads < HEADS)[:, None])
    if cb == 0:
        lse = tl.where(den > 0, (big + tl.log2(den_safe)) / 1.4426950408889634, float("-inf"))  # / log2(e)
        tl.store(lse_ptr + t * stride_lt + heads, lse, mask=heads < HEADS)


def workspace(slots: int, block_h: int, d_v: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials' slots: ws [slots, block_h, d_v] fp32 (unnormalised outputs), ml [slots, 2, block_h] fp32
    (the running max in base 2, then the row sum). Only cut items' slots are written and read."""
    return (torch.empty(max(slots, 1), block_h, d_v, device=device, dtype=torch.float32),
            torch.empty(max(slots, 1), 2, block_h, device=device, dtype=torch.float32))


def combine_partials(ws: torch.Tensor, ml: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     cut: tuple[tuple[int, tuple[int, ...]], ...], block_h: int) -> None:
    """Writes out and lse of every cut item (tail_cut_items' list) from its partials in ws and ml (in place)."""
    if not cut:
        return
    cut, offsets, slots = _cut_table(cut, str(out.device))
    T, heads, d_v = out.shape
    _combine[(cut.numel(), d_v // COMBINE_COLS)](
        ws, ml, cut, offsets, slots, out, lse, out.stride(0), out.stride(1), lse.stride(0), HEADS=heads,
        HB=triton.cdiv(heads, block_h), BLOCK_H=block_h, D_V=d_v, COLS=COMBINE_COLS, num_warps=4)
