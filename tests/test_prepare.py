"""prepare: HF -> Megatron torch_dist conversion; prepare-cp: verified, resumable local copy."""

from __future__ import annotations

import json

import pytest
import torch
from glm_fixtures import tiny_config, tiny_hf_state, to_per_expert
from safetensors.torch import save_file

from agentrl.config.layout import Layout
from agentrl.models import prepare
from agentrl.models.mapping import hf_to_megatron
from agentrl.models.prepare import (
    convert_hf_to_megatron,
    copy_checkpoint_to_local,
    copy_complete,
    dist_checkpoint_key,
    read_dist_checkpoint,
)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A released-style checkpoint: per-expert tensors, MTP layer, two safetensors shards + index."""
    config = tiny_config(mtp=1)
    state = to_per_expert(tiny_hf_state(config, seed=5))
    folder = tmp_path_factory.mktemp("hf")
    config.save_pretrained(folder)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(folder / fname))
    weight_map = {k: fname for fname, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder, config, state


def _expected_dist_state(mg_state):
    out, experts = {}, {}
    for name, t in mg_state.items():
        key, e = dist_checkpoint_key(name)
        if e is None:
            out[key] = t
        else:
            experts.setdefault(key, {})[e] = t
    out.update({k: torch.stack([v[e] for e in sorted(v)]) for k, v in experts.items()})
    return out


def test_dist_checkpoint_keys():
    assert dist_checkpoint_key("decoder.layers.3.mlp.experts.local_experts.6.linear_fc1.weight") == (
        "decoder.layers.3.mlp.experts.experts.linear_fc1.weight", 6)
    assert dist_checkpoint_key("decoder.layers.3.mlp.experts.linear_fc2.weight11") == (
        "decoder.layers.3.mlp.experts.experts.linear_fc2.weight", 11)
    assert dist_checkpoint_key("mtp.layers.0.mtp_model_layer.input_layernorm.weight") == (
        "mtp.layers.0.transformer_layer.input_layernorm.weight", None)
    assert dist_checkpoint_key("decoder.layers.0.mlp.linear_fc1.weight") == ("decoder.layers.0.mlp.linear_fc1.weight", None)


def test_convert_writes_the_megatron_global_view(hf_checkpoint, tmp_path):
    folder, config, state = hf_checkpoint
    out = convert_hf_to_megatron(folder, tmp_path / "mg", Layout(tp=2, pp=2, cp=1, ep=2, etp=1, dp=1, pp_split=(3, 2)))
    assert json.loads((out / "metadata.json").read_text()) == {"sharded_backend": "torch_dist",
                                                              "sharded_backend_version": 1}
    assert (out / "common.pt").exists() and not (tmp_path / "mg.partial").exists()
    got = read_dist_checkpoint(out)
    want = _expected_dist_state(hf_to_megatron(state, config))
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert got["decoder.layers.2.mlp.experts.experts.linear_fc1.weight"].shape == (8, 64, 64)


def test_convert_casts_but_keeps_the_expert_bias_fp32(hf_checkpoint, tmp_path):
    folder, _, _ = hf_checkpoint
    got = read_dist_checkpoint(convert_hf_to_megatron(folder, tmp_path / "mg", dtype=torch.bfloat16))
    assert got["decoder.layers.2.self_attention.linear_proj.weight"].dtype == torch.bfloat16
    assert got["decoder.layers.2.mlp.router.expert_bias"].dtype == torch.float32


def test_convert_refuses_bad_layouts_and_existing_output(hf_checkpoint, tmp_path):
    folder, _, _ = hf_checkpoint
    with pytest.raises(ValueError, match="every stage must start"):
        convert_hf_to_megatron(folder, tmp_path / "a", Layout(tp=1, pp=2, cp=1, ep=1, etp=1, dp=1, pp_split=(2, 3)))
    with pytest.raises(ValueError, match="ep=3 does not divide"):
        convert_hf_to_megatron(folder, tmp_path / "b", Layout(tp=1, pp=1, cp=1, ep=3, etp=1, dp=3, pp_split=(5,)))
    (tmp_path / "c").mkdir()
    with pytest.raises(FileExistsError):
        convert_hf_to_megatron(folder, tmp_path / "c")


@pytest.mark.slow  # imports megatron-core
def test_megatron_dist_checkpointing_loads_the_conversion(hf_checkpoint, tmp_path):
    """Load with megatron's own loader, through ShardedTensors shaped as GPTModel builds them."""
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    folder, config, state = hf_checkpoint
    out = convert_hf_to_megatron(folder, tmp_path / "mg")
    mg = hf_to_megatron(state, config)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    sharded = {}
    for name, t in mg.items():
        key, e = dist_checkpoint_key(name)
        if e is None:
            sharded[name] = ShardedTensor.from_rank_offsets(key, torch.empty_like(t), replica_id=0)
        else:
            offsets = ((0, e, config.n_routed_experts),)
            st = ShardedTensor.from_rank_offsets(key, torch.empty_like(t), *offsets, replica_id=(0, 0, 0),
                                                 prepend_axis_num=1)
            sharded[name] = apply_swiglu_sharded_factory(st, offsets) if "linear_fc1" in name else st
    loaded = dist_checkpointing.load(sharded, str(out))
    for name, t in mg.items():
        assert torch.equal(loaded[name], t), name


