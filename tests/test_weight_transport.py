"""The WeightTransport conformance suite: every implementation, against two real embedded-engine
processes (the tiny GLM), through the same session and stage loop the run uses
(agentrl.sync.session.run_update): every tensor arrives at every engine exactly once and bitwise,
the version is stamped on the last bucket, FP8 tensors are what the engine's dequantisation of the
planned wire tensors gives, an engine that is gone is reported and the others still updated.
cuda_ipc needs a GPU: on CPU it must refuse every engine with the reason, not crash or hang."""

from __future__ import annotations

import contextlib

import pytest
import torch

from agentrl.sync.session import EngineSession, run_update
from agentrl.sync.source import LocalSource
from agentrl.sync.transport import StageRequest, WeightTransport
from agentrl.sync.update import make_transport

pytestmark = pytest.mark.slow
TIMEOUT_S = 30.0
KINDS = ("http_tensors", "nccl", "cuda_ipc")


@pytest.fixture(scope="module")
def engines():
    from bench.engine import _EngineProcess

    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(_EngineProcess("tiny", 4, 1, 0, 120.0)) for _ in range(2)]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    from agentrl.models.tiny import build_tiny_model

    return {n: t.detach().clone() for n, t in build_tiny_model(seed).state_dict().items()}


async def _update(kind: str, urls: list[str], named: dict[str, torch.Tensor], version: int,
                  fp8: frozenset[str] = frozenset()) -> dict:
    transport = make_transport(kind, rank=0, node_ip="127.0.0.1", device="cpu")
    assert isinstance(transport, WeightTransport) and transport.kind == kind
    source = LocalSource(named.items())

    def request(stage: int, live: list[str]) -> StageRequest:
        return StageRequest(stage, tuple(live), version, True, True, fp8, 64 << 10, TIMEOUT_S, (1,) * len(live))

    try:
        return await run_update(EngineSession(urls, pause_mode="retract", timeout_s=TIMEOUT_S), 1, request,
                                lambda req: transport.send_stage(source, req))
    finally:
        transport.close()
        transport.close()  # idempotent


async def _served(url: str, names: list[str]) -> dict[str, list[float]]:
    from agentrl.rollout.client import EngineClient

    async with EngineClient(url, timeout_s=TIMEOUT_S) as c:
        return {n: await c.get_weights_by_name(n, truncate_size=1 << 30) for n in names}


async def _version(url: str) -> int:
    from agentrl.rollout.client import EngineClient

    async with EngineClient(url, timeout_s=TIMEOUT_S) as c:
        return await c.weight_version()


@pytest.mark.parametrize("kind", KINDS)
async def test_transport_conformance(kind, engines):
    from agentrl.cluster.engine_process import free_port
    from agentrl.rollout.embedded.weights import dequantize_fp8_weights
    from agentrl.sync.buckets import TensorSpec
    from agentrl.sync.fp8 import fp8_rule, to_wire

    new = _weights(seed=11)
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    out = await _update(kind, [*engines, dead], new, version=5)
    if kind == "cuda_ipc" and not torch.cuda.is_available():
        assert set(out["failed_engines"]) == {*engines, dead}
        assert all("GPU" in why for u, why in out["failed_engines"].items() if u != dead), out["failed_engines"]
        return
    assert set(out["failed_engines"]) == {dead}, out["failed_engines"]
    assert out["sync_tensors"] == len(new) and out["sync_buckets"] > 1 and out["sync_retries"] == 0
    for url in engines:  # the receipts were checked by the session; the values are checked here
        assert await _version(url) == 5
        served = await _served(url, list(new))
        assert all(served[n] == t.float().reshape(-1).tolist() for n, t in new.items())
    fp8 = frozenset(n for n, t in new.items() if fp8_rule(TensorSpec.of(n, t)))
    assert any(".indexer.wq_b." in n for n in fp8)
    out = await _update(kind, engines, new, version=6, fp8=fp8)
    assert not out["failed_engines"] and out["sync_tensors"] == len(new)
    wire = {}
    for n, t in new.items():
        wire.update(to_wire(n, t, n in fp8))
    expect = dequantize_fp8_weights(wire)
    for url in engines:
        served = await _served(url, sorted(fp8)[:6])
        assert all(served[n] == expect[n].float().reshape(-1).tolist() for n in served)
