"""The embedded engine under bad input: a 400 naming the field, never a failed batch; NaN or Inf
weights refused with nothing changed; a weight-update rendezvous with a dead trainer bounded."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

from agentrl.cluster.engine_process import free_port
from agentrl.rollout.client import EngineClient, EngineError
from agentrl.rollout.embedded.request import GenRequest
from agentrl.rollout.embedded.sampling import RowParams
from agentrl.rollout.embedded.weights import encode_safetensors_b64
from agentrl.rollout.types import SamplingParams
from tests.engine_models import VOCAB, llama_model


@pytest.fixture
async def engine():
    from agentrl.rollout.embedded.server import EmbeddedEngineServer

    model = llama_model()
    server = EmbeddedEngineServer(model, max_batch_size=8, weight_update_timeout_s=1.0)
    url = await server.start()
    client = EngineClient(url, timeout_s=60)
    yield server, client
    await client.aclose()
    await server.stop()


def body(ids="[1, 2, 3]", **sp: str) -> str:
    """A /generate body as raw JSON text (so NaN and Infinity can be written as JSON readers accept them)."""
    params = ", ".join(f'"{k}": {v}' for k, v in sp.items())
    return f'{{"input_ids": {ids}, "sampling_params": {{{params}}}}}'


BAD = [
    (body("[true, false, true]"), "input_ids[0] is a bool"),
    (body("[1, 2.5]"), "input_ids[1]"),
    (body(f"[1, {VOCAB}]"), "input_ids[1]"),
    (body("[1, -1]"), "input_ids[1]"),
    (body("[]"), "input_ids must be a non-empty list"),
    (body('"1 2 3"'), "input_ids must be a non-empty list"),
    (body("[[1, 2], [3, true]]"), "input_ids[1][1]"),
    (body("[[1, [2]]]"), "input_ids[0][1]"),
    (body("[{\"a\": 1}]"), "input_ids[0]"),
    (body(temperature="NaN"), "sampling_params.temperature"),
    (body(temperature="Infinity"), "sampling_params.temperature"),
    (body(temperature="-0.5"), "sampling_params.temperature"),
    (body(temperature="true"), "sampling_params.temperature"),
    (body(temperature='"1.0"'), "sampling_params.temperature"),
    (body(top_p="NaN"), "sampling_params.top_p"),
    (body(top_p="0"), "sampling_params.top_p"),
    (body(top_p="1.5"), "sampling_params.top_p"),
    (body(top_k="0"), "sampling_params.top_k"),
    (body(top_k="-7"), "sampling_params.top_k"),
    (body(top_k="2.0"), "sampling_params.top_k"),
    (body(max_new_tokens="-1"), "sampling_params.max_new_tokens"),
    (body(max_new_tokens="1e3"), "sampling_params.max_new_tokens"),
    (body(max_new_tokens="true"), "sampling_params.max_new_tokens"),
    (body(n="0"), "sampling_params.n"),
    (body(n="100000"), "sampling_params.n"),
    (body(stop_token_ids="[true]"), "sampling_params.stop_token_ids"),
    (body(stop_token_ids="[99999]"), "sampling_params.stop_token_ids"),
    (body(stop='[1]'), "sampling_params.stop"),
    (body(ignore_eos='"yes"'), "sampling_params.ignore_eos"),
    (body(repetition_penalty="NaN"), "sampling_params.repetition_penalty"),
    (body(min_p="0.1"), "sampling_params.min_p"),
    (body(logit_bias="{}"), "logit_bias"),
    ('{"input_ids": [1], "sampling_params": [1, 2]}', "sampling_params must be an object"),
    ('{"input_ids": [1], "return_logprob": "true"}', "return_logprob"),
    ('{"input_ids": [1], "logprob_start_len": -2}', "logprob_start_len"),
    ('{"input_ids": [1], "rid": 5}', "rid"),
    ('{"input_ids": [1], "rid": ["a", "a"]}', "rid"),
    ('{"input_ids": [1], "stream": true}', "stream"),
    ('{"input_ids": [1], "lora_path": "x"}', "unknown field"),
    ('{"input_ids": [1], "text": "hi"}', "not both"),
    ('[1, 2, 3]', "JSON object"),
    ('{"input_ids": [1', "invalid JSON"),
]


async def test_bad_generate_requests_are_400_naming_the_field(engine):
    server, client = engine
    async with httpx.AsyncClient(base_url=client.base_url, timeout=30) as h:
        for raw, field in BAD:
            r = await h.post("/generate", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, raw
            assert field in r.json()["error"]["message"], (raw, r.text)
    assert server.scheduler.stats()["requests_done"] == 0  # none of them reached the scheduler
    ok = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2), session_id="s")
    assert len(ok.output_ids) == 2


async def test_a_bad_request_never_fails_the_running_batch(engine):
    server, client = engine
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    running = [asyncio.create_task(client.generate(p, greedy, session_id=f"g{i}")) for i, p in enumerate(prompts)]
    for _ in range(2000):  # until they decode together
        if server.scheduler.stats()["last_decode_batch_size"] >= 2:
            break
        await asyncio.sleep(0.005)
    async with httpx.AsyncClient(base_url=client.base_url, timeout=30) as h:
        for raw, _ in BAD[:12]:  # HTTP-level garbage while the batch decodes
            assert (await h.post("/generate", content=raw)).status_code == 400
    # And one that gets past the HTTP checks (straight into the scheduler) and fails in its prefill:
    loop = asyncio.get_running_loop()
    failed = loop.create_future()
    server.scheduler.submit(GenRequest(rid="poison", input_ids=[1, VOCAB + 100], max_new_tokens=5,
                                       params=RowParams(1.0, 1.0, -1),
                                       on_done=lambda out: loop.call_soon_threadsafe(failed.set_result, out)))
    poisoned = await failed
    assert poisoned.error and "prefill" in poisoned.error
    together = await asyncio.gather(*running)
    await client.flush_cache()
    for p, batched in zip(prompts, together):  # each equals the same request run alone
        alone = await client.generate(p, greedy, session_id="solo")
        assert batched.finish_reason == "length" and batched.output_ids == alone.output_ids


async def test_non_finite_weights_are_refused_and_nothing_changes(engine):
    server, client = engine
    before = {n: t.clone() for n, t in server.model.state_dict().items()}
    await client.update_weight_version("4", abort_all_requests=False)
    bad = {"model.norm.weight": torch.ones(64), "lm_head.weight": before["lm_head.weight"].clone()}
    bad["lm_head.weight"][0, 0] = float("nan")
    await client.begin_weight_update()
    with pytest.raises(EngineError) as err:
        await client.update_weights_from_tensor([encode_safetensors_b64(bad)], load_format="safetensors_b64",
                                                weight_version="5")
    assert err.value.status == 400 and "non-finite" in err.value.body and "lm_head.weight" in err.value.body
    await client.end_weight_update()
    assert all(torch.equal(before[n], t) for n, t in server.model.state_dict().items())
    assert await client.weight_version() == 4


@pytest.mark.parametrize("payload,field", [
    ({"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1, "world_size": 2}, "master_port"),
    ({"master_address": "127.0.0.1", "master_port": 5000, "rank_offset": True, "world_size": 2}, "rank_offset"),
    ({"master_address": "127.0.0.1", "master_port": 5000, "rank_offset": 1, "world_size": 1}, "world_size"),
    ({"master_address": "127.0.0.1", "master_port": 5000, "rank_offset": 1}, "world_size is required"),
    ({"master_address": "127.0.0.1", "master_port": 5000, "rank_offset": 2, "world_size": 2, "backend": "gloo"},
     "rank_offset 2"),
    ({"master_address": "127.0.0.1", "master_port": 5000, "rank_offset": 1, "world_size": 2}, "backend 'nccl'"),
])
async def test_bad_weight_group_requests(engine, payload, field):
    _, client = engine
    async with httpx.AsyncClient(base_url=client.base_url, timeout=30) as h:
        r = await h.post("/init_weights_update_group", json=payload)
    assert r.status_code == 400 and r.json()["success"] is False and field in r.json()["message"], r.text


async def test_bad_distributed_update_bodies(engine):
    _, client = engine
    await client.begin_weight_update()
    async with httpx.AsyncClient(base_url=client.base_url, timeout=30) as h:
        for payload, field in (({"names": "w", "dtypes": ["float32"], "shapes": [[1]]}, "names"),
                               ({"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "flush_cache": "no"},
                                "flush_cache"),
                               ({"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": 3},
                                "weight_version"),
                               ({"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}, "init_weights_update_group")):
            r = await h.post("/update_weights_from_distributed", json=payload)
            assert r.status_code == 400 and field in r.json()["message"], (payload, r.text)
        r = await h.post("/update_weight_version", content=json.dumps({"new_version": None}))
        assert r.status_code == 400 and "new_version" in r.json()["message"]
    await client.end_weight_update()


async def test_rendezvous_with_a_dead_trainer_is_bounded(engine):
    server, client = engine  # weight_update_timeout_s=1
    t0 = time.perf_counter()
    call = asyncio.create_task(client.init_weights_update_group("127.0.0.1", free_port(), 1, 2, group_name="dead",
                                                                backend="gloo"))
    await asyncio.sleep(0.3)
    assert await client.health()  # the engine answers while the rendezvous waits
    with pytest.raises(EngineError) as err:
        await call
    elapsed = time.perf_counter() - t0
    assert err.value.status == 400 and "within 1 s" in err.value.body
    assert elapsed < 3.0, elapsed
    assert "dead" not in server.weights.groups
