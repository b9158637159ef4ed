"""The DSA kernel switch: a tiny GLM Megatron GPTModel gives the same logits and gradients with
Megatron's unfused DSA and with agentrl's kernels (torch references on CPU; the Triton kernels
under TRITON_INTERPRET=1 in a child process; compiled Triton on CUDA)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from glm_fixtures import tiny_config

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def megatron_single_rank(tmp_path_factory):
    """One-rank gloo group and Megatron parallel state; CPU builds need cuda allocations redirected.
    The group meets through a file, not a port: a port found free and then bound by another process
    (a demo running beside the suite) failed this fixture with EADDRINUSE."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    mp = pytest.MonkeyPatch()
    if not torch.cuda.is_available():
        # The DSA rotary embedding and MoE router ask torch.cuda.current_device() for their device.
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
    own_pg = not dist.is_initialized()
    if own_pg:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0, world_size=1)
    own_mp = not parallel_state.model_parallel_is_initialized()
    if own_mp:
        parallel_state.initialize_model_parallel()
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(0)  # Megatron's GPU init forks this RNG state
    yield
    if own_mp:
        parallel_state.destroy_model_parallel()
    if own_pg:
        dist.destroy_process_group()
    mp.undo()


def _model(device: str, dtype: torch.dtype):
    from agentrl.models.megatron_builder import build_gpt_model, to_bf16_keeping_fp32_router_bias

    torch.manual_seed(0)
    model = build_gpt_model(tiny_config(mtp=0), use_te=False, bf16=dtype == torch.bfloat16,
                            use_cpu_initialization=device == "cpu", moe_token_dispatcher_type="allgather")
    if dtype == torch.bfloat16:
        to_bf16_keeping_fp32_router_bias(model)
    return model.to(device)


def _run(model, device: str, seqlens: list[int]):
    """Packed THD forward of len(seqlens) sequences; logits and the gradients of every parameter."""
    from megatron.core.packed_seq_params import PackedSeqParams

    gen = torch.Generator().manual_seed(1)
    total = sum(seqlens)
    ids = torch.randint(0, 1024, (1, total), generator=gen).to(device)
    pos = torch.cat([torch.arange(n) for n in seqlens])[None].to(device)
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(seqlens),
                          max_seqlen_kv=max(seqlens))
    model.zero_grad(set_to_none=True)
    logits = model(ids, pos, None, packed_seq_params=psp)
    weights = torch.randn(logits.shape, generator=gen).to(device)
    (logits.float() * weights).sum().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), grads


def _compare(device: str, dtype: torch.dtype, use_triton: bool | None, seqlens: list[int], tol: float):
    from agentrl.models.megatron_dsa_switch import apply_dsa_kernels, dsa_kernel_stats

    model = _model(device, dtype)
    ref_logits, ref_grads = _run(model, device, seqlens)
    assert apply_dsa_kernels(model, use_triton=use_triton) == 5
    assert apply_dsa_kernels(model, use_triton=use_triton) == 5  # idempotent
    logits, grads = _run(model, device, seqlens)
    stats = dsa_kernel_stats(model)
    # layers 1, 2, 4 compute a top-k, 3 and 5 reuse it; all five attend through the kernels
    assert stats == {"topk": 3, "attention": 5, "fallback": 0, "offset_runs": 0, "fallback_reasons": []}, stats
    scale = ref_logits.abs().max()
    assert (logits - ref_logits).abs().max() <= tol * scale, float((logits - ref_logits).abs().max() / scale)
    assert grads.keys() == ref_grads.keys()
    attention_grads = [n for n in grads if "self_attention" in n]
    assert attention_grads
    for name in grads:
        err = (grads[name] - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-12)
        assert err <= tol, (name, float(err))


def test_switch_matches_megatron_unfused_dsa_torch_path(megatron_single_rank):
    # 3 packed sequences: shorter and longer than top-k 8, so both the -1 padding and real
    # selection are exercised
    _compare("cpu", torch.float32, use_triton=False, seqlens=[6, 17, 12], tol=1e-4)


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_a_cp_query_chunk_against_gathered_keys_uses_the_offset_kernel(cp_rank):
    """Zigzag CP rows of two packed sequences against all their keys: the switch's top-k (runs at
    offsets) selects exactly Megatron's dense scorer's keys, with no fallback."""
    from megatron.core.transformer.experimental_attention_variant import dsa, dsa_layout, dsa_masking

    from agentrl.models.megatron_dsa_switch import _ACTIVE, DsaKernelState, _install_dispatchers

    _install_dispatchers()
    cu = torch.tensor([0, 16, 40])
    pos = dsa_layout.build_packed_allgather_cp_local_positions(cu, 2, cp_rank, torch.device("cpu"))
    starts, ends = dsa_masking.generate_varlen_mask_params_for_positions(cu, pos)
    gen = torch.Generator().manual_seed(cp_rank)
    sq, sk, heads, dim, topk = pos.numel(), 40, 4, 16, 8
    q, k = torch.randn(sq, 1, heads, dim, generator=gen), torch.randn(sk, 1, dim, generator=gen)
    w = torch.rand(sq, 1, heads, generator=gen)
    from agentrl.models.megatron_dsa_switch import _ORIGINALS

    _, want = _ORIGINALS["fused_qk_topk_naive"](q, k, w, topk, varlen_starts=starts, varlen_ends=ends)
    state = DsaKernelState(use_triton=False)
    token = _ACTIVE.set(state)
    try:
        _, got = dsa.fused_qk_topk_naive(q, k, w, topk, varlen_starts=starts, varlen_ends=ends)
    finally:
        _ACTIVE.reset(token)
    assert state.calls["fallback"] == 0 and state.calls["offset_runs"] == 1, state.calls
    for row in range(sq):
        assert sorted(i for i in got[0, row].tolist() if i >= 0) == sorted(i for i in want[0, row].tolist() if i >= 0)


