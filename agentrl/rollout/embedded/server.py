"""SGLang 0.5.23's native HTTP API (the subset RL uses, same paths, bodies and answers) over the
scheduler.

aiohttp on one event loop; every handler only validates, enqueues and awaits. The model lives on
the scheduler thread. What 0.5.23 does and this engine does the same way:
- /generate answers `meta_info.weight_versions`, the spans [{version, start, end}] of output
  tokens each weight version produced, and `meta_info.weight_version` (the last span's);
- /health is a liveness check (SGLang's with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0);
  /health_generate runs a one-token request, or sees generation already running, within
  HEALTH_GENERATE_TIMEOUT_S;
- /pause_generation {mode: abort (default) | retract | in_place}, /continue_generation;
- /flush_cache is 400 unless idle (paused engines may hold waiting requests: they keep no KV);
- weights: see weight_api.py. There is no /get_weight_version (0.5.23 has none): /model_info
  carries the current weight_version.
Extensions, all additive: `internal_states[0]` batching counters in /server_info; request
validation stricter than SGLang's (validation.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from aiohttp import web

from agentrl.rollout.embedded.http_util import BadRequest, error, field, json_body
from agentrl.rollout.embedded.openai_api import OpenAIChatAPI
from agentrl.rollout.embedded.request import GenOutput, GenRequest
from agentrl.rollout.embedded.sampling import RowParams
from agentrl.rollout.embedded.scheduler import PAUSE_MODES, Busy, Scheduler
from agentrl.rollout.embedded.validation import parse_generate
from agentrl.rollout.embedded.weight_api import WeightAPI

log = logging.getLogger(__name__)
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT default
HEALTH_RID_PREFIX = "HEALTH_CHECK"
SHUTDOWN_TIMEOUT_S = 1.0  # open requests get this long on stop(); a blocked rendezvous is not waited for


def version_spans(versions: list[str], current: str) -> list[dict]:
    """[{version, start, end}] runs of equal versions over the output tokens, as SGLang 0.5.23
    reports them; no output: one empty span of the current version."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans or [{"version": current, "start": 0, "end": 0}]


