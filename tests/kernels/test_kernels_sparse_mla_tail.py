"""The ragged last wave cut into pieces over the key slots and merged (kernels/sparse_mla_tail.py)."""
from __future__ import annotations

import itertools

import pytest
import torch
import triton

from kernels import sparse_mla as sm
from kernels import sparse_mla_tail as tail


def test_the_benchmark_shape_cuts_its_four_tail_tokens_into_one_pair_pieces():
    # 4096 tokens, one head block, top-2048 (16 pairs), 132 SMs: 31 full waves and 4 programs
    plan = tail.plan_tail(4096, 1, 16, 132)
    assert (plan.main_tokens, plan.pieces, plan.piece_pairs) == (4092, 16, 1)
    assert 0.02 < plan.predicted_gain < 0.04  # the 3.4% measured on the H200, less the pieces' own cost
    assert tail.plan_tail(4092, 1, 16, 132) is None  # whole waves: nothing to cut
    assert tail.plan_tail(4096, 1, 1, 132) is None  # one pair a program: nothing to cut it into


def test_plans_are_never_worse_than_one_launch_by_the_model_and_cover_every_slot():
    for tokens, head_blocks, pairs, sms in itertools.product((1, 5, 67, 131, 133, 300, 2048, 4096), (1, 2),
                                                             (1, 2, 3, 16, 17), (8, 132)):
        plan = tail.plan_tail(tokens, head_blocks, pairs, sms)
        whole = tail.launch_cost(tokens, head_blocks, pairs, sms)
        if plan is None:
            continue
        tail_tokens = tokens - plan.main_tokens
        assert 0 < tail_tokens <= tokens
        assert plan.pieces * plan.piece_pairs >= pairs > (plan.pieces - 1) * plan.piece_pairs
        cost = (tail.launch_cost(plan.main_tokens, head_blocks, pairs, sms) if plan.main_tokens else 0) + \
            tail.MERGE_PAIRS + tail.launch_cost(tail_tokens * plan.pieces, head_blocks, plan.piece_pairs, sms)
        assert cost <= whole * (1 - tail.MIN_GAIN)
        assert plan.predicted_gain == pytest.approx(1 - cost / whole, abs=1e-4)
        # the main launch is whole waves of the SMs (a program per token and head block)
        assert plan.main_tokens * head_blocks % sms == 0 or plan.main_tokens * head_blocks < sms


def test_a_few_tokens_are_spread_over_the_idle_sms():
    plan = tail.plan_tail(4, 1, 16, 132)
    assert plan.main_tokens == 0 and plan.pieces == 16  # 64 programs of one pair instead of 4 of sixteen


def test_bad_plan_inputs_are_named():
    with pytest.raises(ValueError, match="must be >= 1"):
        tail.plan_tail(10, 1, 0, 132)
    with pytest.raises(ValueError, match="leaves no tail"):
        tail.forward_in_waves(lambda *a: None, torch.zeros(4, 16, 48), torch.zeros(4, 8, dtype=torch.int32),
                              torch.zeros(4, 16, 32), torch.zeros(4, 16), 1, 8, plan=tail.TailPlan(4, 2, 1, 0.0))
    with pytest.raises(ValueError, match="pieces >= 2"):
        tail.TailPlan(main_tokens=0, pieces=1, piece_pairs=4, predicted_gain=0.1)


def _triton_launch(kv, scale, d_v):
    """forward_in_waves' launch over sparse_mla.py's Triton kernel (the one the interpreter runs), writing
    whatever dtype out has: bf16 for whole tokens, fp32 for a tail's partials, as the Gluon kernels do."""
    def launch(q, idx, out, lse):
        heads = q.shape[1]
        bh = max(16, triton.next_power_of_2(heads))
        sm._sparse_mla_fwd_kernel[(q.shape[0], triton.cdiv(heads, bh))](
            q, kv, idx, out, lse, scale * sm.LOG2E, idx.shape[1], q.stride(0), q.stride(1), kv.stride(0),
            idx.stride(0), out.stride(0), out.stride(1), lse.stride(0), HEADS=heads, D_V=d_v, D_R=q.shape[2] - d_v,
            BLOCK_H=bh, BLOCK_N=32, WS=False, num_warps=4, num_stages=1)
    return launch


