"""Weight export in SGLang's flattened-bucket protocol: two processes over gloo, bitwise equality."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from agentrl.sync.nccl_export import (
    flatten_bucket,
    fp8_eligible,
    plan_buckets,
    quantize_named,
    unflatten_bucket,
)


def _weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """HF-style names; odd shapes (not multiples of 128) and mixed dtypes."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(300, 64, generator=g).bfloat16()),
        ("model.layers.0.self_attn.q_a_proj.weight", torch.randn(200, 130, generator=g).bfloat16()),
        ("model.layers.0.input_layernorm.weight", torch.randn(64, generator=g)),
        ("model.layers.0.mlp.gate.weight", torch.randn(8, 64, generator=g).bfloat16()),
        ("model.layers.0.mlp.gate.e_score_correction_bias", torch.randn(8, generator=g)),
        ("model.layers.0.mlp.experts.3.down_proj.weight", torch.randn(64, 257, generator=g).bfloat16()),
        ("lm_head.weight", torch.randn(300, 64, generator=g).bfloat16()),
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def test_flatten_and_unflatten_are_exact_and_follow_name_order():
    bucket = _weights()
    flat = flatten_bucket(bucket)
    names = [n for n, _ in bucket]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
    back = unflatten_bucket(flat, names, dtypes, [list(t.shape) for _, t in bucket])
    assert [n for n, _ in back] == names
    assert all(torch.equal(_bits(a), _bits(b)) for (_, a), (_, b) in zip(bucket, back))
    with pytest.raises(ValueError, match="bytes"):
        unflatten_bucket(flat[:-1], names, dtypes, [list(t.shape) for _, t in bucket])


def test_buckets_hold_the_byte_budget_keep_order_and_fp8_pairs():
    named = _weights()
    for fp8 in (False, True):
        buckets = plan_buckets(named, fp8, 40_000)
        assert [it.name for b in buckets for it in b] == [n for n, _ in named]
        assert all(len(b) == 1 or b.planned.nbytes <= 40_000 for b in buckets)
        for b in buckets:  # the planned wire layout is what quantisation produces
            got = sorted((n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for it in b for n, t in it.materialise())
            assert got == sorted((e.name, e.dtype, e.shape) for e in b.planned.entries)


def test_fp8_quantises_projections_only_and_dequantises_close():
    from kernels.fp8_quant import reference_fp8_block_dequant

    out = dict(quantize_named(_weights(), fp8=True))
    q = out["model.layers.0.self_attn.q_a_proj.weight"]
    s = out["model.layers.0.self_attn.q_a_proj.weight_scale_inv"]
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 2) and s.dtype == torch.float32
    w = dict(_weights())["model.layers.0.self_attn.q_a_proj.weight"].float()
    err = (reference_fp8_block_dequant(q, s, torch.float32) - w).abs().max() / w.abs().max()
    assert err < 0.07  # e4m3 has 3 mantissa bits: half-ulp relative error <= 1/16
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert out[kept].dtype != torch.float8_e4m3fn and kept + "_scale_inv" not in out
    assert not fp8_eligible("model.layers.0.self_attn.indexer.weights_proj.weight", torch.zeros(4, 4))


# ---------------------------------------------------------------- two processes (gloo)

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(port: int, fp8: bool, payloads, result) -> None:
    from agentrl.sync.nccl_export import NcclWeightExporter, init_weights_update_group

    try:
        group = init_weights_update_group("127.0.0.1", port, 0, 2, "agentrl_test", backend="gloo", timeout_s=60)

        def announce(payload):
            payloads.put(payload)
            return lambda: None

        stats = NcclWeightExporter(group, group_name="agentrl_test", bucket_bytes=40_000, fp8=fp8).export(
            iter(_weights()), version=7, announce=announce)
        result.put(("trainer", stats.buckets, stats.bytes))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result.put(("trainer_error", repr(e), 0))


def _engine(port: int, fp8: bool, payloads, result) -> None:
    from agentrl.sync.nccl_export import init_weights_update_group, quantize_named, receive_bucket

    try:
        group = init_weights_update_group("127.0.0.1", port, 1, 2, "agentrl_test", backend="gloo", timeout_s=60)
        got, version = {}, None
        while version is None:
            p = payloads.get(timeout=60)
            assert p["group_name"] == "agentrl_test" and p["load_format"] == "flattened_bucket"
            for name, t in receive_bucket(group, p["names"], p["dtypes"], p["shapes"], "cpu"):
                got[name] = t.clone()
            version = p.get("weight_version")
        want = dict(quantize_named(_weights(), fp8))
        same = set(got) == set(want) and all(
            w.dtype == got[n].dtype and torch.equal(_bits(w), _bits(got[n])) for n, w in want.items())
        result.put(("engine", same, version))
    except BaseException as e:  # noqa: BLE001
        result.put(("engine_error", repr(e), None))


def test_two_process_broadcast_is_bitwise():
    """FP8 on: the stream carries e4m3 weights, fp32 scales and untouched bf16/fp32 tensors."""
    fp8 = True
    ctx = mp.get_context("spawn")
    payloads, result = ctx.Queue(), ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=f, args=(port, fp8, payloads, result)) for f in (_trainer, _engine)]
    for p in procs:
        p.start()
    try:
        answers = {}
        for _ in range(2):
            kind, a, b = result.get(timeout=120)
            answers[kind] = (a, b)
        assert "trainer_error" not in answers and "engine_error" not in answers, answers
        assert answers["engine"] == (True, "7")
        assert answers["trainer"][0] >= 2  # several buckets
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
