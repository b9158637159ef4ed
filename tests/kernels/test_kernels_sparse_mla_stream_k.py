"""Stream-K for the sparse MLA forward: the split of key-tile pairs over programs, and the merge of cut items."""
from __future__ import annotations

import math

import pytest
import torch

from kernels import sparse_mla as sm
from kernels import sparse_mla_stream_k as sk

BLOCK_N = 64  # keys a tile; a unit is a pair of tiles


@pytest.mark.parametrize("items,pairs,programs", [(4096, 16, 132), (66, 16, 132), (40, 3, 132), (3, 1, 132),
                                                   (7, 5, 3), (1, 16, 16), (264, 16, 132)])
def test_every_unit_is_run_once_and_each_cut_item_names_its_partials(items, pairs, programs):
    units = items * pairs
    programs = min(programs, units)  # what the launch does: no program without work
    seen = [0] * units
    parts: dict[int, list[int]] = {}
    for g in range(programs):
        segs = sk.segments(g, units, pairs, programs)
        assert segs, "a program without work"
        assert [s for s in segs[1:-1] if s[3] >= 0] == [], "only a run's first and last segments can be cut"
        for item, p0, p1, slot in segs:
            assert 0 <= p0 < p1 <= pairs
            for p in range(p0, p1):
                seen[item * pairs + p] += 1
            assert (slot == -1) == (p0 == 0 and p1 == pairs)
            if slot >= 0:
                assert slot // 2 == g
                parts.setdefault(item, []).append(slot)
    assert seen == [1] * units
    cut = sk.cut_items(items, pairs, programs)
    assert dict((i, list(s)) for i, s in cut) == parts
    assert all(len(s) >= 2 for _, s in cut), "a cut item has at least two pieces"
    assert len({s for _, slots in cut for s in slots}) == sum(len(s) for _, s in cut), "a slot holds one partial"
    # the runs are even: no program has more than one pair over the mean
    sizes = [sk.program_units(g, units, programs) for g in range(programs)]
    assert max(b - a for a, b in sizes) <= math.ceil(units / programs)


def test_the_benchmark_shape_fills_every_sm():
    """4096 tokens x 16 pairs on 132 SMs: a program per item would leave a 32nd wave of 4; Stream-K gives each
    program 496-497 pairs (31.03 items); an item is cut at each of the 131 boundaries between runs that is not
    also a boundary between items."""
    units = 4096 * 16
    runs = [sk.program_units(g, units, 132) for g in range(132)]
    assert {b - a for a, b in runs} == {496, 497}
    inner = [a for a, _ in runs[1:] if a % 16]
    assert len(sk.cut_items(4096, 16, 132)) == len(inner) == 120


def _partial(q, kv, idx, sm_scale, d_v):
    """A piece of an item as the kernel writes it: o unnormalised (fp32), the row max in base 2, the row sum."""
    s = torch.einsum("hd,kd->hk", q.float(), kv[idx.clamp(min=0)].float()) * sm_scale * sk.LOG2E
    s = s.masked_fill((idx < 0)[None, :], float("-inf"))
    m = s.max(dim=1).values
    p = torch.exp2(s - torch.where(m == float("-inf"), 0.0, m)[:, None])
    return p @ kv[idx.clamp(min=0), :d_v].float(), m, p.sum(dim=1)


@pytest.mark.parametrize("heads", [64, 48, 128])
def test_merged_partials_match_the_whole_attention(device, heads):
    """Partials computed as the kernel's segments would (in torch here), merged by combine_partials, give the
    reference's out and lse, including a row with no valid key in some pieces and one with none at all."""
    T, S, K, d_v, block_h, programs = 3, 300, 5 * 2 * BLOCK_N - 50, 128, 64, 7
    g = torch.Generator().manual_seed(heads)
    q = torch.randn(T, heads, d_v + 32, generator=g).to(torch.bfloat16)
    kv = torch.randn(S, d_v + 32, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, S, (T, K), generator=g, dtype=torch.int32)
    idx[1, : 3 * 2 * BLOCK_N] = -1  # token 1: no valid key in its first three pairs
    idx[2] = -1  # token 2: none at all
    scale = 0.07
    hb = -(-heads // block_h)
    items, pairs = T * hb, -(-K // (2 * BLOCK_N))
    ws, ml = sk.workspace(2 * programs, block_h, d_v, "cpu")
    out = torch.full((T, heads, d_v), float("nan")).to(torch.bfloat16)
    lse = torch.full((T, heads), float("nan"))
    cut = dict(sk.cut_items(items, pairs, programs))
    assert cut, "the case must cut items"
    for gi in range(programs):
        for item, p0, p1, slot in sk.segments(gi, items * pairs, pairs, programs):
            t, h0 = item // hb, (item % hb) * block_h
            rows = slice(h0, min(h0 + block_h, heads))
            keys = idx[t, p0 * 2 * BLOCK_N: p1 * 2 * BLOCK_N]
            o, m, den = _partial(q[t, rows], kv, keys, scale, d_v)
            if slot < 0:  # a whole item: the kernel writes it itself
                out[t, rows] = (o / torch.where(den > 0, den, 1.0)[:, None]).to(out.dtype)
                lse[t, rows] = torch.where(den > 0, (m + torch.log2(den)) / sk.LOG2E, float("-inf"))
                continue
            n = o.shape[0]
            ws[slot, :n], ml[slot, 0, :n], ml[slot, 1, :n] = o, m, den
    dev = torch.device(device)
    out, lse = out.to(dev), lse.to(dev)
    sk.combine_partials(ws.to(dev), ml.to(dev), out, lse, sk.cut_items(items, pairs, programs), block_h)
    ref_out, ref_lse = sm.reference_sparse_mla(q, kv, idx, scale, d_v=d_v)
    torch.testing.assert_close(out.float().cpu(), ref_out.float(), atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse.cpu()), ~fin)
    torch.testing.assert_close(lse.cpu()[fin], ref_lse[fin], atol=1e-4, rtol=1e-4)
    assert (out[2] == 0).all()


def test_a_bad_split_is_refused():
    with pytest.raises(ValueError, match="pairs >= 1"):
        sk.cut_items(4, 0, 2)
