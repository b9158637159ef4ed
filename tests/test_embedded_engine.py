"""Numerics of an engine speaking SGLang's native API: logprobs against a teacher-forced forward,
batching, retract vs in_place updates, prefix reuse. (The API contract itself: test_engine_contract.py.)

By default it starts the embedded engine in-process around small random models (a GLM-MoE-DSA
and a Llama). With AGENTRL_SGLANG_URL set it runs the model-agnostic checks against that server
instead, using AGENTRL_SGLANG_MODEL_PATH (an HF folder of the served model) as the teacher-forcing
reference and AGENTRL_SGLANG_LOGPROB_ATOL as the tolerance (bf16 engines need ~1e-2);
engine-internal checks skip.
"""

from __future__ import annotations

import asyncio
import copy
import os
import uuid
from dataclasses import dataclass

import pytest
import torch

from agentrl.rollout.client import EngineClient, EngineError
from agentrl.rollout.types import SamplingParams
from tests.engine_models import VOCAB, glm_model, llama_model


@dataclass
class Engine:
    url: str
    client: EngineClient
    model: torch.nn.Module  # teacher-forcing reference (the served model itself when embedded)
    atol: float
    server: object | None  # EmbeddedEngineServer, None for an external SGLang

    def require_embedded(self):
        if self.server is None:
            pytest.skip("needs the embedded engine's internals")
        return self.server


@pytest.fixture(params=["glm", "llama"])
async def engine(request):
    url = os.environ.get("AGENTRL_SGLANG_URL")
    if url:
        from agentrl.models.policy import load_policy

        model, _ = load_policy(os.environ["AGENTRL_SGLANG_MODEL_PATH"])
        client = EngineClient(url, timeout_s=120)
        yield Engine(url, client, model, float(os.environ.get("AGENTRL_SGLANG_LOGPROB_ATOL", "1e-2")), None)
        await client.aclose()
        return
    from agentrl.rollout.embedded.server import EmbeddedEngineServer

    model = glm_model() if request.param == "glm" else llama_model()
    server = EmbeddedEngineServer(model, model_path=f"test-{request.param}", max_batch_size=16)
    url = await server.start()
    client = EngineClient(url, timeout_s=60)
    yield Engine(url, client, model, 1e-4, server)
    await client.aclose()
    await server.stop()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


@torch.no_grad()
def teacher_logprobs(model, ids: list[int], start: int, temperature: float) -> list[float]:
    """log_softmax(logits / T) of ids[start:] under a full forward of ids (fp32)."""
    logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    return [lp[p - 1, ids[p]].item() for p in range(start, len(ids))]


def max_err(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


async def wait_generated(engine: Engine, at_least: int, timeout_s: float = 20.0) -> None:
    srv = engine.require_embedded()
    for _ in range(int(timeout_s / 0.005)):
        if srv.scheduler.stats()["generated_tokens"] >= at_least:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"engine did not generate {at_least} tokens in {timeout_s}s")


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6, 0.0])
async def test_logprobs_equal_teacher_forced_forward(engine, temperature):
    p = prompt(11, 1)
    res = await engine.client.generate(p, SamplingParams(max_new_tokens=24, temperature=temperature),
                                       session_id="s")
    assert len(res.output_ids) == len(res.logprobs) == 24 and res.finish_reason == "length"
    ref = teacher_logprobs(engine.model, p + res.output_ids, len(p), temperature)
    assert max_err(res.logprobs, ref) < engine.atol
    if temperature == 0.0:  # greedy: every token is the argmax of the teacher-forced forward
        logits = engine.model(torch.tensor([p + res.output_ids])).logits[0]
        assert res.output_ids == logits[len(p) - 1 : -1].argmax(-1).tolist()


async def test_top_p_restricts_sampling_not_logprobs(engine):
    p = prompt(9, 2)
    res = await engine.client.generate(p, SamplingParams(max_new_tokens=16, temperature=1.3, top_p=0.5, top_k=20),
                                       session_id="s")
    ref = teacher_logprobs(engine.model, p + res.output_ids, len(p), 1.3)
    assert max_err(res.logprobs, ref) < engine.atol
    # Every sampled token lies inside the top-p nucleus of the scaled distribution.
    with torch.no_grad():
        lp = torch.log_softmax(engine.model(torch.tensor([p + res.output_ids])).logits[0].float() / 1.3, -1)
    for pos, tok in enumerate(res.output_ids):
        row = lp[len(p) - 1 + pos].exp()
        mass_before = row[row > row[tok]].sum().item()
        assert mass_before < 0.5 + 1e-5


