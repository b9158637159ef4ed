"""EngineClient: SGLang response mapping, request shape, typed errors, timeouts and cancellations that abort."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
import torch
from aiohttp import web

from agentrl.rollout.client import (
    EngineClient,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    expand_version_spans,
    parse_generate_response,
    parse_version,
)
from agentrl.rollout.router import Router
from agentrl.rollout.types import Generator, SamplingParams

# A /generate response as SGLang 0.5.23 returns it (return_logprob=true, logprob_start_len=-1).
SGLANG_RESPONSE = {
    "text": " hi",
    "output_ids": [17, 4, 2],
    "meta_info": {
        "id": "r1", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 5, "completion_tokens": 3,
        "cached_tokens": 4, "weight_version": "3",
        # 0.5.23 (utils/weight_versions.add_weight_versions_to_meta_info): the spans of output tokens
        # each version produced; here an update to version 3 landed after the first token.
        "weight_versions": [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}],
        "output_token_logprobs": [[-0.5, 17, None], [-1.25, 4, None], [-0.1, 2, None]],
    },
}


def test_parse_sglang_response():
    r = parse_generate_response(SGLANG_RESPONSE)
    assert r.output_ids == [17, 4, 2] and r.logprobs == [-0.5, -1.25, -0.1]
    assert r.weight_versions == [2, 3, 3] and r.finish_reason == "stop"
    assert (r.prompt_tokens, r.cached_tokens, r.rid) == (5, 4, "r1")
    old = {**SGLANG_RESPONSE, "meta_info": {k: v for k, v in SGLANG_RESPONSE["meta_info"].items()
                                            if k != "weight_versions"}}
    assert parse_generate_response(old).weight_versions == [3, 3, 3]  # no spans: one version per response


def test_version_spans_expand_or_are_refused():
    assert expand_version_spans([{"version": "default", "start": 0, "end": 0}], 0) == []
    assert expand_version_spans([["1", 0, 2], ["4", 2, 3]], 3) == ["1", "1", "4"]  # the array form
    for bad in ([{"version": "1", "start": 0, "end": 2}],  # covers 2 of 3 tokens
                [{"version": "1", "start": 1, "end": 3}],  # does not start at 0
                [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 1, "end": 3}],  # overlap
                [], "1", [{"version": "1"}]):
        with pytest.raises(ValueError, match="span"):
            expand_version_spans(bad, 3)


def test_parse_rejects_inconsistent_responses():
    bad = {**SGLANG_RESPONSE, "output_ids": [17, 4, 9]}
    with pytest.raises(ValueError, match="differ"):
        parse_generate_response(bad)
    odd = {"output_ids": [], "meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "weird"}}}
    with pytest.raises(ValueError, match="finish_reason"):
        parse_generate_response(odd)
    with pytest.raises(ValueError, match="output_token_logprobs"):
        parse_generate_response({"output_ids": [1], "meta_info": {}})


def test_parse_version():
    assert parse_version("default") == 0 and parse_version("12") == 12 and parse_version(None) == 0
    with pytest.raises(ValueError, match="update_weight_version"):
        parse_version("v1.2")


def test_client_and_router_are_generators():
    assert isinstance(EngineClient("http://127.0.0.1:1"), Generator)
    assert isinstance(Router(["http://127.0.0.1:1"]), Generator)
    with pytest.raises(ValueError):
        EngineClient("http://x", timeout_s=0)


@pytest.fixture
async def fake_sglang():
    """A stand-in for an SGLang server (which cannot run on this machine) that records requests."""
    seen = []

    async def generate(request):
        seen.append((dict(request.headers), await request.json()))
        if seen[-1][1]["input_ids"] == [666]:
            return web.json_response({"error": {"message": "bad input"}}, status=400)
        return web.json_response(SGLANG_RESPONSE)

    async def update(request):
        return web.json_response({"success": False, "message": "shape mismatch"}, status=200)

    async with serve_posts({"/generate": generate, "/update_weights_from_tensor": update}) as url:
        yield url, seen


@contextlib.asynccontextmanager
async def serve_posts(handlers: dict):
    """An aiohttp app on a free local port answering POSTs at these paths; yields its URL."""
    app = web.Application()
    for path, handler in handlers.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_generate_request_shape_and_errors(fake_sglang):
    url, seen = fake_sglang
    async with EngineClient(url, timeout_s=10) as client:
        r = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=7, temperature=0.5, stop_token_ids=[2]),
                                  session_id="ep-9", rid="r1")
        assert r.output_ids == [17, 4, 2]
        headers, body = seen[0]
        assert headers["X-Session-Id"] == "ep-9"
        assert body == {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": -1, "rid": "r1",
                        "stream": False, "sampling_params": {"max_new_tokens": 7, "temperature": 0.5, "top_p": 1.0,
                                                             "stop_token_ids": [2]}}
        with pytest.raises(EngineError) as err:
            await client.generate([666], SamplingParams(), session_id="s")
        assert err.value.status == 400 and "bad input" in err.value.body and "/generate" in str(err.value)
        with pytest.raises(EngineError, match="shape mismatch"):  # success=false is an error too
            await client.update_weights_from_tensor(["x"], load_format="safetensors_b64")


async def test_refused_connection_is_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with EngineClient(f"http://127.0.0.1:{port}", timeout_s=5) as client:
        with pytest.raises(EngineUnavailable):
            await client.generate([1], SamplingParams(), session_id="s")
        assert await client.health() is False


async def test_timeout_aborts_the_request_on_the_engine():
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.rollout.embedded.server import EmbeddedEngineServer

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=None)
    torch.manual_seed(0)
    server = EmbeddedEngineServer(LlamaForCausalLM._from_config(cfg).eval())
    url = await server.start()
    try:
        async with EngineClient(url, timeout_s=0.5) as client:
            await client.pause_generation("retract")  # nothing will run: the request must time out
            with pytest.raises(EngineTimeout):
                await client.generate([1, 2], SamplingParams(max_new_tokens=4), session_id="s", rid="slow")
            await client.continue_generation()
            for _ in range(200):
                if server.scheduler.stats()["requests_done"] == 1:
                    break
                await asyncio.sleep(0.01)
            st = server.scheduler.stats()
            assert st["requests_done"] == 1 and st["generated_tokens"] == 0  # aborted, never generated
            assert await client.health() and await client.ready()
    finally:
        await server.stop()


async def test_a_cancelled_generate_aborts_its_request_on_the_engine():
    # an episode of a cancelled group (agentrl/policy/stale_cancel.py): the engine would run on, since
    # neither engine stops a request when its client goes away
    aborted, started, stopped = [], asyncio.Event(), asyncio.Event()

    async def generate(request):
        started.set()
        await asyncio.wait_for(stopped.wait(), 30)
        return web.json_response({})

    async def abort(request):
        aborted.append((await request.json())["rid"])
        stopped.set()
        return web.json_response({"success": True})

    async with serve_posts({"/generate": generate, "/abort_request": abort}) as url:
        client = EngineClient(url, timeout_s=60)
        call = asyncio.ensure_future(client.generate([1, 2], SamplingParams(max_new_tokens=4), session_id="s", rid="r-1"))
        await asyncio.wait_for(started.wait(), 5)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await client.aclose()  # waits for the abort it sent
    assert aborted == ["r-1"]