def test_unswitched_model_and_other_models_are_untouched(megatron_single_rank):
    from agentrl.models.megatron_dsa_switch import apply_dsa_kernels, dsa_kernel_stats

    switched, plain = _model("cpu", torch.float32), _model("cpu", torch.float32)
    apply_dsa_kernels(switched, use_triton=False)
    logits, _ = _run(plain, "cpu", [9])
    assert dsa_kernel_stats(plain)["attention"] == 0 and dsa_kernel_stats(switched)["attention"] == 0
    logits2, _ = _run(switched, "cpu", [9])
    assert dsa_kernel_stats(switched)["attention"] == 5
    torch.testing.assert_close(logits, logits2, atol=1e-4, rtol=1e-4)


def _install_interpreter_compat() -> None:
    spec = importlib.util.spec_from_file_location("kernels_conftest", HERE / "kernels" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.InterpreterCompat().install()


@pytest.mark.slow  # ~2 min: the interpreter runs every kernel program in numpy
def test_switch_matches_with_triton_kernels_interpreted(megatron_single_rank):
    if torch.cuda.is_available():
        pytest.skip("compiled kernels are checked by test_switch_bf16_on_gpu (fp32 tl.dot would run as tf32)")
    if os.environ.get("TRITON_INTERPRET") != "1":  # run this test again in a child with the interpreter
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-o", "addopts=",
                               f"{__file__}::test_switch_matches_with_triton_kernels_interpreted"],
                              check=False, env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=HERE.parent,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        return
    _install_interpreter_compat()
    _compare("cpu", torch.float32, use_triton=True, seqlens=[6, 17, 12], tol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_switch_bf16_on_gpu(megatron_single_rank):
    """In bf16 both paths differ from the fp32 model (near-tied index scores pick other keys); the
    switch must stay within twice Megatron's own bf16 error, logits and every gradient."""
    import json

    from agentrl.models.megatron_dsa_switch import apply_dsa_kernels, dsa_kernel_stats

    seqlens = [100, 300, 64]
    ref = _model("cuda", torch.float32)
    ref_logits, ref_grads = _run(ref, "cuda", seqlens)
    model = _model("cuda", torch.bfloat16)
    model.load_state_dict(ref.state_dict())  # the same weights, rounded to bf16
    base_logits, base_grads = _run(model, "cuda", seqlens)
    assert apply_dsa_kernels(model) == 5
    logits, grads = _run(model, "cuda", seqlens)
    assert dsa_kernel_stats(model)["fallback"] == 0
    scale = ref_logits.abs().max()
    e_base = float((base_logits - ref_logits).abs().max() / scale)
    e_switch = float((logits - ref_logits).abs().max() / scale)

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    g_base = max(rel(base_grads[n], ref_grads[n]) for n in ref_grads)
    g_switch = max(rel(grads[n], ref_grads[n]) for n in ref_grads)
    print(json.dumps({"logits_rel_err_megatron_bf16": e_base, "logits_rel_err_switch_bf16": e_switch,
                      "grad_rel_err_megatron_bf16": g_base, "grad_rel_err_switch_bf16": g_switch}))
    assert e_switch <= 2 * e_base + 1e-3, (e_switch, e_base)
    assert g_switch <= 2 * g_base + 1e-2, (g_switch, g_base)


def test_the_backward_impl_is_checked_where_it_is_chosen(tmp_path, capsys):
    from agentrl.models.megatron_dsa_switch import apply_dsa_kernels
    from bench import dsa_switch

    with pytest.raises(ValueError, match="bwd_impl must be one of"):
        apply_dsa_kernels(torch.nn.Linear(2, 2), bwd_impl="fused")
    with pytest.raises(SystemExit):
        dsa_switch.main(["--out", str(tmp_path / "x.json"), "--bwd-impls", "split,fused"])
    assert "--bwd-impls: unknown ['fused']" in capsys.readouterr().err