async def test_concurrent_requests_batch_and_match_solo(engine):
    srv = engine.require_embedded()
    prompts = [prompt(5 + 3 * i, 10 + i) for i in range(8)]
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
    together = await asyncio.gather(*(engine.client.generate(p, greedy, session_id=f"c{i}")
                                      for i, p in enumerate(prompts)))
    assert srv.scheduler.stats()["max_decode_batch_size"] > 1
    await engine.client.flush_cache()  # solo runs must not reuse the batched runs' KV
    for p, batched in zip(prompts, together):
        solo = await engine.client.generate(p, greedy, session_id="solo")
        assert solo.output_ids == batched.output_ids
        assert max_err(solo.logprobs, batched.logprobs) < engine.atol


async def _update_mid_generation(engine: Engine, mode: str | None):
    from agentrl.rollout.embedded.weights import encode_safetensors_b64

    srv = engine.require_embedded()
    old_model = copy.deepcopy(engine.model)
    new_model = glm_model(seed=7) if "Glm" in type(engine.model).__name__ else llama_model(seed=7)
    p = prompt(13, 3)
    task = asyncio.create_task(engine.client.generate(p, SamplingParams(max_new_tokens=120, temperature=0.9),
                                                      session_id="u"))
    await wait_generated(engine, 15)
    if mode:
        await engine.client.pause_generation(mode)
    blob = encode_safetensors_b64(new_model.state_dict())
    await engine.client.begin_weight_update()
    # in_place keeps the running request's KV, so a flush would be refused (as SGLang refuses it).
    await engine.client.update_weights_from_tensor([blob], load_format="safetensors_b64", weight_version=1,
                                                   flush_cache=mode != "in_place")
    await engine.client.end_weight_update()
    if mode:
        await engine.client.continue_generation()
    res = await task
    assert srv.scheduler.stats()["weight_version"] == "1"
    n_old = res.weight_versions.count(0)
    assert 15 <= n_old < len(res.output_ids) and res.weight_versions == [0] * n_old + [1] * (len(res.output_ids) - n_old)
    ids = p + res.output_ids
    old_ref = teacher_logprobs(old_model, ids[: len(p) + n_old], len(p), 0.9)
    new_ref = teacher_logprobs(new_model, ids, len(p) + n_old, 0.9)
    return max_err(res.logprobs[:n_old], old_ref), max_err(res.logprobs[n_old:], new_ref)


@pytest.mark.parametrize("mode", ["retract", None])
async def test_retract_update_never_uses_pre_update_kv(engine, mode):
    # None: an update that arrives without a pause retracts running requests too.
    err_old, err_new = await _update_mid_generation(engine, mode)
    assert err_old < engine.atol  # tokens before the update: old weights
    assert err_new < engine.atol  # tokens after: the whole sequence recomputed under new weights


async def test_in_place_update_keeps_old_kv(engine):
    # The counter-check: in_place keeps pre-update KV, so post-update tokens do NOT match a forward
    # under the new weights. This shows the retract test above can fail.
    err_old, err_new = await _update_mid_generation(engine, "in_place")
    assert err_old < engine.atol
    assert err_new > 1e-3


async def test_abort_returns_partial_output(engine):
    rid = uuid.uuid4().hex
    task = asyncio.create_task(engine.client.generate(prompt(7, 4), SamplingParams(max_new_tokens=5000),
                                                      session_id="a", rid=rid))
    await wait_generated(engine, 5)
    await engine.client.abort_request(rid)
    res = await task
    assert res.finish_reason == "abort" and res.rid == rid
    assert 0 < len(res.output_ids) < 5000 and len(res.logprobs) == len(res.output_ids)


async def test_pause_abort_ends_running_requests(engine):
    task = asyncio.create_task(engine.client.generate(prompt(7, 5), SamplingParams(max_new_tokens=5000),
                                                      session_id="a"))
    await wait_generated(engine, 5)
    await engine.client.pause_generation("abort")
    res = await task
    assert res.finish_reason == "abort" and len(res.output_ids) > 0
    await engine.client.continue_generation()
    again = await engine.client.generate(prompt(7, 5), SamplingParams(max_new_tokens=3), session_id="a")
    assert again.finish_reason == "length"


