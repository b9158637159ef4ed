"""SGLang's native HTTP API (the subset RL uses, same paths and JSON shapes) over the scheduler.

aiohttp on one event loop; every handler only validates, enqueues and awaits. The model lives on
the scheduler thread. Extensions over SGLang, all additive: `meta_info.output_token_weight_versions`
(the version that produced each token) and `internal_states[0]` batching counters in /server_info.
Weight formats of /update_weights_from_tensor: see `weights.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from aiohttp import web

from agentrl.rollout.embedded import weights as wlib
from agentrl.rollout.embedded.request import GenOutput, GenRequest
from agentrl.rollout.embedded.sampling import RowParams
from agentrl.rollout.embedded.scheduler import PAUSE_MODES, Busy, Scheduler

log = logging.getLogger(__name__)

# Sampling params that would change the distribution the logprobs describe: only their neutral value.
_NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
_ACCEPTED = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "n", "ignore_eos",
             "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", *_NEUTRAL}


class BadRequest(ValueError):
    pass


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class EmbeddedEngineServer:
    """Owns the scheduler and the aiohttp app. `await start()` -> base URL; `await stop()`."""

    def __init__(self, model, tokenizer=None, *, model_path: str = "", max_batch_size: int = 32,
                 prefix_cache_tokens: int = 262144, prefill_chunk_tokens: int = 1024, seed: int = 0,
                 weight_version: str = "0") -> None:
        eos = model.config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        decode = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else None
        self.model, self.tokenizer, self.model_path = model, tokenizer, model_path
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.scheduler = Scheduler(model, max_batch_size=max_batch_size, prefix_cache_tokens=prefix_cache_tokens,
                                   prefill_chunk_tokens=prefill_chunk_tokens, eos_token_ids=eos_ids, decode=decode, seed=seed, weight_version=weight_version)
        self._groups: dict[str, wlib.WeightUpdateGroup] = {}
        self._inflight: set[str] = set()
        self._runner: web.AppRunner | None = None
        self.base_url: str | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 33)  # weight payloads can be large
        r = app.router
        r.add_post("/generate", self.generate)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/ready", self.ready)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/update_weight_version", self.update_weight_version)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app) -> None:
        if not self.scheduler.alive:
            self.scheduler.start()

    async def _on_cleanup(self, _app) -> None:
        await asyncio.to_thread(self.scheduler.stop)
        self._groups.clear()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None)
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

    async def _run(self, fn):
        return await asyncio.wrap_future(self.scheduler.call(fn))

    # ---- generation ------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        if not self.scheduler.alive:
            return _error(503, "the engine's scheduler thread is not running")
        try:
            body = await _json(request)
            reqs = self._parse_generate(body)
        except BadRequest as exc:
            return _error(400, str(exc))
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
            outs: list[GenOutput] = await asyncio.gather(*futures)
        except asyncio.CancelledError:  # the client went away: stop spending compute on it
            for req in reqs:
                self.scheduler.abort(req.rid)
            raise
        finally:
            self._inflight.difference_update(r.rid for r in reqs)
        errors = [o.error for o in outs if o.error]
        if errors:
            return _error(500, errors[0])
        want_lp = bool(body.get("return_logprob", False))
        payload = [self._render(o, r, want_lp, time.perf_counter() - t0) for o, r in zip(outs, reqs)]
        return web.json_response(payload if len(payload) > 1 or body.get("_batched") else payload[0])

    def _parse_generate(self, body: dict) -> list[GenRequest]:
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the embedded engine; use stream=false")
        ids = body.get("input_ids")
        if ids is None and body.get("text") is not None:
            if self.tokenizer is None:
                raise BadRequest("text input needs a tokenizer; this engine has none: send input_ids")
            texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
            ids = [self.tokenizer.encode(t) for t in texts]
            body["_batched"] = isinstance(body["text"], list)
        elif ids is None:
            raise BadRequest("input_ids is required (a list of token ids, or a list of such lists)")
        else:
            body["_batched"] = bool(ids) and isinstance(ids[0], list)
            ids = ids if body["_batched"] else [ids]
        for seq in ids:
            if not seq or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in seq):
                raise BadRequest(f"input_ids must be non-empty lists of ints in [0, {self.vocab_size})")
            if len(seq) >= self.scheduler.context_len:
                raise BadRequest(f"prompt of {len(seq)} tokens does not fit the context length "
                                 f"{self.scheduler.context_len}; shorten it")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object")
        unknown = set(sp) - _ACCEPTED
        if unknown:
            raise BadRequest(f"sampling_params {sorted(unknown)} are not supported by the embedded engine")
        for key, neutral in _NEUTRAL.items():
            if sp.get(key, neutral) != neutral:
                raise BadRequest(f"sampling_params.{key}={sp[key]} is not supported (only {neutral})")
        max_new = _int(sp, "max_new_tokens", 128, lo=0)
        temperature = _num(sp, "temperature", 1.0, lo=0.0)
        top_p = _num(sp, "top_p", 1.0, lo=1e-9, hi=1.0)
        top_k = _int(sp, "top_k", -1, lo=None)
        n = _int(sp, "n", 1, lo=1)
        stop = sp.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        if stop and self.tokenizer is None:
            raise BadRequest("sampling_params.stop (strings) needs a tokenizer; use stop_token_ids")
        stop_ids = sp.get("stop_token_ids") or []
        if not all(isinstance(t, int) for t in stop_ids):
            raise BadRequest("sampling_params.stop_token_ids must be a list of ints")
        start = body.get("logprob_start_len", -1)
        if not isinstance(start, int) or start < -1:
            raise BadRequest("logprob_start_len must be an int >= -1")
        if not body.get("return_logprob", False):
            start = -1
        rids = body.get("rid")
        count = len(ids) * n
        if rids is None:
            rids = [uuid.uuid4().hex for _ in range(count)]
        elif isinstance(rids, str):
            rids = [rids] if count == 1 else [f"{rids}-{i}" for i in range(count)]
        if len(rids) != count or len(set(rids)) != count or not all(isinstance(r, str) for r in rids):
            raise BadRequest(f"rid must be one string or a list of {count} distinct strings")
        busy = self._inflight.intersection(rids)
        if busy:
            raise BadRequest(f"rid {min(busy)!r} is already running")
        if n > 1:
            body["_batched"] = True
        params = RowParams(temperature, top_p, top_k)
        return [
            GenRequest(rid=rid, input_ids=list(seq), max_new_tokens=max_new, params=params, on_done=None,
                       stop_token_ids=frozenset(stop_ids), stop_strings=tuple(stop),
                       ignore_eos=bool(sp.get("ignore_eos", False)),
                       logprob_start_len=min(start, len(seq) - 1) if start >= 0 else -1)
            for rid, seq in zip(rids, [s for s in ids for _ in range(n)])
        ]

    def _render(self, o: GenOutput, req: GenRequest, want_lp: bool, latency: float) -> dict:
        meta = {
            "id": o.rid, "finish_reason": o.finish_reason, "prompt_tokens": o.prompt_tokens,
            "completion_tokens": len(o.output_ids), "cached_tokens": o.cached_tokens,
            "weight_version": o.weight_version, "output_token_weight_versions": o.weight_versions,
            "e2e_latency": latency,
        }
        if want_lp:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(o.logprobs, o.output_ids)]
            if o.input_logprobs is not None:
                prompt = req.input_ids[req.logprob_start_len:]
                meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(o.input_logprobs, prompt)]
        text = self.tokenizer.decode(o.output_ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": o.output_ids, "meta_info": meta}

    # ---- control -----------------------------------------------------------------------------
    async def health(self, _request) -> web.Response:
        return web.Response(status=200) if self.scheduler.alive else _error(503, "scheduler thread is not running")

    async def ready(self, _request) -> web.Response:
        if not self.scheduler.alive:
            return _error(503, "not ready")
        return web.json_response({"status": "ready"})

    async def server_info(self, _request) -> web.Response:
        import torch
        import transformers

        st = self.scheduler.stats()
        return web.json_response({
            "engine": "agentrl-embedded", "model_path": self.model_path,
            "max_running_requests": st["max_batch_size"], "weight_version": st["weight_version"],
            "internal_states": [st], "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
        })

    async def model_info(self, _request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "weight_version": self.scheduler.weight_version, "vocab_size": self.vocab_size,
            "architectures": list(getattr(self.model.config, "architectures", None) or [type(self.model).__name__]),
        })

    async def get_weight_version(self, _request) -> web.Response:
        return web.json_response({"weight_version": self.scheduler.weight_version})

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request, allow_empty=True)
            mode = body.get("mode", "retract")
            if mode not in PAUSE_MODES:
                raise BadRequest(f"mode {mode!r}: use one of {PAUSE_MODES}")
        except BadRequest as exc:
            return _error(400, str(exc))
        counts = await self._run(lambda: self.scheduler.pause(mode))
        return web.json_response({"success": True, "mode": mode, **counts})

    async def continue_generation(self, _request) -> web.Response:
        await self._run(self.scheduler.resume)
        return web.json_response({"success": True})

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request, allow_empty=True)
        except BadRequest as exc:
            return _error(400, str(exc))
        if not body.get("abort_all") and not body.get("rid"):
            return _error(400, "abort_request needs rid or abort_all=true")
        self.scheduler.abort(body.get("rid"), bool(body.get("abort_all")))
        return web.json_response({"success": True})

    async def flush_cache(self, _request) -> web.Response:
        try:
            await self._run(self.scheduler.flush_cache)
        except Busy as exc:
            return _error(400, str(exc))
        return web.Response(text="Cache flushed.")

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            tensors = await asyncio.to_thread(
                wlib.decode_named_tensors, body.get("serialized_named_tensors"), body.get("load_format"))
            version = body.get("weight_version")
            n = await self._run(lambda: self.scheduler.load_weights(
                lambda: wlib.load_named_tensors(self.model, tensors), version))
        except (BadRequest, wlib.WeightUpdateError) as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        return web.json_response({"success": True, "message": f"loaded {n} tensors",
                                  "weight_version": self.scheduler.weight_version})

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            b = await _json(request)
            name = b.get("group_name", "weight_update_group")
            if name in self._groups:
                raise BadRequest(f"group {name!r} already exists; destroy it first")
            group = await asyncio.to_thread(lambda: wlib.WeightUpdateGroup(
                master_address=b["master_address"], master_port=int(b["master_port"]),
                rank_offset=int(b["rank_offset"]), world_size=int(b["world_size"]),
                group_name=name, backend=b.get("backend", "gloo")))
        except KeyError as exc:
            return web.json_response({"success": False, "message": f"missing field {exc}"}, status=400)
        except (BadRequest, wlib.WeightUpdateError, RuntimeError) as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        self._groups[name] = group
        return web.json_response({"success": True, "message": f"joined {name} as rank {group.rank}"})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json(request, allow_empty=True)
        group = self._groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return web.json_response({"success": False, "message": "no such group"}, status=400)
        group.close()
        return web.json_response({"success": True, "message": "destroyed"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        try:
            b = await _json(request)
            group = self._groups.get(b.get("group_name", "weight_update_group"))
            if group is None:
                raise BadRequest("no weight update group; call /init_weights_update_group first")
            if b.get("abort_all_requests"):
                self.scheduler.abort(abort_all=True)
            # Receiving does not touch the model, so generation continues during the transfer.
            tensors = await asyncio.to_thread(group.receive, b["names"], b["dtypes"], b["shapes"], b.get("load_format"))
            n = await self._run(lambda: self.scheduler.load_weights(
                lambda: wlib.load_named_tensors(self.model, tensors), b.get("weight_version")))
        except KeyError as exc:
            return web.json_response({"success": False, "message": f"missing field {exc}"}, status=400)
        except (BadRequest, wlib.WeightUpdateError) as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        return web.json_response({"success": True, "message": f"loaded {n} tensors",
                                  "weight_version": self.scheduler.weight_version})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            b = await _json(request)
            if "new_version" not in b:
                raise BadRequest("new_version is required")
        except BadRequest as exc:
            return _error(400, str(exc))
        await self._run(lambda: self.scheduler.set_weight_version(str(b["new_version"]), bool(b.get("abort_all_requests"))))
        return web.json_response({"success": True, "weight_version": self.scheduler.weight_version})


def _resolver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future):
    def set_result(out: GenOutput) -> None:
        if not fut.done():
            fut.set_result(out)
    return lambda out: loop.call_soon_threadsafe(set_result, out)


async def _json(request: web.Request, allow_empty: bool = False) -> dict:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequest("request body must be a JSON object")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _int(d: dict, key: str, default: int, lo: int | None) -> int:
    v = d.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo):
        raise BadRequest(f"sampling_params.{key} must be an int{'' if lo is None else f' >= {lo}'}, got {v!r}")
    return v


def _num(d: dict, key: str, default: float, lo: float, hi: float | None = None) -> float:
    v = d.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        raise BadRequest(f"sampling_params.{key} must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)
