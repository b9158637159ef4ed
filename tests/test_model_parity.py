"""CPU-testable parts of bench/gpu/model_parity.py (the GPU stages run on the H200 machine)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from glm_fixtures import tiny_config, tiny_hf_state

from agentrl.models.mapping import hf_to_megatron

_SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "model_parity.py"


@pytest.fixture(scope="module")
def parity():
    spec = importlib.util.spec_from_file_location("model_parity", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf_state():
    return tiny_hf_state(tiny_config(mtp=0), seed=4)


def _module_with(names_shapes: dict[str, tuple[int, ...]], buffers: tuple[str, ...] = ()) -> torch.nn.Module:
    """An nn.Module tree whose state_dict has exactly these dotted names (stand-in for GPTModel)."""
    root = torch.nn.Module()
    for name, shape in names_shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        if name in buffers:
            mod.register_buffer(leaf, torch.zeros(shape))
        else:
            mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16)))
    return root


def test_load_into_megatron_copies_by_name_and_casts(parity, hf_state):
    mg = hf_to_megatron(hf_state, tiny_config(mtp=0))
    bias = "decoder.layers.2.mlp.router.expert_bias"
    model = _module_with({k: tuple(v.shape) for k, v in mg.items()}, buffers=(bias,))
    parity.load_into_megatron(model, mg)
    sd = model.state_dict()
    name = "decoder.layers.3.self_attention.core_attention.indexer.linear_wq_b.weight"
    assert sd[name].dtype == torch.bfloat16 and torch.equal(sd[name], mg[name].to(torch.bfloat16))
    assert sd[bias].dtype == torch.float32 and torch.equal(sd[bias], mg[bias])
    grads = parity.megatron_tensors(model, grads=True)
    assert set(grads) == set(mg) and all(not g.any() for g in grads.values())  # no grads yet: zeros


def test_load_into_megatron_is_strict(parity, hf_state):
    mg = hf_to_megatron(hf_state, tiny_config(mtp=0))
    shapes = {k: tuple(v.shape) for k, v in mg.items()}
    shapes["decoder.layers.0.extra.weight"] = (2,)
    del shapes["output_layer.weight"]
    shapes["decoder.final_layernorm.weight"] = (3,)
    with pytest.raises(ValueError, match=r"missing \['decoder.layers.0.extra.weight'\].*unexpected \['output_layer"
                                         r".*shape mismatch \['decoder.final_layernorm.weight'\]"):
        parity.load_into_megatron(_module_with(shapes), mg)


def test_synthetic_mtp_layer_is_a_valid_checkpoint_layer(parity, hf_state):
    config = tiny_config(mtp=1)
    state = hf_state
    full = {**state, **parity.synthetic_mtp_layer(config, state, seed=0)}
    mg = hf_to_megatron(full, config)  # strict: every MTP tensor Megatron needs is there
    assert "mtp.layers.0.mtp_model_layer.self_attention.core_attention.indexer.linear_wk.weight" in mg


def test_hf_model_on_cpu_and_helpers(parity):
    config = tiny_config(mtp=0)
    model = parity.hf_model(config, torch.float32, None, seed=0, device="cpu")
    norm = model.state_dict()["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(norm, torch.ones_like(norm))  # perturbed away from the init
    assert model.state_dict()["model.layers.2.mlp.gate.e_score_correction_bias"].abs().sum() > 0
    ids = torch.randint(0, config.vocab_size, (2, 16))
    logits = model(ids).logits
    loss = parity.next_token_loss(logits, ids)
    assert loss.ndim == 0 and torch.isfinite(loss)
    stats = parity.diff_stats(logits, logits + 0.5)
    assert stats["max_abs"] == pytest.approx(0.5) and stats["frac_gt_1e-3"] == 1.0
    mask = parity.causal_mask(2, 4, "cpu")
    assert mask.shape == (2, 1, 4, 4) and mask[0, 0, 0, 1] and not mask[0, 0, 1, 0]
    worst = parity.worst_tensors({"a": torch.ones(2), "b": torch.zeros(2)}, {"a": torch.ones(2), "b": torch.ones(2)})
    assert worst[0]["name"] == "b" and worst[0]["rel"] == 1.0


