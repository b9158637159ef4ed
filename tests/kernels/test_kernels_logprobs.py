"""Fused log-prob kernel and the chunked torch fallback against the fp32 definition."""
from __future__ import annotations

import pytest
import torch

import kernels.logprobs as lp
from kernels.logprobs_torch import chunked_logprobs, reference_logprobs

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _inputs(device, T, H, V, dtype, weight_scale=0.3):
    hidden = torch.randn(T, H, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, device=device) * weight_scale).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), device=device)
    return hidden, weight, targets


def _grads(fn, hidden, weight, targets, temperature, g_lp, g_ent):
    logp, ent = fn(hidden, weight, targets, temperature=temperature, return_entropy=True)
    gh, gw = torch.autograd.grad((logp * g_lp).sum() + (ent * g_ent).sum(), [hidden, weight])
    return logp.detach(), ent.detach(), gh.float(), gw.float()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_fused_matches_reference_fwd_bwd_with_entropy_and_ragged_shapes(device):
    # T, V and H are not multiples of the tiles (128 / 128 / 64): every mask path runs.
    hidden, weight, targets = _inputs(device, T=37, H=96, V=300, dtype=torch.float32)
    g_lp, g_ent = torch.randn(37, device=device), torch.randn(37, device=device)
    got = _grads(lambda *a, **k: lp.fused_logprobs(*a, bwd_chunk_tokens=16, **k),
                 hidden, weight, targets, 0.7, g_lp, g_ent)
    want = _grads(reference_logprobs, hidden, weight, targets, 0.7, g_lp, g_ent)
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=1e-5)
    assert _rel(got[2], want[2]) < 1e-5 and _rel(got[3], want[3]) < 1e-5


def test_fused_bf16_logprobs_only_and_frozen_weight(device):
    hidden, weight, targets = _inputs(device, T=20, H=64, V=200, dtype=torch.bfloat16)
    weight.requires_grad_(False)
    logp = lp.fused_logprobs(hidden, weight, targets)
    assert logp.dtype == torch.float32 and logp.shape == (20,)
    want = reference_logprobs(hidden, weight, targets)
    torch.testing.assert_close(logp, want, atol=1e-4, rtol=1e-4)
    (gh,) = torch.autograd.grad(logp.sum(), [hidden])
    (gh_ref,) = torch.autograd.grad(want.sum(), [hidden])
    assert _rel(gh.float(), gh_ref.float()) < 2e-2  # dL/dlogits is rounded to bf16 for the GEMMs


def test_chunked_torch_fallback_matches_reference_and_backprops(device):
    hidden, weight, targets = _inputs(device, T=50, H=32, V=97, dtype=torch.float32)
    g_lp, g_ent = torch.randn(50, device=device), torch.randn(50, device=device)
    got = _grads(lambda *a, **k: chunked_logprobs(*a, chunk_tokens=16, **k),
                 hidden, weight, targets, 1.3, g_lp, g_ent)
    want = _grads(reference_logprobs, hidden, weight, targets, 1.3, g_lp, g_ent)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_chunked_without_grad_returns_plain_tensor():
    hidden, weight, targets = _inputs("cpu", T=5, H=8, V=11, dtype=torch.float32)
    with torch.no_grad():
        out = chunked_logprobs(hidden, weight, targets, chunk_tokens=2)
    assert out.shape == (5,) and not out.requires_grad and (out <= 0).all()


@pytest.mark.parametrize("fn", [lp.fused_logprobs, chunked_logprobs], ids=["fused", "chunked"])
def test_bad_inputs_name_the_argument(fn, device):
    hidden, weight, targets = _inputs(device, T=4, H=16, V=32, dtype=torch.float32)
    with pytest.raises(ValueError, match="weight must be"):
        fn(hidden, weight[:, :8], targets)
    with pytest.raises(ValueError, match="targets must be"):
        fn(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="temperature"):
        fn(hidden, weight, targets, temperature=0.0)


def test_fused_rejects_out_of_range_targets(device):
    hidden, weight, targets = _inputs(device, T=4, H=16, V=32, dtype=torch.float32)
    targets[1] = 32
    with pytest.raises(ValueError, match=r"targets must lie in \[0, vocab=32\)"):
        lp.fused_logprobs(hidden, weight, targets)


@pytest.mark.gpu
@gpu
def test_fused_gpu_bf16_medium():
    hidden, weight, targets = _inputs("cuda", T=1000, H=1024, V=32007, dtype=torch.bfloat16, weight_scale=0.05)
    g_lp, g_ent = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    got = _grads(lambda *a, **k: lp.fused_logprobs(*a, bwd_chunk_tokens=384, **k),
                 hidden, weight, targets, 0.9, g_lp, g_ent)
    want = _grads(reference_logprobs, hidden, weight, targets, 0.9, g_lp, g_ent)
    torch.testing.assert_close(got[0], want[0], atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=2e-3, rtol=1e-4)
    assert _rel(got[2], want[2]) < 2e-2 and _rel(got[3], want[3]) < 2e-2


@pytest.mark.gpu
@gpu
def test_every_gpu_config_is_correct(monkeypatch):
    """The autotuner keeps the fastest config, so each one must be right (TMA paths included)."""
    from kernels._tuning import Autotuner
    hidden, weight, targets = _inputs("cuda", T=300, H=512, V=5003, dtype=torch.bfloat16, weight_scale=0.05)
    g_lp, g_ent = torch.randn(300, device="cuda"), torch.randn(300, device="cuda")
    want = _grads(reference_logprobs, hidden, weight, targets, 1.0, g_lp, g_ent)
    ran = 0
    for fwd_cfg, bwd_cfg in zip(lp.FWD_CONFIGS, lp.BWD_CONFIGS + lp.BWD_CONFIGS):
        monkeypatch.setattr(lp, "FWD_TUNER", Autotuner("fwd", [fwd_cfg]))
        monkeypatch.setattr(lp, "BWD_TUNER", Autotuner("bwd", [bwd_cfg]))
        try:
            got = _grads(lambda *a, **k: lp.fused_logprobs(*a, bwd_chunk_tokens=128, **k),
                         hidden, weight, targets, 1.0, g_lp, g_ent)
        except Exception as exc:  # the compiler rejects some scheduling variants; the tuner skips them too
            if type(exc).__module__.startswith("triton") or "PassManager" in str(exc):
                continue
            raise
        ran += 1
        torch.testing.assert_close(got[0], want[0], atol=2e-3, rtol=1e-4, msg=fwd_cfg.describe)
        torch.testing.assert_close(got[1], want[1], atol=2e-3, rtol=1e-4, msg=fwd_cfg.describe)
        assert _rel(got[2], want[2]) < 2e-2 and _rel(got[3], want[3]) < 2e-2, bwd_cfg.describe()
    assert ran >= len(lp.FWD_CONFIGS) - 3
