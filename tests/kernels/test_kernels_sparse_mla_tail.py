"""The sparse MLA forward's last wave cut into pieces (kernels/sparse_mla_tail.py): the split, and the merge."""
from __future__ import annotations

import pytest
import torch

from kernels import sparse_mla as sm
from kernels import sparse_mla_tail as tail

BLOCK_N = 64  # keys a tile; a pair is two


@pytest.mark.parametrize("items,pairs,sms", [(4096, 16, 132), (4092, 16, 132), (66, 16, 132), (40, 3, 132),
                                             (3, 1, 132), (7, 5, 3), (200, 16, 132), (1, 16, 16)])
def test_the_full_waves_stay_whole_and_each_tail_item_is_cut_into_pieces_that_cover_it(items, pairs, sms):
    whole, split = tail.tail_split(items, pairs, sms)
    assert whole % sms == 0 or split == 1, "only the last, partial wave is cut"
    pieces = (items - whole) * split if split > 1 else 0
    assert pieces <= sms, "the pieces fit beside each other on the SMs"
    cut = tail.tail_cut_items(items, pairs, sms)
    assert [i for i, _ in cut] == list(range(whole, items)) if split > 1 else cut == ()
    covered: dict[int, list[int]] = {}
    for k in range(pieces):  # what the kernel's tail program k computes
        p0, p1 = tail.tail_piece(k, pairs, split)
        assert 0 <= p0 < p1 <= pairs, "no piece is empty"
        covered.setdefault(whole + k // split, []).extend(range(p0, p1))
    assert all(sorted(v) == list(range(pairs)) for v in covered.values()), "each cut item's pairs, once each"
    assert dict(cut) == {i: tuple(range((i - whole) * split, (i - whole + 1) * split)) for i in covered}


def test_the_benchmark_shape_cuts_its_32nd_wave():
    """4096 tokens on 132 SMs: 31 full waves (4092 items whole) and 4 items of 16 pairs in 16 pieces each (64
    one-pair programs) in place of a wave of 4 whole programs; nothing cut where the waves are full or where
    the last is more than half full."""
    assert tail.tail_split(4096, 16, 132) == (4092, 16)
    assert tail.tail_split(4092, 16, 132) == (4092, 1)
    assert tail.tail_split(132 * 3 + 70, 16, 132) == (132 * 3 + 70, 1)
    assert tail.tail_split(132 * 3 + 66, 16, 132) == (132 * 3, 2)


def _partial(q, kv, idx, sm_scale, d_v):
    """A piece of an item as the kernel writes it: o unnormalised (fp32), the row max in base 2, the row sum."""
    s = torch.einsum("hd,kd->hk", q.float(), kv[idx.clamp(min=0)].float()) * sm_scale * tail.LOG2E
    s = s.masked_fill((idx < 0)[None, :], float("-inf"))
    m = s.max(dim=1).values
    p = torch.exp2(s - torch.where(m == float("-inf"), 0.0, m)[:, None])
    return p @ kv[idx.clamp(min=0), :d_v].float(), m, p.sum(dim=1)


@pytest.mark.parametrize("heads", [64, 48, 128])
def test_merged_pieces_match_the_whole_attention(device, heads):
    """Pieces computed as the kernel's tail programs would (in torch here), merged by combine_partials, give the
    reference's out and lse, with a token whose first pieces see no valid key and one with none at all."""
    T, S, K, d_v, block_h, sms = 5, 300, 5 * 2 * BLOCK_N - 50, 128, 64, 4
    g = torch.Generator().manual_seed(heads)
    q = torch.randn(T, heads, d_v + 32, generator=g).to(torch.bfloat16)
    kv = torch.randn(S, d_v + 32, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, S, (T, K), generator=g, dtype=torch.int32)
    idx[-2, : 3 * 2 * BLOCK_N] = -1  # no valid key in its first three pairs
    idx[-1] = -1  # none at all
    scale = 0.07
    hb = -(-heads // block_h)
    items, pairs = T * hb, -(-K // (2 * BLOCK_N))
    whole, split = tail.tail_split(items, pairs, sms)
    assert split > 1, "the case must cut items"
    ws, ml = tail.workspace((items - whole) * split, block_h, d_v, "cpu")
    out = torch.full((T, heads, d_v), float("nan")).to(torch.bfloat16)
    lse = torch.full((T, heads), float("nan"))
    for k in range((items - whole) * split):
        item = whole + k // split
        t, h0 = item // hb, (item % hb) * block_h
        p0, p1 = tail.tail_piece(k, pairs, split)
        o, m, den = _partial(q[t, h0:h0 + block_h], kv, idx[t, p0 * 2 * BLOCK_N: p1 * 2 * BLOCK_N], scale, d_v)
        ws[k, :o.shape[0]], ml[k, 0, :o.shape[0]], ml[k, 1, :o.shape[0]] = o, m, den
    ref_out, ref_lse = sm.reference_sparse_mla(q, kv, idx, scale, d_v=d_v)
    for item in range(whole):  # the whole items: the kernel writes them itself
        t, h0 = item // hb, (item % hb) * block_h
        out[t, h0:h0 + block_h], lse[t, h0:h0 + block_h] = ref_out[t, h0:h0 + block_h], ref_lse[t, h0:h0 + block_h]
    dev = torch.device(device)
    out, lse = out.to(dev), lse.to(dev)
    tail.combine_partials(ws.to(dev), ml.to(dev), out, lse, tail.tail_cut_items(items, pairs, sms), block_h)
    torch.testing.assert_close(out.float().cpu(), ref_out.float(), atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse.cpu()), ~fin)
    torch.testing.assert_close(lse.cpu()[fin], ref_lse[fin], atol=1e-4, rtol=1e-4)
    assert (out[-1] == 0).all()


def test_a_bad_split_is_refused():
    with pytest.raises(ValueError, match="pairs >= 1"):
        tail.tail_split(4, 0, 2)
