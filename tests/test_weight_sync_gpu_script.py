"""The CPU-runnable parts of bench/gpu/weight_sync_gpu.py: the FP8 equality check (the update path's
wire bytes against `prepare --fp8`'s checkpoint), including that it catches a differing tensor."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "weight_sync_gpu.py"
_spec = importlib.util.spec_from_file_location("weight_sync_gpu", _PATH)
wsg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wsg)


@pytest.mark.slow  # ~7 s: a tiny checkpoint saved, converted and exported twice
def test_fp8_export_matches_the_checkpoint_and_catches_a_difference(tmp_path):
    from safetensors.torch import load_file, save_file

    from agentrl.models.prepare import write_fp8_checkpoint

    state = wsg.save_checkpoint(wsg.build_model({}, "cpu", base="tiny"), tmp_path / "hf", "cpu")
    assert any(".mlp.experts.0." in n for n in state)  # checkpoint names: experts per expert
    write_fp8_checkpoint(tmp_path / "hf", tmp_path / "fp8", device="cpu")
    ok = wsg.fp8_export_matches(state, tmp_path / "fp8", bucket_bytes=64 << 10)
    assert ok["equal_bitwise"] and ok["cpu_reference_equals_gpu_kernel"] and ok["buckets"] > 1, ok
    assert ok["wire_tensors"] == ok["checkpoint_tensors"] == len(state) + ok["fp8_tensors"]
    shard = next((tmp_path / "fp8").glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = next(n for n in tensors if n.endswith("o_proj.weight_scale_inv"))
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(shard))
    bad = wsg.fp8_export_matches(state, tmp_path / "fp8")
    assert not bad["equal_bitwise"] and bad["mismatched"] == [name]


def test_the_script_needs_a_gpu():
    if not torch.cuda.is_available():
        assert wsg.main(["--out", "/dev/null"]) == 2
