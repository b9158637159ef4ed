"""Async client for SGLang's native HTTP API (and the embedded engine, which speaks it too).

One `EngineClient` per engine URL. Every call has an explicit timeout. `/generate` is never
retried: a request that may have reached the engine could have sampled tokens already, so a
timeout aborts it on the engine (best effort) and raises; only a refused connection (the request
never left) is reported as `EngineUnavailable`, which a router may safely send elsewhere. A caller
cancelled while it waits (an episode of a cancelled group) aborts its request too: neither engine
stops generating when the client goes away (aiohttp does not cancel a handler on disconnect).
An aborted request is not an error: it returns its partial tokens with finish_reason "abort".

Shapes are SGLang 0.5.23's: per-token weight versions come as `meta_info.weight_versions` spans
[{version, start, end}] over the output tokens (expanded here to one version per token); the
current version is `/model_info`'s weight_version (0.5.23 has no /get_weight_version); weight
updates must sit between `begin_weight_update` and `end_weight_update`.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Self

import httpx

from agentrl.rollout.types import GenerateResult, SamplingParams

SESSION_HEADER = "X-Session-Id"  # the router's affinity key; engines ignore it
_BODY_LIMIT = 2000


class EngineError(RuntimeError):
    """An engine call failed. Carries the endpoint, HTTP status (None: no response) and body."""

    def __init__(self, base_url: str, endpoint: str, status: int | None, body: str) -> None:
        self.base_url, self.endpoint, self.status = base_url, endpoint, status
        self.body = body[:_BODY_LIMIT]
        super().__init__(f"{base_url}{endpoint}: {'no response' if status is None else f'HTTP {status}'}: {self.body}")

    def __reduce__(self):  # across Ray actors; the default would call __init__ with the message alone
        return type(self), (self.base_url, self.endpoint, self.status, self.body)


class EngineTimeout(EngineError):
    """No answer within the timeout; a generate request was aborted on the engine."""


class EngineUnavailable(EngineError):
    """The connection was refused or could not be made: the request never reached the engine."""


def parse_version(v: object) -> int:
    """SGLang's weight_version is a string; "default" is the version before any update."""
    if v is None or v == "default":
        return 0
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ValueError(f"weight_version {v!r} is not an integer; set it with update_weight_version") from None


def expand_version_spans(spans: object, n: int) -> list[object]:
    """One version per output token from SGLang's spans: contiguous [start, end) runs covering
    [0, n) in order (a span is {"version", "start", "end"}, or its array form [version, start, end])."""
    if not isinstance(spans, list) or not spans:
        raise ValueError(f"meta_info.weight_versions must be a non-empty list of spans, got {spans!r}")
    out: list[object] = []
    for span in spans:
        if isinstance(span, dict):
            version, start, end = span.get("version"), span.get("start"), span.get("end")
        elif isinstance(span, list) and len(span) == 3:
            version, start, end = span
        else:
            raise ValueError(f"weight version span {span!r} is not {{version, start, end}}")
        if not (isinstance(start, int) and isinstance(end, int)) or start != len(out) or end < start:
            raise ValueError(f"weight version spans {spans!r} do not cover the output tokens contiguously")
        out += [version] * (end - start)
    if len(out) != n:
        raise ValueError(f"weight version spans cover {len(out)} tokens, the response has {n}")
    return out


def parse_generate_response(resp: dict, rid: str | None = None) -> GenerateResult:
    """Map one /generate response (return_logprob=true, logprob_start_len=-1) to GenerateResult."""
    meta = resp.get("meta_info") or {}
    ids = resp.get("output_ids")
    lps = meta.get("output_token_logprobs")
    if ids is None or lps is None:
        raise ValueError(f"response lacks output_ids or meta_info.output_token_logprobs: keys {sorted(resp)}")
    if [int(x[1]) for x in lps] != list(ids):
        raise ValueError("meta_info.output_token_logprobs token ids differ from output_ids")
    spans = meta.get("weight_versions")
    if spans is not None:
        versions = expand_version_spans(spans, len(ids))
    else:  # servers older than span reporting: one version for the whole response
        versions = [meta.get("weight_version")] * len(ids)
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in ("stop", "length", "abort"):
        raise ValueError(f"unknown finish_reason {reason!r}")
    return GenerateResult(
        output_ids=list(ids), logprobs=[float(x[0]) for x in lps], weight_versions=[parse_version(v) for v in versions],
        finish_reason=kind, prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)), rid=meta.get("id", rid),
    )


