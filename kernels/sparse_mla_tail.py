"""The last wave of a sparse MLA forward launch, cut along the key slots into pieces and merged (exact).

Why: the Gluon forward kernels (sparse_mla_gluon.py, sparse_mla_gluon_pair.py) hold one program per SM (224 KB of
shared memory) and one program per (token, 64 heads), all about equally long. 4096 tokens on 132 SMs are 31 full
waves and a 32nd of 4 programs, during which 128 SMs idle: on the H200 the paired kernel took 3.022 ms for 4096
tokens and 2.919 ms for 4092 (bench/results/sparse_mla_gluon_gpu.json run 7), 3.4% more time for 0.1% more work.
Cutting the tail inside the kernel (a program's item and pair range read from its id) made the kernel itself 13-17%
slower (run 10), so here the kernel is left as it is and launched twice:
- the main launch over the first tokens, whole waves of whole programs;
- a launch over the tail tokens with each token's key slots cut into `pieces` equal runs of whole 128-key pairs
  (the idx rows padded with -1 and reshaped, q's rows repeated), each piece a program writing fp32 partials;
- `_merge_pieces`: out = sum_i exp(lse_i - lse) out_i with lse = logsumexp_i lse_i (each piece's out is normalised
  by its own row sum, so the weights are its share of the total), a piece with no valid key (lse -inf) weighing 0.
`plan_tail` picks the cut from a cost model in units of one pair's time; it cuts only where the model says it pays.
Not yet run on a GPU, so off unless asked for (CUT_BY_DEFAULT below).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

# Whether the Gluon forwards cut a ragged last wave when their caller does not say (tail=None). Off until the cut has
# run on a GPU: written in session 27 and checked on CPU (the merge and the plan under the interpreter, with the Triton
# kernel as the launch; the fp32-partials builds of both Gluon kernels compiled for sm_90 by bench.kernel_resources:
# no spills, no serialised wgmma), but that session got no GPU machine. bench.kernels' sparse MLA entry and
# bench/gpu/sparse_mla_gluon_check.py time and check the cut beside the whole launch; turn this on from their numbers.
CUT_BY_DEFAULT = False
PAIR_KEYS = 128  # a piece holds whole pairs of 64-key tiles (the paired kernel's step; the in-order kernel takes two)
# A program's fixed cost in pair-times: q's 72 KB into shared memory, the first gather's latency before any MMA, the
# finish. Estimated: a 64K-context program of 16 pairs runs about 97 us (3.022 ms / 31.03 waves, H200), so a pair
# about 6 us; the prologue is a few microseconds.
PROGRAM_OVERHEAD_PAIRS = 0.5
MERGE_PAIRS = 0.5  # the merge launch and the q copy, in pair-times (a few microseconds at the benchmark's shape)
MAX_TAIL_WAVES = 3  # whole waves the tail may take from the main launch (more pieces, more partials to merge)
MIN_GAIN = 0.005  # cut only where the model saves at least this share of the launch's time


@dataclass(frozen=True)
class TailPlan:
    """Tokens [0, main_tokens) in one launch; each later token's key slots in `pieces` runs of `piece_pairs`."""
    main_tokens: int
    pieces: int
    piece_pairs: int
    predicted_gain: float  # the model's share of the single launch's time saved

    def __post_init__(self) -> None:
        if self.main_tokens < 0 or self.pieces < 2 or self.piece_pairs < 1:
            raise ValueError(f"a tail plan needs main_tokens >= 0, pieces >= 2, piece_pairs >= 1; got {self}")