async def test_second_turn_reuses_session_kv(engine):
    p = prompt(20, 6)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0)
    first = await engine.client.generate(p, sp, session_id="t")
    turn2 = p + first.output_ids + prompt(6, 7)
    second = await engine.client.generate(turn2, sp, session_id="t")
    assert second.cached_tokens > 0
    if engine.server is not None:  # the KV of prompt + output (minus the unfed last token)
        assert second.cached_tokens == len(p) + len(first.output_ids) - 1
    ref = teacher_logprobs(engine.model, turn2 + second.output_ids, len(turn2), 1.0)
    assert max_err(second.logprobs, ref) < engine.atol


async def test_stop_token_ids_end_generation(engine):
    p = prompt(9, 8)
    free = await engine.client.generate(p, SamplingParams(max_new_tokens=10, temperature=0.0), session_id="x")
    stop_at = free.output_ids[3]
    first_hit = free.output_ids.index(stop_at)
    res = await engine.client.generate(p, SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_at]),
                                       session_id="x")
    assert res.finish_reason == "stop" and res.output_ids == free.output_ids[: first_hit + 1]


async def test_input_logprobs_and_info_endpoints(engine):
    srv = engine.require_embedded()
    p = prompt(10, 9)
    raw = await engine.client.generate_raw({"input_ids": p, "sampling_params": {"max_new_tokens": 0},
                                            "return_logprob": True, "logprob_start_len": 0})
    got = [x[0] for x in raw["meta_info"]["input_token_logprobs"]]
    assert got[0] is None and max_err(got[1:], teacher_logprobs(engine.model, p, 1, 1.0)) < engine.atol
    assert raw["meta_info"]["finish_reason"]["type"] == "length" and raw["output_ids"] == []
    info = await engine.client.server_info()
    assert info["internal_states"][0]["max_batch_size"] == srv.scheduler.max_batch_size
    assert (await engine.client.model_info())["weight_version"] == "0"
    await engine.client.update_weight_version(5)
    assert await engine.client.weight_version() == 5
    res = await engine.client.generate(p, SamplingParams(max_new_tokens=2), session_id="v")
    assert res.weight_versions == [5, 5]


async def test_bad_requests_are_rejected_with_reasons(engine):
    engine.require_embedded()
    with pytest.raises(EngineError) as err:
        await engine.client.generate([VOCAB + 5], SamplingParams(max_new_tokens=2), session_id="b")
    assert err.value.status == 400 and "input_ids" in err.value.body
    with pytest.raises(EngineError) as err:
        await engine.client.generate_raw({"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.2}})
    assert err.value.status == 400 and "repetition_penalty" in err.value.body
    await engine.client.begin_weight_update()
    with pytest.raises(EngineError) as err:
        await engine.client.update_weights_from_tensor(["x"], load_format="safetensors_b64")
    assert err.value.status == 400 and "base64" in err.value.body
    with pytest.raises(EngineError) as err:  # an unknown weight name changes nothing
        from agentrl.rollout.embedded.weights import encode_safetensors_b64

        blob = encode_safetensors_b64({"no.such.weight": torch.zeros(2)})
        await engine.client.update_weights_from_tensor([blob], load_format="safetensors_b64")
    assert "no.such.weight" in err.value.body
    await engine.client.end_weight_update()


async def test_flush_cache_refuses_while_running(engine):
    engine.require_embedded()
    task = asyncio.create_task(engine.client.generate(prompt(5, 11), SamplingParams(max_new_tokens=5000),
                                                      session_id="f"))
    await wait_generated(engine, 3)
    with pytest.raises(EngineError) as err:
        await engine.client.flush_cache()
    assert err.value.status == 400
    await engine.client.abort_request(abort_all=True)
    assert (await task).finish_reason == "abort"
    await engine.client.flush_cache()


@pytest.mark.slow  # the trainer side runs in its own process (~10 s, mostly importing torch)
async def test_weights_from_distributed_gloo_group(engine):
    from agentrl.cluster.engine_process import free_port
    from tests.weight_sender import start_sender

    engine.require_embedded()
    new = llama_model(seed=3) if "Llama" in type(engine.model).__name__ else glm_model(seed=3)
    named = {n: t for n, t in new.state_dict().items() if t.dtype == torch.float32}
    port = free_port()
    trainer = start_sender(port, "wg", named)  # the trainer's rendezvous and broadcast, in its own process
    try:
        await engine.client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="wg", backend="gloo")
        await engine.client.begin_weight_update()
        await engine.client.update_weights_from_distributed(
            list(named), ["float32"] * len(named), [list(t.shape) for t in named.values()], group_name="wg",
            weight_version=2, load_format="flattened_bucket")
        await engine.client.end_weight_update()
        assert await asyncio.to_thread(trainer.wait, 60) == 0
    finally:
        trainer.kill()
    await engine.client.destroy_weights_update_group("wg")
    for name, t in named.items():
        assert torch.equal(engine.model.state_dict()[name], t), name
    assert await engine.client.weight_version() == 2


def test_sampler_draws_from_the_filtered_distribution():
    from agentrl.rollout.embedded.sampling import RowParams, sample_rows

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20000, 1)
    gen = torch.Generator().manual_seed(0)
    plain, lps = sample_rows(logits, [RowParams(1.0, 1.0, -1)] * 20000, gen)
    freq = torch.bincount(torch.tensor(plain), minlength=4) / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015)
    assert abs(lps[0] - torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[plain[0]].item()) < 1e-6
    nucleus, lps = sample_rows(logits[:1500], [RowParams(1.0, 0.7, -1)] * 1500, gen)  # keeps {0, 1}
    freq = torch.bincount(torch.tensor(nucleus), minlength=4) / 1500
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.625) < 0.05
    ln = torch.log(torch.tensor([0.5, 0.3])).tolist()
    assert all(min(abs(lp - ln[0]), abs(lp - ln[1])) < 1e-6 for lp in lps)  # full-vocab logprobs
    top1, _ = sample_rows(logits[:100], [RowParams(2.0, 1.0, 1)] * 100, gen)
    assert set(top1) == {0}


