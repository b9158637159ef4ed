"""The engine contract: what agentrl relies on from SGLang 0.5.23's HTTP API, checked against a live
engine URL. It runs against the embedded engine (in-process, a small random Llama) and, when
AGENTRL_SGLANG_URL points at a running SGLang server, against that server too:

    AGENTRL_SGLANG_URL=http://127.0.0.1:30000 AGENTRL_SGLANG_MODEL_PATH=/path/to/its/hf/folder \\
        python -m pytest tests/test_engine_contract.py -q -p no:cacheprovider

(AGENTRL_SGLANG_MODEL_PATH gives the names, shapes and values of weights to send back; the
update-group rendezvous uses AGENTRL_SGLANG_GROUP_BACKEND, default gloo.) Facts from 0.5.23's
io_struct.py, http_server.py, the scheduler's weight updater and utils/weight_versions.py:
updates only inside /begin_weight_update ... /end_weight_update; per-token versions as
meta_info.weight_versions spans; no /get_weight_version (/model_info has the version); a
flattened bucket is one uint8 buffer of several dtypes with itemsize-aligned offsets; pause
modes abort / retract / in_place; /flush_cache is 400 unless idle; /health and /health_generate.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from agentrl.cluster.engine_process import free_port
from agentrl.rollout.client import EngineClient, EngineError, parse_generate_response
from tests.weight_sender import start_sender

SGLANG_URL = os.environ.get("AGENTRL_SGLANG_URL")
PROMPT = [11, 22, 33, 44, 55, 66, 77]  # ids valid in any vocabulary
LONG = 4000 if SGLANG_URL else 1500  # tokens of a request that is still running when the test acts


@dataclass
class Live:
    url: str
    client: EngineClient
    server: object | None  # the embedded engine's EmbeddedEngineServer; None for SGLang
    weights: dict[str, torch.Tensor]  # a few of the served model's tensors (names, shapes, values)
    backend: str  # of the weight-update group

    def require_embedded(self):
        if self.server is None:
            pytest.skip("needs the embedded engine (the check sends tensors through local files)")
        return self.server

    async def wait_tokens(self, tokens: int = 5) -> None:
        """Until `tokens` more tokens have been generated from now (SGLang: a fixed wait)."""
        if self.server is None:
            await asyncio.sleep(1.0)
            return
        start = self.server.scheduler.stats()["generated_tokens"]
        for _ in range(4000):
            if self.server.scheduler.stats()["generated_tokens"] >= start + tokens:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"the engine did not generate {tokens} tokens")


def _sglang_weights(folder: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    out = {}
    with safe_open(str(files[0]), "pt") as f:
        for name in sorted(f.keys()):
            if name.endswith("norm.weight") and len(out) < 3:
                out[name] = f.get_tensor(name)
    return out


@pytest.fixture
async def live():
    if SGLANG_URL:
        client = EngineClient(SGLANG_URL, timeout_s=300)
        weights = _sglang_weights(os.environ["AGENTRL_SGLANG_MODEL_PATH"])
        yield Live(SGLANG_URL, client, None, weights, os.environ.get("AGENTRL_SGLANG_GROUP_BACKEND", "gloo"))
        await client.aclose()
        return
    from agentrl.rollout.embedded.server import EmbeddedEngineServer
    from tests.engine_models import llama_model

    model = llama_model()
    server = EmbeddedEngineServer(model, model_path="contract-llama", max_batch_size=8, weight_update_timeout_s=30)
    url = await server.start()
    names = ["model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"]
    state = model.state_dict()
    client = EngineClient(url, timeout_s=60)
    yield Live(url, client, server, {n: state[n].clone() for n in names}, "gloo")
    await client.aclose()
    await server.stop()


def _long(rid: str | None = None, n: int = LONG) -> dict:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": -1, "stream": False}
    return {**body, "rid": rid} if rid else body


async def _status(live: Live, method: str, path: str, json: dict | None = None) -> tuple[int, str]:
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as h:
        r = await h.request(method, path, json=json)
        return r.status_code, r.text


async def test_no_get_weight_version_and_model_info_has_it(live):
    assert (await _status(live, "GET", "/get_weight_version"))[0] == 404
    await live.client.update_weight_version("7", abort_all_requests=False)
    assert (await live.client.model_info())["weight_version"] == "7"
    assert await live.client.weight_version() == 7


async def test_updates_only_inside_a_session(live):
    code, text = await _status(live, "POST", "/update_weights_from_tensor",
                               {"serialized_named_tensors": ["MA=="], "load_format": None})
    assert code == 400 and "begin_weight_update" in text
    code, text = await _status(live, "POST", "/update_weights_from_distributed",
                               {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "none"})
    assert code == 400 and "begin_weight_update" in text
    code, text = await _status(live, "POST", "/end_weight_update", {})
    assert code == 400 and "no weight-update session" in text
    assert (await live.client.begin_weight_update())["success"] is True
    with pytest.raises(EngineError) as err:
        await live.client.begin_weight_update()
    assert err.value.status == 400 and "already open" in err.value.body
    assert (await live.client.end_weight_update())["success"] is True


async def test_weight_versions_spans_straddle_an_update(live):
    await live.client.update_weight_version("11", abort_all_requests=False)
    task = asyncio.create_task(live.client.generate_raw(_long("contract-spans")))
    await live.wait_tokens(10)
    await live.client.pause_generation("in_place")
    await live.client.update_weight_version("12", abort_all_requests=False)
    await live.client.continue_generation()
    await live.wait_tokens(5)
    await live.client.abort_request("contract-spans")  # an aborted request reports its spans too
    resp = await task
    meta = resp["meta_info"]
    spans, n = meta["weight_versions"], len(resp["output_ids"])
    assert [s["version"] for s in spans] == ["11", "12"] and meta["weight_version"] == "12"
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == n
    parsed = parse_generate_response(resp)
    assert parsed.weight_versions == [11] * spans[0]["end"] + [12] * (n - spans[0]["end"])
    empty = await live.client.generate_raw({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}})
    assert empty["meta_info"]["weight_versions"] == [{"version": "12", "start": 0, "end": 0}]


@pytest.mark.slow  # the trainer side runs in its own process (~10 s, mostly importing torch)
async def test_flattened_bucket_of_several_dtypes(live, tmp_path):
    names = list(live.weights)
    # fp32 first, then 2-byte dtypes: every byte offset is a multiple of its dtype's size.
    dtypes = ["float32", "bfloat16", "float16"][: len(names)]
    sent = {n: (live.weights[n] + (0.5 if live.server else 0.0)).to(getattr(torch, d)) for n, d in zip(names, dtypes)}
    port, group = free_port(), "contract_bucket"
    sender = start_sender(port, group, sent, backend=live.backend, workdir=tmp_path)
    try:
        await live.client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name=group, backend=live.backend)
        await live.client.begin_weight_update()
        await live.client.update_weights_from_distributed(names, dtypes, [list(t.shape) for t in sent.values()],
                                                          group_name=group, load_format="flattened_bucket",
                                                          weight_version="21")
        assert await asyncio.to_thread(sender.wait, 60) == 0
        # Unaligned: 3 bfloat16 (6 bytes) before a float32 is refused before anything is received.
        with pytest.raises(EngineError) as err:
            await live.client.update_weights_from_distributed(["a", "b"], ["bfloat16", "float32"], [[3], [1]],
                                                              group_name=group, load_format="flattened_bucket")
        assert err.value.status == 400 and "Unaligned" in err.value.body
        await live.client.end_weight_update()
    finally:
        sender.kill()
    await live.client.destroy_weights_update_group(group)
    assert await live.client.weight_version() == 21
    if live.server is not None:  # the values landed, cast to the parameter's dtype
        state = live.server.model.state_dict()
        for n, t in sent.items():
            assert torch.equal(state[n], t.float()), n


async def test_pause_abort_returns_partial_output(live):
    task = asyncio.create_task(live.client.generate_raw(_long("contract-abort")))
    await live.wait_tokens()
    await live.client.pause_generation("abort")
    resp = await task
    assert resp["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(resp["output_ids"]) < LONG
    await live.client.continue_generation()
    again = await live.client.generate_raw({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
    assert again["meta_info"]["finish_reason"]["type"] == "length"


async def test_flush_cache_only_when_idle(live):
    assert (await _status(live, "POST", "/flush_cache"))[0] == 200
    for mode, flush_ok in ((None, False), ("retract", True), ("in_place", False)):
        task = asyncio.create_task(live.client.generate_raw(_long(f"contract-flush-{mode}")))
        await live.wait_tokens(5)
        if mode:
            await live.client.pause_generation(mode)
        code, _ = await _status(live, "POST", "/flush_cache")
        assert code == (200 if flush_ok else 400), mode  # retract: the queued requests hold no KV
        if mode:
            await live.client.continue_generation()
        await live.wait_tokens(3)  # it generates on after the pause
        await live.client.abort_request(f"contract-flush-{mode}")
        assert (await task)["meta_info"]["finish_reason"]["type"] == "abort", mode


async def test_health_and_health_generate(live):
    for path in ("/health", "/health_generate", "/ready"):
        assert (await _status(live, "GET", path))[0] == 200, path
    assert await live.client.health() and await live.client.health_generate()


async def test_in_place_update_with_flush_says_the_cache_was_not_flushed(live):
    from agentrl.rollout.embedded.weights import encode_safetensors_b64

    live.require_embedded()
    task = asyncio.create_task(live.client.generate_raw(_long("contract-in-place")))
    await live.wait_tokens(5)
    await live.client.pause_generation("in_place")
    await live.client.begin_weight_update()
    blob = encode_safetensors_b64({n: t * 2 for n, t in live.weights.items()})
    with pytest.raises(EngineError) as err:
        await live.client.update_weights_from_tensor([blob], load_format="safetensors_b64", weight_version="31")
    assert err.value.status == 400 and "cache was not flushed" in err.value.body
    await live.client.update_weights_from_tensor([blob], load_format="safetensors_b64", flush_cache=False)
    await live.client.end_weight_update()
    await live.client.continue_generation()
    await live.client.abort_request("contract-in-place")
    await task
    assert await live.client.weight_version() == 31  # the weights and version did change, as in SGLang
