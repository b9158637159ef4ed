"""The embedded engine on CUDA (the GPU smoke run puts one beside the Megatron trainer on one H200).
Run on the GPU machine:  python -m pytest tests/test_embedded_engine_gpu.py -m gpu -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
import torch

from agentrl.rollout.client import EngineClient
from agentrl.rollout.types import SamplingParams
from tests.engine_models import glm_model, llama_model

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["llama", "glm"])
async def cuda_engine(request):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from agentrl.rollout.embedded.server import EmbeddedEngineServer

    model = (llama_model() if request.param == "llama" else glm_model()).cuda()
    server = EmbeddedEngineServer(model, max_batch_size=8)
    url = await server.start()
    client = EngineClient(url, timeout_s=120)
    yield server, client, model
    await client.aclose()
    await server.stop()


@torch.no_grad()
def teacher(model, ids: list[int], start: int, temperature: float) -> list[float]:
    logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
    lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return [lp[p - 1, ids[p]].item() for p in range(start, len(ids))]


async def test_generates_on_cuda_with_teacher_forced_logprobs(cuda_engine):
    server, client, model = cuda_engine
    assert server.scheduler.device.type == "cuda"
    p = [5, 17, 3, 99, 42]
    for sp in (SamplingParams(max_new_tokens=16, temperature=0.0), SamplingParams(max_new_tokens=16, temperature=0.8),
               SamplingParams(max_new_tokens=16, temperature=1.2, top_p=0.7, top_k=20)):
        res = await client.generate(p, sp, session_id="g")
        ref = teacher(model, p + res.output_ids, len(p), sp.temperature)
        assert max(abs(a - b) for a, b in zip(res.logprobs, ref)) < 1e-3
    outs = await asyncio.gather(*(client.generate([i + 1, i + 2], SamplingParams(max_new_tokens=8, temperature=0.0),
                                                  session_id=f"b{i}") for i in range(6)))
    assert all(len(o.output_ids) == 8 for o in outs) and server.scheduler.stats()["max_decode_batch_size"] > 1


async def test_weight_update_on_cuda_in_a_session(cuda_engine):
    from agentrl.rollout.embedded.weights import encode_safetensors_b64

    _, client, model = cuda_engine
    new = {n: t.cpu() * 0.5 for n, t in model.state_dict().items() if t.is_floating_point()}
    await client.pause_generation("retract")
    await client.begin_weight_update()
    await client.update_weights_from_tensor([encode_safetensors_b64(new)], load_format="safetensors_b64",
                                            weight_version=3)
    await client.end_weight_update()
    await client.continue_generation()
    state = model.state_dict()
    assert all(torch.equal(state[n].cpu(), t) for n, t in new.items())
    res = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=4), session_id="w")
    assert res.weight_versions == [3] * 4


def test_engine_serve_on_cuda_starts_and_answers(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import httpx

    from agentrl.cluster.engine_process import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "engine", "serve", "--model", "tiny", "--port",
                             str(port), "--device", "cuda", "--dtype", "bfloat16"])
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health_generate", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert httpx.get(url + "/server_info", timeout=10).json()["device"].startswith("cuda")
        r = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}},
                       timeout=60).json()
        assert len(r["output_ids"]) == 4 and r["meta_info"]["weight_versions"][0]["end"] == 4
    finally:
        proc.terminate()
        proc.wait(30)