class EngineClient:
    """SGLang native API client; also a `Generator` (agentrl.rollout.types)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, *, connect_timeout_s: float = 5.0,
                 control_timeout_s: float = 60.0) -> None:
        if timeout_s <= 0 or control_timeout_s <= 0:
            raise ValueError("timeout_s and control_timeout_s must be > 0")
        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.control_timeout_s = timeout_s, control_timeout_s
        self._connect = connect_timeout_s
        self._aborts: set[asyncio.Task] = set()  # aborts of cancelled requests, still being sent
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    async def aclose(self) -> None:
        await asyncio.gather(*self._aborts, return_exceptions=True)
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _call(self, method: str, endpoint: str, payload: dict | None = None, *, timeout_s: float | None = None,
                    headers: dict | None = None) -> httpx.Response:
        timeout = httpx.Timeout(timeout_s or self.control_timeout_s, connect=self._connect)
        try:
            resp = await self._http.request(method, endpoint, json=payload, timeout=timeout, headers=headers)
        except httpx.ConnectError as exc:
            raise EngineUnavailable(self.base_url, endpoint, None, f"cannot connect: {exc}") from None
        except httpx.TimeoutException as exc:
            raise EngineTimeout(self.base_url, endpoint, None, f"timed out after {timeout.read}s ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise EngineError(self.base_url, endpoint, None, f"{type(exc).__name__}: {exc}") from None
        if resp.status_code >= 400:
            raise EngineError(self.base_url, endpoint, resp.status_code, resp.text)
        return resp

    async def _json(self, method: str, endpoint: str, payload: dict | None = None, **kw) -> dict:
        resp = await self._call(method, endpoint, payload, **kw)
        try:
            body = resp.json() if resp.content else {}
        except ValueError:
            return {"text": resp.text}
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(self.base_url, endpoint, resp.status_code, str(body.get("message", body)))
        return body

    # ---- generation --------------------------------------------------------------------------
    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       rid: str | None = None) -> GenerateResult:
        """Token ids in; sampled ids, their logprobs and weight versions out (Generator protocol)."""
        rid = rid or uuid.uuid4().hex
        payload = {"input_ids": list(input_ids), "sampling_params": sampling.to_sglang(), "return_logprob": True,
                   "logprob_start_len": -1, "rid": rid, "stream": False}
        resp = await self.generate_raw(payload, session_id=session_id)
        try:
            return parse_generate_response(resp, rid)
        except ValueError as exc:
            raise EngineError(self.base_url, "/generate", 200, f"malformed response: {exc}") from None

    async def generate_raw(self, payload: dict, *, session_id: str | None = None) -> dict | list:
        """POST /generate with a caller-built SGLang payload; aborts the rid on timeout."""
        headers = {SESSION_HEADER: session_id} if session_id else None
        try:
            resp = await self._call("POST", "/generate", payload, timeout_s=self.timeout_s, headers=headers)
        except EngineTimeout:
            if isinstance(payload.get("rid"), str):
                try:
                    await self.abort_request(payload["rid"])
                except EngineError:
                    pass  # the engine is unreachable; the timeout below is the error to report
            raise
        except asyncio.CancelledError:
            if isinstance(payload.get("rid"), str):  # sent in the background: this task is being cancelled
                t = asyncio.ensure_future(self._abort_quietly(payload["rid"]))
                self._aborts.add(t)
                t.add_done_callback(self._aborts.discard)
            raise
        return resp.json()

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self.abort_request(rid)
        except EngineError:
            pass  # the engine is gone, and its request with it

    # ---- control -----------------------------------------------------------------------------
    async def pause_generation(self, mode: str = "retract") -> dict:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode {mode!r}; use abort, retract or in_place")
        return await self._json("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self._json("POST", "/continue_generation", {})

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> dict:
        if not rid and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        return await self._json("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache")

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health")
        except EngineError:
            return False
        return True

    async def ready(self) -> bool:
        try:
            await self._call("GET", "/ready")
        except EngineError:
            return False
        return True

    async def server_info(self) -> dict:
        return await self._json("GET", "/server_info")

    async def model_info(self) -> dict:
        return await self._json("GET", "/model_info")

    async def health_generate(self) -> bool:
        """True if the engine generates (SGLang runs a one-token request; up to ~20 s when idle)."""
        try:
            await self._call("GET", "/health_generate")
        except EngineError:
            return False
        return True

    async def weight_version(self) -> int:
        """The engine's current weight version, from /model_info (as SGLang 0.5.23 reports it)."""
        return parse_version((await self.model_info()).get("weight_version"))

    # ---- weights -----------------------------------------------------------------------------
    async def begin_weight_update(self, selector: str = "all") -> dict:
        """Open the weight-update session every update must sit in (SGLang 0.5.23 refuses updates outside one)."""
        if selector not in ("target", "draft", "all"):
            raise ValueError(f"selector {selector!r}; use target, draft or all")
        return await self._json("POST", "/begin_weight_update", {"selector": selector})

    async def end_weight_update(self) -> dict:
        return await self._json("POST", "/end_weight_update", {})

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], *, load_format: str | None = None,
                                         flush_cache: bool = True, weight_version: str | int | None = None) -> dict:
        """serialized_named_tensors: one item per TP rank (embedded engine: see embedded/weights.py)."""
        payload = {"serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._json("POST", "/update_weights_from_tensor", payload, timeout_s=self.timeout_s)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, *, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict:
        payload = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                   "world_size": world_size, "group_name": group_name, "backend": backend}
        return await self._json("POST", "/init_weights_update_group", payload, timeout_s=self.timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._json("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              abort_all_requests: bool = False,
                                              weight_version: str | int | None = None,
                                              load_format: str | None = None) -> dict:
        payload = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                   "flush_cache": flush_cache, "abort_all_requests": abort_all_requests, "load_format": load_format}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._json("POST", "/update_weights_from_distributed", payload, timeout_s=self.timeout_s)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` values of parameter `name` (SGLang's test endpoint)."""
        resp = await self._call("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})
        return resp.json()

    async def update_weight_version(self, new_version: str | int, *, abort_all_requests: bool = False) -> dict:
        return await self._json("POST", "/update_weight_version",
                                {"new_version": str(new_version), "abort_all_requests": abort_all_requests})