class EmbeddedEngineServer:
    """Owns the scheduler and the aiohttp app. `await start()` -> base URL; `await stop()`."""

    def __init__(self, model, tokenizer=None, *, model_path: str = "", max_batch_size: int = 32,
                 prefix_cache_tokens: int = 262144, prefill_chunk_tokens: int = 1024, seed: int = 0,
                 weight_version: str = "0", weight_update_timeout_s: float = 120.0,
                 join_threads_on_stop: bool = True, static_decode_len: int = 0, admit_wait_steps: int = 0) -> None:
        """join_threads_on_stop: stop() waits (bounded) for rendezvous threads still running, which an
        in-process server needs (a thread left in torch's store client aborts the interpreter at
        exit); a process that leaves with os._exit (agentrl engine serve) passes False."""
        eos = model.config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        decode = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else None
        self.model, self.tokenizer, self.model_path = model, tokenizer, model_path
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.scheduler = Scheduler(model, max_batch_size=max_batch_size, prefix_cache_tokens=prefix_cache_tokens,
                                   prefill_chunk_tokens=prefill_chunk_tokens, eos_token_ids=eos_ids, decode=decode,
                                   seed=seed, weight_version=weight_version, static_decode_len=static_decode_len,
                                   admit_wait_steps=admit_wait_steps)
        self.weights = WeightAPI(self, weight_update_timeout_s)
        self._join_threads = join_threads_on_stop
        self._inflight: set[str] = set()
        self._runner: web.AppRunner | None = None
        self.base_url: str | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 33)  # weight payloads can be large
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/ready", self.ready)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        self.weights.add_routes(r)
        OpenAIChatAPI(self, version_spans).add_routes(r)  # /v1/chat/completions, /v1/models (openai_api.py)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app) -> None:
        if not self.scheduler.alive:
            self.scheduler.start()

    async def _on_cleanup(self, _app) -> None:
        await asyncio.to_thread(self.scheduler.stop)
        await asyncio.to_thread(self.weights.close, self._join_threads)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0][1]
        self.base_url = f"http://{host}:{bound}"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def run_on_scheduler(self, fn):
        """fn() on the scheduler thread between steps (no forward in flight)."""
        return await asyncio.wrap_future(self.scheduler.call(fn))

    # ---- generation ------------------------------------------------------------------------
    async def _submit(self, reqs: list[GenRequest]) -> list[GenOutput]:
        loop = asyncio.get_running_loop()
        futures = []
        for req in reqs:
            fut = loop.create_future()
            req.on_done = _resolver(loop, fut)
            futures.append(fut)
        self._inflight.update(r.rid for r in reqs)
        try:
            for req in reqs:
                self.scheduler.submit(req)
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:  # the client went away (or a probe timed out): stop the work
            for req in reqs:
                self.scheduler.abort(req.rid)
            raise
        finally:
            self._inflight.difference_update(r.rid for r in reqs)

    async def generate(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        if not self.scheduler.alive:
            return error(503, "the engine's scheduler thread is not running")
        try:
            body = await json_body(request)
            parsed = parse_generate(body, vocab=self.vocab_size, context_len=self.scheduler.context_len,
                                    encode=self.tokenizer.encode if self.tokenizer is not None else None,
                                    busy_rids=self._inflight)
        except BadRequest as exc:
            return error(400, str(exc))
        try:
            outs = await self._submit(parsed.requests)
        except RuntimeError as exc:  # the scheduler is shutting down
            return error(503, str(exc))
        errors = [o.error for o in outs if o.error]
        if errors:
            return error(500, errors[0])
        payload = [self._render(o, r, parsed.return_logprob, time.perf_counter() - t0)
                   for o, r in zip(outs, parsed.requests)]
        return web.json_response(payload if parsed.batched else payload[0])

    def _render(self, o: GenOutput, req: GenRequest, want_lp: bool, latency: float) -> dict:
        spans = version_spans(o.weight_versions, o.weight_version)
        meta = {
            "id": o.rid, "finish_reason": o.finish_reason, "prompt_tokens": o.prompt_tokens,
            "completion_tokens": len(o.output_ids), "cached_tokens": o.cached_tokens,
            "weight_versions": spans, "weight_version": spans[-1]["version"], "e2e_latency": latency,
        }
        if want_lp:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(o.logprobs, o.output_ids)]
            if o.input_logprobs is not None:
                prompt = req.input_ids[req.logprob_start_len:]
                meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(o.input_logprobs, prompt)]
        text = self.tokenizer.decode(o.output_ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": o.output_ids, "meta_info": meta}

    # ---- health and info ---------------------------------------------------------------------
    async def health(self, _request) -> web.Response:
        return web.Response(status=200) if self.scheduler.alive else error(503, "scheduler thread is not running")

    async def health_generate(self, _request) -> web.Response:
        """200 once the engine generates: a one-token probe finishes, or tokens of running requests
        appear; 503 after HEALTH_GENERATE_TIMEOUT_S (e.g. paused all along, as in SGLang)."""
        if not self.scheduler.alive:
            return error(503, "scheduler thread is not running")
        before = self.scheduler.stats()["generated_tokens"]
        probe = GenRequest(rid=f"{HEALTH_RID_PREFIX}_{uuid.uuid4().hex}", input_ids=[0], max_new_tokens=1,
                           params=RowParams(0.0, 1.0, -1), on_done=None)
        task = asyncio.create_task(self._submit([probe]))
        deadline = time.monotonic() + HEALTH_GENERATE_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if task.done():
                    out = task.result()[0]
                    return web.Response(status=200) if not out.error and out.output_ids else error(503, "probe failed")
                if self.scheduler.stats()["generated_tokens"] > before:
                    return web.Response(status=200)
                await asyncio.sleep(0.01)
            return error(503, f"no token generated within {HEALTH_GENERATE_TIMEOUT_S:g} s")
        except RuntimeError as exc:
            return error(503, str(exc))
        finally:
            task.cancel()

    async def ready(self, _request) -> web.Response:
        return web.Response(status=200 if self.scheduler.alive else 503)

    async def server_info(self, _request) -> web.Response:
        import torch
        import transformers

        st = self.scheduler.stats()
        return web.json_response({
            "engine": "agentrl-embedded", "model_path": self.model_path, "device": str(self.scheduler.device),
            "max_running_requests": st["max_batch_size"], "weight_version": st["weight_version"],
            "internal_states": [st], "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
        })

    async def model_info(self, _request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "weight_version": self.scheduler.weight_version, "vocab_size": self.vocab_size,
            "model_type": getattr(self.model.config, "model_type", None),
            "architectures": list(getattr(self.model.config, "architectures", None) or [type(self.model).__name__]),
        })

    # ---- control -----------------------------------------------------------------------------
    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request, allow_empty=True)
            mode = field(body, "mode", str, "abort", check=lambda v: v in PAUSE_MODES, hint=f"one of {PAUSE_MODES}")
        except BadRequest as exc:
            return error(400, str(exc))
        counts = await self.run_on_scheduler(lambda: self.scheduler.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok", "mode": mode,
                                  **counts})

    async def continue_generation(self, _request) -> web.Response:
        await self.run_on_scheduler(self.scheduler.resume)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request, allow_empty=True)
            rid = field(body, "rid", str, "")
            abort_all = field(body, "abort_all", bool, False)
        except BadRequest as exc:
            return error(400, str(exc))
        if not abort_all and not rid:
            return error(400, "abort_request needs rid or abort_all=true")
        self.scheduler.abort(rid or None, abort_all)
        return web.Response(status=200)

    async def flush_cache(self, _request) -> web.Response:
        try:
            await self.run_on_scheduler(self.scheduler.flush_cache)
        except Busy as exc:
            return web.Response(status=400, text=str(exc))
        return web.Response(text="Cache flushed.\n")


def _resolver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future):
    def set_result(out: GenOutput) -> None:
        if not fut.done():
            fut.set_result(out)
    return lambda out: loop.call_soon_threadsafe(set_result, out)
