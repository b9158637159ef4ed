"""The embedded engine's weight checks and the flattened bucket layout, as SGLang 0.5.23 has it:
one uint8 buffer of several dtypes back to back, each byte offset a multiple of its itemsize."""

from __future__ import annotations

import pytest
import torch

from agentrl.rollout.embedded import weights as wlib
from agentrl.sync.nccl_export import flatten_bucket
from tests.engine_models import llama_model


def test_multi_dtype_bucket_round_trips_through_the_senders_flattening():
    named = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)),
             ("c", torch.randn(2, 2).to(torch.float16)), ("d", torch.arange(5, dtype=torch.uint8))]
    flat = flatten_bucket(named)  # the trainer's side (agentrl.sync.nccl_export)
    layout = wlib.bucket_layout([n for n, _ in named], ["float32", "bfloat16", "float16", "uint8"],
                                [list(t.shape) for _, t in named])
    assert [(e.start, e.end) for e in layout] == [(0, 60), (60, 74), (74, 82), (82, 87)]
    out = wlib.unpack_bucket(flat, layout)
    for name, t in named:
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


@pytest.mark.parametrize("names,dtypes,shapes,match", [
    (["a", "b"], ["bfloat16", "float32"], [[3], [1]], "Unaligned received tensor b: byte offset 6"),
    (["a", "b"], ["uint8", "float16"], [[1], [2]], "Unaligned"),
    (["a"], ["float32"], [[-1, 2]], "Negative dimension"),
    (["a"], ["torch.float32"], [[1]], "unknown dtype"),
    (["a"], ["no_such"], [[1]], "unknown dtype"),
    (["a"], ["float32"], [[True]], "list of ints"),
    (["a", "b"], ["float32"], [[1], [1]], "differ in length"),
    ([], [], [], "empty tensor bucket"),
])
def test_bad_bucket_layouts_are_refused(names, dtypes, shapes, match):
    with pytest.raises(wlib.WeightUpdateError, match=match):
        wlib.bucket_layout(names, dtypes, shapes)


def test_direct_receive_checks():
    wlib.check_receive(["a"], ["float8_e4m3fn"], [[2, 2]], None)
    with pytest.raises(wlib.WeightUpdateError, match="load_format"):
        wlib.check_receive(["a"], ["float32"], [[1]], "zip")
    with pytest.raises(wlib.WeightUpdateError, match="same length"):
        wlib.check_receive(["a", "b"], ["float32"], [[1]], None)


def test_non_finite_weights_change_nothing():
    model = llama_model()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    bad = {"model.norm.weight": torch.ones(64), "lm_head.weight": before["lm_head.weight"].clone()}
    bad["lm_head.weight"][3, 4] = float("nan")
    with pytest.raises(wlib.WeightUpdateError, match=r"non-finite.*lm_head.weight"):
        wlib.prepare_named_tensors(model, bad)
    bad["lm_head.weight"][3, 4] = float("inf")
    with pytest.raises(wlib.WeightUpdateError, match="non-finite"):
        wlib.prepare_named_tensors(model, bad)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    good = wlib.prepare_named_tensors(model, {"model.norm.weight": torch.full((64,), 2.0)})
    assert wlib.load_named_tensors(model, good) == 1 and torch.equal(model.model.norm.weight, torch.full((64,), 2.0))