@pytest.mark.parametrize("K", [300, 256])
def test_a_cut_tail_gives_the_reference_outputs(device, K):
    T, S, heads, d_v, d_r, scale = 10, 400, 16, 32, 16, 0.1
    g = torch.Generator().manual_seed(K)
    q = torch.randn(T, heads, d_v + d_r, generator=g).to(device=device, dtype=torch.bfloat16)
    kv = torch.randn(S, d_v + d_r, generator=g).to(device=device, dtype=torch.bfloat16)
    idx = torch.randint(0, S, (T, K), generator=g, dtype=torch.int32)
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    idx[8] = -1  # a tail token with no valid key: out 0, lse -inf
    idx[9, :200] = -1  # a tail token whose first pieces have no valid key
    idx = idx.to(device)
    out = torch.full((T, heads, d_v), float("nan"), device=device, dtype=torch.bfloat16)
    lse = torch.full((T, heads), float("nan"), device=device)
    plan = tail.forward_in_waves(_triton_launch(kv, scale, d_v), q, idx, out, lse, head_blocks=1, sms=4)
    assert plan is not None and plan.main_tokens <= T - 2 and plan.pieces >= 2  # two tail tokens, cut
    ref_out, ref_lse = sm.reference_sparse_mla(q, kv, idx, scale, d_v=d_v)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-4)
    assert torch.equal(torch.isinf(lse), ~finite) and (out[8] == 0).all()


def test_merging_pieces_is_the_softmax_over_all_of_them(device):
    # partials from the fp32 definition over each piece's slots, merged, against the definition over all
    T, S, heads, d_v, d_r, K, n = 3, 90, 20, 32, 16, 48, 4
    g = torch.Generator().manual_seed(3)
    q = torch.randn(T, heads, d_v + d_r, generator=g, dtype=torch.float32)
    kv = torch.randn(S, d_v + d_r, generator=g, dtype=torch.float32)
    idx = torch.randint(0, S, (T, K), generator=g, dtype=torch.int32)
    idx[1, :36] = -1  # three of token 1's four pieces hold no valid key
    idx[2] = -1
    p_out, p_lse = sm.reference_sparse_mla(q.repeat_interleave(n, 0), kv, idx.reshape(T * n, K // n), 0.2, d_v=d_v)
    out = torch.empty(T, heads, d_v, device=device)
    lse = torch.empty(T, heads, device=device)
    tail.merge_pieces(p_out.to(device), p_lse.to(device), n, out, lse)
    ref_out, ref_lse = sm.reference_sparse_mla(q, kv, idx, 0.2, d_v=d_v)
    torch.testing.assert_close(out.cpu(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        tail.merge_pieces(p_out.to(device), p_lse.to(device), n + 1, out, lse)


def test_the_kernels_bench_checks_and_times_the_cut_beside_the_whole_launch(device, monkeypatch):
    # bench/kernel_cases.py's sparse MLA entry, its launches over the Triton kernel on 4 "SMs"
    from bench.kernel_cases import _tail_cut_beside
    T, S, heads, d_v, d_r, K, scale = 10, 300, 16, 32, 16, 256, 0.1
    q = torch.randn(T, heads, d_v + d_r).to(device=device, dtype=torch.bfloat16)
    kv = torch.randn(S, d_v + d_r).to(device=device, dtype=torch.bfloat16)
    idx = torch.randint(0, S, (T, K), dtype=torch.int32).to(device)
    monkeypatch.setattr(tail, "sm_count", lambda dev: 4)
    cuts, tail_mod = [], tail  # the launchers' keyword is `tail` too

    def launch(q, kv, idx, scale, d_v, tail=None):
        out = torch.empty(q.shape[0], q.shape[1], d_v, device=q.device, dtype=q.dtype)
        lse = torch.empty(q.shape[0], q.shape[1], device=q.device)
        cuts.append(tail_mod.forward_in_waves(_triton_launch(kv, scale, d_v), q, idx, out, lse, 1, 4, plan=tail))
        return out, lse

    row = _tail_cut_beside(launch, q, kv, idx, scale, d_v, default_ms=1.0, timer=lambda fn: (fn(), 2.0)[1])
    assert row["tail_cut_correct"] and cuts[0] is not None  # the cut itself, checked on the last tokens
    assert row["tail_plan"]["main_tokens"] == cuts[0].main_tokens == 8
    assert not row["tail_cut_by_default"] and (row["tail_cut_ms"], row["whole_last_wave_ms"]) == (2.0, 1.0)
    assert row["tail_cut_speedup"] == 0.5