def _make_source(tmp_path, files):
    src = tmp_path / "src"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    return src


def test_copy_then_second_run_skips_verified_files(tmp_path):
    src = _make_source(tmp_path, {"a.distcp": b"a" * 1000, "sub/b.bin": b"b" * 10, "metadata.json": b"{}"})
    first = copy_checkpoint_to_local(src, tmp_path / "dst")
    assert sorted(first.copied) == ["a.distcp", "metadata.json", "sub/b.bin"] and copy_complete(tmp_path / "dst")
    second = copy_checkpoint_to_local(src, tmp_path / "dst")
    assert second.copied == [] and sorted(second.skipped) == sorted(first.copied)
    assert (tmp_path / "dst" / "sub/b.bin").read_bytes() == b"b" * 10


def test_corrupted_local_file_is_detected_and_recopied(tmp_path):
    src = _make_source(tmp_path, {"a.distcp": b"a" * 1000, "b.distcp": b"b" * 1000})
    copy_checkpoint_to_local(src, tmp_path / "dst")
    (tmp_path / "dst" / "a.distcp").write_bytes(b"a" * 999 + b"X")  # same size, flipped byte
    report = copy_checkpoint_to_local(src, tmp_path / "dst")
    assert report.recopied == ["a.distcp"] and report.skipped == ["b.distcp"]
    assert (tmp_path / "dst" / "a.distcp").read_bytes() == b"a" * 1000


def test_interrupted_copy_is_never_complete_and_resumes(tmp_path, monkeypatch):
    src = _make_source(tmp_path, {"1.bin": b"1" * 100, "2.bin": b"2" * 100, "3.bin": b"3" * 100})
    real = prepare._copy_one
    calls = []

    def crash_on_second(s, t):
        calls.append(s.name)
        if len(calls) == 2:
            t.with_name(t.name + prepare._PARTIAL_SUFFIX).write_bytes(b"half")  # what a crash leaves
            raise KeyboardInterrupt
        return real(s, t)

    monkeypatch.setattr(prepare, "_copy_one", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        copy_checkpoint_to_local(src, tmp_path / "dst")
    assert not copy_complete(tmp_path / "dst") and not (tmp_path / "dst" / "2.bin").exists()
    monkeypatch.setattr(prepare, "_copy_one", real)
    report = copy_checkpoint_to_local(src, tmp_path / "dst")
    assert report.skipped == ["1.bin"] and report.copied == ["2.bin", "3.bin"] and copy_complete(tmp_path / "dst")
    assert not list((tmp_path / "dst").glob("*" + prepare._PARTIAL_SUFFIX))


def test_changed_source_file_is_copied_again(tmp_path):
    src = _make_source(tmp_path, {"a.bin": b"old"})
    copy_checkpoint_to_local(src, tmp_path / "dst")
    (src / "a.bin").write_bytes(b"new contents")
    report = copy_checkpoint_to_local(src, tmp_path / "dst", verify_existing=False)
    assert report.recopied == ["a.bin"] and (tmp_path / "dst" / "a.bin").read_bytes() == b"new contents"


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        copy_checkpoint_to_local(tmp_path / "nope", tmp_path / "dst")


def test_fp8_checkpoint_for_the_engines(hf_checkpoint, tmp_path):
    """prepare --fp8: rule tensors (the indexer's wq_b / wk included) become e4m3 + weight_scale_inv,
    bit for bit what the update path quantises; the rest is copied; the update's FP8 names are read
    back from the checkpoint's *_scale_inv keys."""
    from safetensors.torch import load_file

    from agentrl.config.loader import load_config
    from agentrl.sync.buckets import TensorSpec
    from agentrl.sync.fp8 import fp8_names_of_checkpoint, fp8_rule, to_wire
    from agentrl.sync.update import fp8_names

    folder, _, state = hf_checkpoint
    out = tmp_path / "fp8"
    counts = prepare.write_fp8_checkpoint(folder, out, device="cpu")
    rule = {n for n, t in state.items() if fp8_rule(TensorSpec.of(n, t))}
    assert counts == {"fp8": len(rule), "kept": len(state) - len(rule)}
    assert any(n.endswith("indexer.wq_b.weight") for n in rule) and any(n.endswith("indexer.wk.weight") for n in rule)
    assert fp8_names_of_checkpoint(out) == rule
    written = {}
    for shard in sorted(out.glob("*.safetensors")):
        written.update(load_file(str(shard)))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(written) == set(state) | {n + "_scale_inv" for n in rule}
    for name, t in state.items():
        for wire, w in to_wire(name, t, name in rule):
            assert written[wire].dtype == w.dtype and torch.equal(written[wire].view(torch.uint8), w.view(torch.uint8))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    cfg = load_config("local", [f"model.rollout_path={out}", "rollout.weight_sync_fp8=true"])
    assert fp8_names(cfg) == (rule, False)  # the update quantises exactly these
    assert fp8_names(load_config("local", ["rollout.weight_sync_fp8=true"])) == (frozenset(), True)
    with pytest.raises(FileExistsError, match="rollout_path"):
        prepare.write_fp8_checkpoint(folder, out)
