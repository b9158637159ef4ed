"""Scatter-add of fp32 tiles into global memory: Triton's atomics, or 8-byte vector reductions
issued from the accumulator's own layout.

VEC=1 is ``tl.atomic_add``. When Triton can prove 16-byte alignment (the JIT marks pointers and
strides divisible by 16) it emits ``atom.global.add.v4.f32``, after moving the MMA accumulator
into a blocked layout through shared memory (seen with bench/kernel_resources.py: the split dkv
kernel needs 28 KB more shared memory for it). VEC=2 skips that move: an MMA accumulator gives
each thread pairs of adjacent columns, and inline asm issues ``red.global.add.v2.f32`` (sm_90,
PTX 8.1) per pair. The asm checks at run time that the pair is adjacent and 8-byte aligned and
otherwise issues two scalar reductions, so the result never depends on the layout the compiler
picked, only the speed does. The Triton interpreter cannot run inline asm: there only VEC=1.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

# $0, $1 dummy outputs; $2, $3 row addresses (int64); $4, $5 column indices (int32);
# $6, $7 values; $8, $9 masks. Address = row + 4 * column, computed here so that the compiler
# keeps one 64-bit register per row instead of one per element (255 registers and spills
# otherwise, measured with ptxas for the dkv tiles).
_RED_F32X2 = tl.constexpr("""{
    .reg .pred pv, p0, p1, scalar;
    .reg .b64 a0, a1, low;
    .reg .s32 gap;
    mad.wide.s32 a0, $4, 4, $2;
    mad.wide.s32 a1, $5, 4, $3;
    sub.s32 gap, $5, $4;
    and.b64 low, a0, 7;
    setp.ne.s32 p0, $8, 0;
    setp.ne.s32 p1, $9, 0;
    setp.eq.s64 pv, $2, $3;
    setp.eq.and.s32 pv, gap, 1, pv;
    setp.eq.and.s64 pv, low, 0, pv;
    and.pred pv, pv, p0;
    and.pred pv, pv, p1;
    @pv red.global.add.v2.f32 [a0], {$6, $7};
    not.pred scalar, pv;
    and.pred p0, p0, scalar;
    and.pred p1, p1, scalar;
    @p0 red.global.add.f32 [a0], $6;
    @p1 red.global.add.f32 [a1], $7;
    mov.b32 $0, 0;
    mov.b32 $1, 0;
}""")


@triton.jit
def red_add_rows_f32(row_ptrs, cols, vals, row_ok, VEC: tl.constexpr):
    """row_ptrs[r][cols[c]] += vals[r, c] for rows with row_ok (fp32, relaxed, gpu scope).

    row_ptrs [R] fp32 pointers, cols [C] int32, vals [R, C], row_ok [R]. VEC 2 packs adjacent
    pairs into one 8-byte reduction (checked per pair at run time), VEC 1 is tl.atomic_add."""
    if VEC == 2:
        rows2 = tl.broadcast_to(row_ptrs.to(tl.int64, bitcast=True)[:, None], vals.shape)
        cols2 = tl.broadcast_to(cols[None, :], vals.shape)
        ok2 = tl.broadcast_to(row_ok.to(tl.int32)[:, None], vals.shape)
        tl.inline_asm_elementwise(
            asm=_RED_F32X2, constraints="=r,=r,l,l,r,r,f,f,r,r",
            args=[rows2, cols2, vals.to(tl.float32), ok2], dtype=tl.int32, is_pure=False, pack=2)
    else:
        tl.atomic_add(row_ptrs[:, None] + cols[None, :], vals, mask=row_ok[:, None], sem="relaxed")


def check_red_vec(red_vec: int, device) -> int:
    """red_vec itself if this device can run it; a one-line error naming the fix otherwise."""
    import torch

    if red_vec not in (1, 2):
        raise ValueError(f"red_vec must be 1 (tl.atomic_add) or 2 (inline-asm v2 reductions), got {red_vec!r}")
    if red_vec == 2 and (device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
                         or torch.cuda.get_device_capability(device)[0] < 9):
        raise ValueError("red_vec=2 needs a CUDA device of compute capability >= 9.0 (not the interpreter); "
                         "use red_vec=1")
    return red_vec