def _waves(programs: int, sms: int) -> int:
    return -(-programs // sms)


def launch_cost(tokens: int, head_blocks: int, pairs: int, sms: int) -> float:
    """The model's time, in pair-times, of one launch of a program per (token, head block) of `pairs` pairs."""
    return _waves(tokens * head_blocks, sms) * (pairs + PROGRAM_OVERHEAD_PAIRS)


@functools.lru_cache(maxsize=1024)  # called per layer and step; the search is ~MAX_TAIL_WAVES x pairs candidates
def plan_tail(tokens: int, head_blocks: int, pairs: int, sms: int) -> TailPlan | None:
    """The cheapest cut by the model, or None where one launch is as good (no ragged last wave, or the tail too
    long to spread). tokens x head_blocks programs of `pairs` pairs each, one program an SM at a time."""
    if min(tokens, head_blocks, pairs, sms) < 1:
        raise ValueError(f"tokens, head_blocks, pairs and sms must be >= 1; got {tokens}, {head_blocks}, {pairs}, "
                         f"{sms}")
    whole = launch_cost(tokens, head_blocks, pairs, sms)
    best, best_cost = None, whole * (1 - MIN_GAIN)
    full_waves = tokens * head_blocks // sms
    for taken in range(min(full_waves, MAX_TAIL_WAVES) + 1):
        main = (full_waves - taken) * sms // head_blocks
        tail = tokens - main
        if tail == 0:
            continue
        for pieces in range(2, min(pairs, sms) + 1):
            piece_pairs = -(-pairs // pieces)
            if (pieces - 1) * piece_pairs >= pairs:  # the last piece would be empty: fewer pieces cost the same
                continue
            cost = (launch_cost(main, head_blocks, pairs, sms) if main else 0.0) + MERGE_PAIRS + \
                _waves(tail * pieces * head_blocks, sms) * (piece_pairs + PROGRAM_OVERHEAD_PAIRS)
            if cost < best_cost:
                best, best_cost = (main, pieces, piece_pairs), cost
    if best is None:
        return None
    return TailPlan(*best, predicted_gain=round(1 - best_cost / whole, 4))


# launch(q, idx, out, lse): the forward kernel over these token rows (kv, the scale and the schedule bound)
Launch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def forward_in_waves(launch: Launch, q: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     head_blocks: int, sms: int, plan: TailPlan | None | bool = True) -> TailPlan | None:
    """Fills out [T, heads, d_v] and lse [T, heads] for q [T, heads, D] and idx [T, K] (int32, contiguous) by
    `launch`, the last tokens in pieces where plan_tail (plan=True), the given plan, or never (plan=False/None)
    says. Returns the plan taken."""
    T, K = idx.shape
    if plan is True:
        plan = plan_tail(T, head_blocks, -(-K // PAIR_KEYS), sms) if T and K else None
    if not plan:
        launch(q, idx, out, lse)
        return None
    main, n = plan.main_tokens, plan.pieces
    if main >= T:
        raise ValueError(f"a tail plan with main_tokens={main} leaves no tail of {T} tokens: give fewer main tokens "
                         "or plan=False")
    if main:
        launch(q[:main], idx[:main], out[:main], lse[:main])
    tail = T - main
    width = n * plan.piece_pairs * PAIR_KEYS
    if width < K:
        raise ValueError(f"a tail plan of {n} pieces x {plan.piece_pairs} pairs covers {width} slots, fewer than "
                         f"idx's {K}")
    piece_idx = torch.nn.functional.pad(idx[main:], (0, width - K), value=-1).reshape(tail * n, width // n)
    piece_q = q[main:].repeat_interleave(n, dim=0)
    heads, d_v = out.shape[1], out.shape[2]
    piece_out = torch.empty((tail * n, heads, d_v), device=out.device, dtype=torch.float32)
    piece_lse = torch.empty((tail * n, heads), device=out.device, dtype=torch.float32)
    launch(piece_q, piece_idx, piece_out, piece_lse)
    merge_pieces(piece_out, piece_lse, n, out[main:], lse[main:])
    return plan


@triton.jit
def _merge_pieces(p_out, p_lse, out, lse, pieces, stride_pt, stride_ph, stride_plt, stride_ot, stride_oh, stride_lt,
                  HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = h < HEADS
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for i in range(pieces):
        m = tl.maximum(m, tl.load(p_lse + (t * pieces + i) * stride_plt + h, mask=ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # no piece with a valid key: every weight 0
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    for i in range(pieces):
        w = tl.exp(tl.load(p_lse + (t * pieces + i) * stride_plt + h, mask=ok, other=float("-inf")) - m_safe)
        o = tl.load(p_out + (t * pieces + i) * stride_pt + h[:, None] * stride_ph + d[None, :], mask=ok[:, None],
                    other=0.0)
        acc += w[:, None] * o
        total += w
    safe = tl.where(total > 0, total, 1.0)
    tl.store(out + t * stride_ot + h[:, None] * stride_oh + d[None, :], (acc / safe[:, None]).to(out.dtype.element_ty),
             mask=ok[:, None])
    if tl.program_id(2) == 0:
        tl.store(lse + t * stride_lt + h, tl.where(total > 0, m + tl.log(safe), float("-inf")), mask=ok)


def merge_pieces(piece_out: torch.Tensor, piece_lse: torch.Tensor, pieces: int, out: torch.Tensor,
                 lse: torch.Tensor) -> None:
    """out [T, heads, d_v] and lse [T, heads] (natural log) from the partials of T x pieces rows (token-major:
    row t * pieces + i is token t's piece i), each normalised by its own row sum."""
    T, heads, d_v = out.shape
    if piece_out.shape != (T * pieces, heads, d_v) or piece_lse.shape != (T * pieces, heads):
        raise ValueError(f"partials {tuple(piece_out.shape)} / {tuple(piece_lse.shape)} do not match {T} tokens x "
                         f"{pieces} pieces of out {tuple(out.shape)}")
    if T == 0:
        return
    block_h = min(16, triton.next_power_of_2(heads))
    block_d = min(128, triton.next_power_of_2(d_v))
    _merge_pieces[(T, triton.cdiv(heads, block_h), triton.cdiv(d_v, block_d))](
        piece_out, piece_lse, out, lse, pieces, piece_out.stride(0), piece_out.stride(1), piece_lse.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), HEADS=heads, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4)


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (the programs of a wave, one an SM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
