"""TorchBackend: log-probs only where the loss reads them, and training only the top layers."""

from __future__ import annotations

import pytest
import torch

from agentrl.agent.trajectory import Trajectory
from agentrl.config.schema import AlgorithmConfig, TrainConfig
from agentrl.models.tiny import build_tiny_model
from agentrl.train.batching import collate
from agentrl.train.torch_backend import TorchBackend, freeze_below_top_layers


def _trajs(n: int = 4) -> list[Trajectory]:
    return [Trajectory(episode_id=f"e{i}", task_id="t", group_id="g", prompt_len=3,
                       token_ids=[5, 6, 7, 8 + i, 9, 10 + i, 11], loss_mask=[0, 0, 0, 1, 1, 0, 1],
                       rollout_logprobs=[0, 0, 0, -1.0, -1.0, 0, -1.0], weight_versions=[-1, -1, -1, 0, 0, -1, 0],
                       outcome="scored", reward=float(i % 2)) for i in range(n)]


def test_masked_logprobs_equal_full_computation_on_loss_tokens():
    from kernels.logprobs_torch import chunked_logprobs

    model = build_tiny_model(0)
    backend = TorchBackend(model, TrainConfig(logprob_chunk_tokens=64), AlgorithmConfig(group_size=4))
    trajs = _trajs()
    mb = collate(trajs, [0.5] * 4, list(range(4)), 0)
    got = backend._token_logprobs(model, mb)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state[:, :-1]
        B, T, H = hidden.shape
        full = chunked_logprobs(hidden.reshape(B * T, H), model.get_output_embeddings().weight,
                                mb.targets.reshape(-1), temperature=1.0, chunk_tokens=64).view(B, T)
    on = mb.loss_mask.bool()
    assert on.sum() == 12
    assert torch.allclose(got[on], full[on], atol=1e-6)
    assert torch.all(got[~on] == 0)  # never computed, never read


def test_trainable_layers_updates_only_the_top_layers():
    model = build_tiny_model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train = TrainConfig(logprob_chunk_tokens=64, trainable_layers=1)
    train.optimizer.lr = 1e-2
    backend = TorchBackend(model, train, AlgorithmConfig(group_size=4))
    metrics = backend.train_step(_trajs(), ["g"] * 4)
    assert metrics["grad_norm"] > 0
    top = len(model.get_decoder().layers) - 1
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed, "nothing trained"
    assert all(k.startswith(f"model.layers.{top}.") or k.startswith("model.norm") for k in changed), changed
    assert any(k.startswith(f"model.layers.{top}.") for k in changed)


def test_trainable_layers_out_of_range_names_the_field():
    model = build_tiny_model(0)
    n = len(model.get_decoder().layers)
    with pytest.raises(ValueError, match=rf"train.trainable_layers={n + 1} .* 1..{n}"):
        freeze_below_top_layers(model, n + 1)
