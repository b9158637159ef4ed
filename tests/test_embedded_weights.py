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


def _per_expert(state: dict[str, torch.Tensor], layer: int, e: int) -> dict[str, torch.Tensor]:
    """Checkpoint (per-expert) names of one expert, as SGLang and released checkpoints name them."""
    gate_up = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e]
    half = gate_up.shape[0] // 2
    base = f"model.layers.{layer}.mlp.experts.{e}."
    return {base + "gate_proj.weight": gate_up[:half].clone() + 1, base + "up_proj.weight": gate_up[half:].clone() - 1,
            base + "down_proj.weight": state[f"model.layers.{layer}.mlp.experts.down_proj"][e].clone() * 2}


def test_per_expert_names_land_in_the_fused_experts_and_mtp_layers_are_received_not_served():
    from tests.engine_models import glm_model

    model = glm_model()
    state = {n: t.clone() for n, t in model.state_dict().items()}
    update = _per_expert(state, 2, 5)
    n_layers = model.config.num_hidden_layers
    update[f"model.layers.{n_layers}.eh_proj.weight"] = torch.zeros(64, 128)  # the MTP layer
    prepared = wlib.prepare_named_tensors(model, update)
    assert sorted(prepared.received) == sorted(update) and prepared.not_served == [f"model.layers.{n_layers}.eh_proj.weight"]
    assert wlib.load_named_tensors(model, prepared) == 3
    after = model.state_dict()
    fused = after["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(fused[5, :32], state["model.layers.2.mlp.experts.gate_up_proj"][5, :32] + 1)
    assert torch.equal(fused[5, 32:], state["model.layers.2.mlp.experts.gate_up_proj"][5, 32:] - 1)
    assert torch.equal(fused[4], state["model.layers.2.mlp.experts.gate_up_proj"][4])  # other experts untouched
    assert torch.equal(after["model.layers.2.mlp.experts.down_proj"][5], update["model.layers.2.mlp.experts.5.down_proj.weight"])
    with pytest.raises(wlib.WeightUpdateError, match="unknown parameter name"):
        wlib.prepare_named_tensors(model, {"model.layers.2.mlp.experts.8.gate_proj.weight": torch.zeros(32, 64)})
    with pytest.raises(wlib.WeightUpdateError, match="shape mismatch"):
        wlib.prepare_named_tensors(model, {"model.layers.2.mlp.experts.1.gate_proj.weight": torch.zeros(16, 64)})


async def test_sglang_tensor_payload_receipts_and_get_weights_by_name():
    """load_format null: SGLang's own payload (agentrl.sync.tensor_ipc; byte copies on CPU); the
    session's receipt counts every HF name once per arrival; an unsafe pickle is refused."""
    import base64
    import os
    import pickle

    from agentrl.rollout.client import EngineClient, EngineError
    from agentrl.rollout.embedded.server import EmbeddedEngineServer
    from agentrl.sync.buckets import names_digest
    from agentrl.sync.fp8 import to_wire
    from agentrl.sync.tensor_ipc import encode
    from tests.engine_models import glm_model

    model = glm_model()
    state = {n: t.clone() for n, t in model.state_dict().items()}
    update = _per_expert(state, 3, 0)
    fp8_name = "model.layers.1.self_attn.o_proj.weight"  # sent dequantised: CPU payloads carry no float8
    wire = [(n, t) for n, t in update.items()] + [(fp8_name, state[fp8_name] * 0.5)]
    with pytest.raises(ValueError, match="cannot carry torch.float8_e4m3fn"):
        encode(to_wire(fp8_name, state[fp8_name], True))
    server = EmbeddedEngineServer(model, model_path="test-ipc", max_batch_size=2)
    url = await server.start()
    client = EngineClient(url, timeout_s=30)
    try:
        await client.begin_weight_update()
        await client.update_weights_from_tensor([encode(wire)], load_format=None, weight_version=3)
        await client.update_weights_from_tensor([encode(wire[:1])], load_format=None)  # one name twice
        bad = base64.b64encode(pickle.dumps([("x", os.system)])).decode()
        with pytest.raises(EngineError, match="blocked global"):
            await client.update_weights_from_tensor([bad], load_format=None)
        end = await client.end_weight_update()
        names = [*update, fp8_name]
        assert end["received"] == {"tensors": 5, "distinct": 4, "names_digest": names_digest(names)}
        got = await client.get_weights_by_name("model.layers.3.mlp.experts.0.down_proj.weight", truncate_size=10**6)
        assert got == update["model.layers.3.mlp.experts.0.down_proj.weight"].reshape(-1).tolist()  # bitwise (fp32)
        o_proj = await client.get_weights_by_name(fp8_name, truncate_size=10**6)
        assert o_proj == (state[fp8_name] * 0.5).reshape(-1).tolist()
        assert (await client.weight_version()) == 3
        with pytest.raises(EngineError, match="unknown parameter name"):
            await client.get_weights_by_name("no.such.weight")
    finally:
        await client.aclose()
        await server.stop()