async def test_chunked_prefill_equals_teacher_forcing():
    from agentrl.rollout.embedded.server import EmbeddedEngineServer

    model = glm_model()
    server = EmbeddedEngineServer(model, prefill_chunk_tokens=4)  # 23-token prompt: 6 chunks
    url = await server.start()
    try:
        async with EngineClient(url, timeout_s=60) as client:
            p = prompt(23, 12)
            raw = await client.generate_raw({"input_ids": p, "sampling_params": {"max_new_tokens": 8},
                                             "return_logprob": True, "logprob_start_len": 3})
            ids = p + raw["output_ids"]
            got_in = [x[0] for x in raw["meta_info"]["input_token_logprobs"]]
            got_out = [x[0] for x in raw["meta_info"]["output_token_logprobs"]]
            assert max_err(got_in + got_out, teacher_logprobs(model, ids, 3, 1.0)) < 1e-4
    finally:
        await server.stop()


async def test_generation_stops_at_the_context_length():
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.rollout.embedded.server import EmbeddedEngineServer

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, eos_token_id=None)
    server = EmbeddedEngineServer(LlamaForCausalLM._from_config(cfg).eval())
    url = await server.start()
    try:
        async with EngineClient(url, timeout_s=60) as client:
            res = await client.generate(prompt(29, 13), SamplingParams(max_new_tokens=10), session_id="c")
            assert res.finish_reason == "length" and len(res.output_ids) == 3
            with pytest.raises(EngineError, match="context length 32"):
                await client.generate(prompt(40, 13), SamplingParams(max_new_tokens=1), session_id="c")
    finally:
        await server.stop()


async def test_sliding_window_layers_match_teacher_forcing_in_prefill_decode_and_batches():
    from agentrl.rollout.embedded.server import EmbeddedEngineServer
    from tests.engine_models import gemma3_model

    model = gemma3_model()
    server = EmbeddedEngineServer(model, prefill_chunk_tokens=4, max_batch_size=8)  # chunks cross the window
    url = await server.start()
    try:
        async with EngineClient(url, timeout_s=60) as client:
            prompts = [prompt(n, 20 + n) for n in (3, 11, 17)]  # rows padded differently in one decode batch
            outs = await asyncio.gather(*(client.generate_raw(
                {"input_ids": p, "sampling_params": {"max_new_tokens": 12, "temperature": 1.0},
                 "return_logprob": True, "logprob_start_len": 1}) for p in prompts))
            for p, raw in zip(prompts, outs):
                ids = p + raw["output_ids"]
                got = [x[0] for x in raw["meta_info"]["input_token_logprobs"]]
                got += [x[0] for x in raw["meta_info"]["output_token_logprobs"]]
                assert max_err(got, teacher_logprobs(model, ids, 1, 1.0)) < 1e-4
    finally:
        await server.stop()
