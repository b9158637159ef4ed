"""Expert parallelism on two gloo processes: EP2 x DP2 of the tiny GLM exports exactly the HF weights
(each expert broadcast from its owner) and trains to the same loss as the torch backend."""

from __future__ import annotations

import copy
import multiprocessing as mp
import socket

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, result) -> None:
    try:
        import torch
        from test_megatron_backend import _train_cfg, _trajs

        from agentrl.config.layout import Layout
        from agentrl.config.schema import AlgorithmConfig
        from agentrl.models.tiny import build_tiny_model
        from agentrl.train.megatron_backend import MegatronBackend
        from agentrl.train.megatron_parallel import DistInit

        model = build_tiny_model(0).float()
        state = model.state_dict()
        train = _train_cfg(max_tokens=40)
        layout = Layout.resolve(world=2, ep=2, num_layers=model.config.num_hidden_layers,
                                n_experts=model.config.n_routed_experts)
        mb = MegatronBackend(model.config, train, AlgorithmConfig(group_size=2), hf_state=state, layout=layout,
                             dist_init=DistInit(rank, 2, "127.0.0.1", port))
        local_experts = sum(1 for n, _ in mb.named_params if ".local_experts." in n and "linear_fc1" in n)
        exported = dict(mb.named_weights())
        exact = set(exported) == set(state) and all(torch.equal(exported[k], state[k]) for k in state)
        trajs = _trajs()
        losses = [mb.train_step(trajs, [t.group_id for t in trajs])["loss"] for _ in range(2)]
        result.put((rank, local_experts, exact, losses))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result.put((rank, repr(e), None, None))


@pytest.mark.slow
def test_ep2_exports_exact_weights_and_matches_the_torch_backend():
    from test_megatron_backend import _train_cfg, _trajs

    from agentrl.config.schema import AlgorithmConfig
    from agentrl.models.tiny import build_tiny_model
    from agentrl.train.torch_backend import TorchBackend

    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, result)) for r in range(2)]
    for p in procs:
        p.start()
    tb = TorchBackend(copy.deepcopy(build_tiny_model(0).float()), _train_cfg(max_tokens=40), AlgorithmConfig(group_size=2))
    trajs = _trajs()
    want = [tb.train_step(trajs, [t.group_id for t in trajs])["loss"] for _ in range(2)]
    try:
        answers = sorted(result.get(timeout=240) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, local_experts, exact, losses in answers:
        assert isinstance(local_experts, int), local_experts
        n_moe_layers = 3  # tiny: 2 dense + 3 MoE layers, 8 experts -> 4 per EP rank
        assert local_experts == 4 * n_moe_layers and exact
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, want)), (losses, want)
