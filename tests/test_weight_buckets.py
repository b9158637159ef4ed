"""The shared bucket planner (agentrl.sync.buckets) and the FP8 name rules (agentrl.sync.fp8)."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from agentrl.sync.buckets import (
    TensorSpec,
    fill,
    plan_buckets,
    views,
    wire_entries,
)
from agentrl.sync.fp8 import fp8_names_of_checkpoint, fp8_rule, to_wire


def _specs() -> list[TensorSpec]:
    return [TensorSpec("model.embed_tokens.weight", "bfloat16", (300, 64)),
            TensorSpec("model.layers.0.self_attn.q_a_proj.weight", "bfloat16", (200, 130)),
            TensorSpec("model.layers.0.input_layernorm.weight", "float32", (63,)),
            TensorSpec("model.layers.0.self_attn.indexer.wk.weight", "bfloat16", (33, 64)),
            TensorSpec("model.layers.0.mlp.gate.e_score_correction_bias", "float32", (8,)),
            TensorSpec("model.layers.0.mlp.experts.3.down_proj.weight", "bfloat16", (64, 257)),
            TensorSpec("lm_head.weight", "bfloat16", (300, 64))]


def test_buckets_keep_order_budget_and_itemsize_aligned_offsets():
    specs = _specs()
    for fp8 in (None, fp8_rule):
        buckets = plan_buckets(specs, 60_000, fp8)
        assert [n for b in buckets for n in b.tensors] == [s.name for s in specs]
        assert [b.index for b in buckets] == list(range(len(buckets)))
        for b in buckets:
            want = sum(e.nbytes for s in specs if s.name in b.tensors
                       for e in wire_entries(s, fp8 is not None and fp8_rule(s)))
            assert b.nbytes == want and (len(b.tensors) == 1 or b.nbytes <= 60_000)
            at = 0
            for e, off in zip(b.entries, b.offsets, strict=True):
                assert off == at and off % torch.empty((), dtype=getattr(torch, e.dtype)).element_size() == 0
                at += e.nbytes
        if fp8 is not None:  # an FP8 weight and its scales travel in one bucket
            for b in buckets:
                names = [e.name for e in b.entries]
                assert all(n.removesuffix("_scale_inv") in names for n in names if n.endswith("_scale_inv"))
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(specs, 0)


def test_fp8_rule_covers_projections_and_the_indexer_keys_only():
    q = {s.name for s in _specs() if fp8_rule(s)}
    assert q == {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.indexer.wk.weight",
                 "model.layers.0.mlp.experts.3.down_proj.weight"}
    for kept in ("model.layers.0.self_attn.indexer.weights_proj.weight", "model.layers.78.eh_proj.weight",
                 "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_a_layernorm.weight"):
        assert not fp8_rule(TensorSpec(kept, "bfloat16", (64, 64)))
    assert fp8_rule(TensorSpec("model.layers.3.self_attn.indexer.wq_b.weight", "bfloat16", (64, 64)))


def test_filled_bucket_reads_back_bitwise_in_wire_layout():
    g = torch.Generator().manual_seed(0)
    tensors = {s.name: torch.randn(s.shape, generator=g).to(getattr(torch, s.dtype)) for s in _specs()}
    (b,) = plan_buckets(_specs(), 1 << 30, fp8_rule)
    flat = torch.zeros(b.nbytes, dtype=torch.uint8)
    layout = b.offset_of()
    wire = {}
    for s in _specs():
        for name, t in to_wire(s.name, tensors[s.name], fp8_rule(s)):
            fill(flat, layout[name][0], t)
            wire[name] = t
    back = dict(views(flat, b))
    assert set(back) == set(wire)
    assert all(torch.equal(back[n].view(torch.uint8), wire[n].contiguous().view(torch.uint8)) for n in wire)
    assert back["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert back["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].shape == (2, 2)


def test_fp8_names_come_from_the_checkpoints_scale_inv_keys(tmp_path):
    def header_only(path, names):  # a safetensors file whose tensors are all empty
        head = json.dumps({n: {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for n in names}).encode()
        path.write_bytes(struct.pack("<Q", len(head)) + head)

    header_only(tmp_path / "a.safetensors", ["x.weight", "x.weight_scale_inv", "y.weight"])
    header_only(tmp_path / "b.safetensors", ["z.weight_scale_inv", "w.weight", "w.weight_scale_inv"])
    assert fp8_names_of_checkpoint(tmp_path) == {"x.weight", "w.weight"}  # z has scales but no weight
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x.weight": "a.safetensors", "y.weight": "a.safetensors"}}))
    assert fp8_names_of_checkpoint(tmp_path) == frozenset()
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        fp8_names_of_checkpoint(tmp_path / "missing")
