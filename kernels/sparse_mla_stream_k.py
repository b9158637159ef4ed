"""Stream-K for the sparse MLA forward: every SM gets the same number of key tiles, and the items cut between two
SMs are merged after by a small kernel (Osama et al. 2023, "Stream-K: Work-centric Parallel Decomposition for
Dense Matrix-Matrix Multiplication on the GPU", applied to attention's key loop as flash-decoding splits it).

Why: the forward holds one program an SM (its shared memory is full), a program per (token, 64 heads). At 4096
tokens on 132 SMs that is 31 full waves and a 32nd of 4 programs: 3% of the run with 128 SMs idle. Here work is
counted in units of one key-tile pair (128 keys) of one item (a token's block of 64 heads), U = items x pairs of
them, and program g of G (one a SM) takes units [g U // G, (g + 1) U // G) in item order: at most two of its
items are cut (its first and its last), each written as a partial (the unnormalised output in fp32, the running
max in base 2 and the row sum) to a workspace slot, 2 g for a first segment and 2 g + 1 for a last one;
`combine_partials` merges each cut item's partials into out and lse.

This module is plain Triton and Python (the schedule, the merge); the Gluon kernel that follows the schedule is
kernels/sparse_mla_gluon_stream.py.
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
    """The SMs of device: a launch's programs a wave where each holds a whole SM (the Gluon forwards' shared
    memory admits one)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def program_units(g: int, units: int, programs: int) -> tuple[int, int]:
    """Program g's units [start, end): the same split the kernel computes (it rounds the same way)."""
    return g * units // programs, (g + 1) * units // programs


def segments(g: int, units: int, pairs: int, programs: int) -> list[tuple[int, int, int, int]]:
    """Program g's segments in the order it runs them, as (item, first pair, end pair, slot): the kernel's
    _run and _segment, written out in Python. slot is the partial's workspace slot, -1 for a whole item."""
    start, end = program_units(g, units, programs)
    out = []
    for s, item in enumerate(range(start // pairs, (end - 1) // pairs + 1) if end > start else ()):
        p0, p1 = max(start - item * pairs, 0), min(end - item * pairs, pairs)
        out.append((item, p0, p1, 2 * g + min(s, 1) if p0 > 0 or p1 < pairs else -1))
    return out


@functools.lru_cache(maxsize=64)
def cut_items(items: int, pairs: int, programs: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The items split between programs, each with the workspace slots its partials are in (in key order).
    Only a program's first segment (slot 2 g) and its last (2 g + 1) can be cut."""
    if items < 0 or pairs < 1 or programs < 1:
        raise ValueError(f"need items >= 0, pairs >= 1, programs >= 1; got {items}, {pairs}, {programs}")
    parts: dict[int, list[int]] = {}
    for g in range(programs):
        for item, _, _, slot in segments(g, items * pairs, pairs, programs):
            if slot >= 0:
                parts.setdefault(item, []).append(slot)
    return tuple((item, tuple(slots)) for item, slots in sorted(parts.items()))


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
    """Writes out and lse of every cut item (cut_items' or tail_cut_items' list) from its partials in ws and ml
    (in place)."""
    if not cut:
        return
    cut, offsets, slots = _cut_table(cut, str(out.device))
    T, heads, d_v = out.shape
    _combine[(cut.numel(), d_v // COMBINE_COLS)](
        ws, ml, cut, offsets, slots, out, lse, out.stride(0), out.stride(1), lse.stride(0), HEADS=heads,
        HB=triton.cdiv(heads, block_h), BLOCK_H=block_h, D_V=d_v, COLS=COMBINE_COLS, num_warps=4)
