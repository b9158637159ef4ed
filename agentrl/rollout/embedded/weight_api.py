"""The weight endpoints of the embedded engine, with SGLang 0.5.23's bodies, answers and rules.

- Updates run inside a session: `/begin_weight_update` {selector} ... `/end_weight_update` {};
  an update outside one, a second begin, or an end without a begin is refused (400,
  success=false), with SGLang's messages.
- `/update_weights_from_tensor` and `/update_weights_from_distributed` load, set the version and
  then, with flush_cache (default true), flush the cache; a flush refused because requests keep KV
  (paused in_place with running requests) fails the call although the weights changed, as SGLang
  reports it ("Weights were updated, but the cache was not flushed ...").
- Every check runs before any weight changes (weights.prepare_named_tensors): names, shapes,
  finite values, bucket alignment.
- `/init_weights_update_group` and every broadcast are bounded by the engine's
  weight_update_timeout_s and run on daemon threads, so the HTTP loop keeps answering and
  SIGTERM still ends the process while a rendezvous is blocked.
- `/update_weight_version` {new_version, abort_all_requests (default true)}.
- `/get_weights_by_name` {name, truncate_size (default 100)}: the first values of a tensor, by
  checkpoint name (SGLang's test endpoint; a per-expert name reads its slice of the fused tensor).
- Receipts (an addition): `/end_weight_update` answers `received` {tensors, distinct,
  names_digest} for the session, HF names counted once per arrival (agentrl.sync.buckets.
  names_digest), so the sender can check that every tensor arrived exactly once.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp import web

from agentrl.rollout.embedded import weights as wlib
from agentrl.rollout.embedded.http_util import (
    BadRequest,
    error,
    field,
    in_daemon_thread,
    join_threads,
    json_body,
    result,
)

SELECTORS = ("target", "draft", "all")
DEFAULT_GROUP = "weight_update_group"
OUTSIDE_SESSION = "{} must run between begin_weight_update() and end_weight_update()"
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
               "queued. Retract or finish them, then call /flush_cache.")


def _str_list(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


class WeightAPI:
    """Owns the weight-update session and the broadcast groups of one EmbeddedEngineServer."""

    def __init__(self, server, timeout_s: float) -> None:
        self.server, self.timeout_s = server, timeout_s
        self.session_open = False
        self.received: Counter[str] = Counter()  # HF names loaded in the open session
        self.groups: dict[str, wlib.WeightUpdateGroup] = {}
        self.threads: set = set()  # rendezvous and broadcasts still running

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/begin_weight_update", self.begin)
        router.add_post("/end_weight_update", self.end)
        router.add_post("/update_weights_from_tensor", self.from_tensor)
        router.add_post("/init_weights_update_group", self.init_group)
        router.add_post("/destroy_weights_update_group", self.destroy_group)
        router.add_post("/update_weights_from_distributed", self.from_distributed)
        router.add_post("/update_weight_version", self.update_version)
        router.add_route("*", "/get_weights_by_name", self.get_weights_by_name)

    def close(self, join: bool = True) -> None:
        if join:  # torch's store client gives up after about twice its timeout (measured: 5 s -> 11.6 s)
            join_threads(self.threads, 2 * self.timeout_s + 1)
        for g in self.groups.values():
            g.close()
        self.groups.clear()

    # ---- session -----------------------------------------------------------------------------
    async def begin(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request, allow_empty=True)
            field(body, "selector", str, "all", check=lambda v: v in SELECTORS, hint=f"one of {SELECTORS}")
        except BadRequest as exc:
            return result(False, str(exc))
        if self.session_open:
            return result(False, "a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        self.received.clear()
        return result(True, "Success")

    async def end(self, request: web.Request) -> web.Response:
        if not self.session_open:
            return result(False, "no weight-update session is open; call begin_weight_update() first")
        from agentrl.sync.buckets import names_digest

        self.session_open = False
        received = {"tensors": sum(self.received.values()), "distinct": len(self.received),
                    "names_digest": names_digest(self.received)}
        self.received.clear()
        return result(True, "Success", received=received)

    # ---- loads -------------------------------------------------------------------------------
    def _common(self, body: dict) -> tuple[bool, str | None]:
        flush = field(body, "flush_cache", bool, True)
        version = field(body, "weight_version", str, None)
        field(body, "selector", str, "all", check=lambda v: v in SELECTORS, hint=f"one of {SELECTORS}")
        field(body, "torch_empty_cache", bool, False)
        if field(body, "abort_all_requests", bool, False):
            self.server.scheduler.abort(abort_all=True)
        return flush, version

    async def _load(self, tensors: dict, version: str | None, flush: bool, ok_message: str) -> web.Response:
        srv = self.server
        prepared = await asyncio.to_thread(wlib.prepare_named_tensors, srv.model, tensors)
        del tensors  # IPC handles are released once their copies are in the model
        out = await srv.run_on_scheduler(lambda: srv.scheduler.load_weights(
            lambda: wlib.load_named_tensors(srv.model, prepared), version, flush))
        self.received.update(prepared.received)
        if flush and not out["flushed"]:
            return result(False, NOT_FLUSHED, weight_version=srv.scheduler.weight_version)
        if version is not None:
            ok_message += f" Weight version updated to {version}."
        return result(True, ok_message, weight_version=srv.scheduler.weight_version)

    async def from_tensor(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request)
            serialized = field(body, "serialized_named_tensors", list, check=_str_list, hint="a list of strings")
            load_format = field(body, "load_format", str, None)
            flush, version = self._common(body)
            if not self.session_open:
                return result(False, OUTSIDE_SESSION.format("update_weights_from_tensor"))
            tensors = await asyncio.to_thread(wlib.decode_named_tensors, serialized, load_format)
            return await self._load(tensors, version, flush, "Success")
        except (BadRequest, wlib.WeightUpdateError) as exc:
            return result(False, str(exc))

    async def from_distributed(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request)
            names = field(body, "names", list, check=_str_list, hint="a list of strings")
            dtypes = field(body, "dtypes", list, check=_str_list, hint="a list of dtype names")
            shapes = field(body, "shapes", list, hint="a list of shapes (lists of ints)")
            name = field(body, "group_name", str, DEFAULT_GROUP)
            load_format = field(body, "load_format", str, None)
            flush, version = self._common(body)
            if not self.session_open:
                return result(False, OUTSIDE_SESSION.format("update_weights_from_distributed"))
            group = self.groups.get(name)
            if group is None:
                return result(False, f"Failed to receive weights: Group {name} not in {sorted(self.groups)}. "
                                     "Please call `init_weights_update_group` first.")
            wlib.check_receive(names, dtypes, shapes, load_format)  # refused before joining the broadcast
            try:  # receiving does not touch the model: generation continues during the transfer
                tensors = await in_daemon_thread(group.receive, names, dtypes, shapes, load_format,
                                                 timeout_s=self.timeout_s, track=self.threads)
            except TimeoutError:
                return result(False, f"Failed to receive weights: no broadcast within {self.timeout_s:g} s")
            except RuntimeError as exc:
                return result(False, f"Failed to receive weights: {exc}".splitlines()[0])
            return await self._load(tensors, version, flush, "Succeeded to update parameter online.")
        except (BadRequest, wlib.WeightUpdateError) as exc:
            return result(False, str(exc))

    # ---- groups ------------------------------------------------------------------------------
    async def init_group(self, request: web.Request) -> web.Response:
        try:
            b = await json_body(request)
            kw = {"master_address": field(b, "master_address", str),
                  "master_port": field(b, "master_port", int, check=lambda v: 0 < v < 65536, hint="a port"),
                  "rank_offset": field(b, "rank_offset", int),
                  "world_size": field(b, "world_size", int, check=lambda v: v >= 2, hint="an int >= 2"),
                  "group_name": field(b, "group_name", str, DEFAULT_GROUP),
                  "backend": field(b, "backend", str, "nccl")}
            if kw["group_name"] in self.groups:
                raise BadRequest(f"group {kw['group_name']!r} already exists; destroy it first")
            # torch's store client retries once more after its own timeout (measured: 5 s -> fails
            # after ~11.6 s), so the deadline is kept here; a group that joins after it is closed.
            group = await in_daemon_thread(lambda: wlib.WeightUpdateGroup(
                **kw, timeout_s=self.timeout_s, device=self.server.scheduler.device),
                timeout_s=self.timeout_s, on_late=lambda g: g.close(), track=self.threads)
        except TimeoutError:
            return result(False, f"Failed to initialize custom process group: no rendezvous with "
                                 f"{kw['master_address']}:{kw['master_port']} within {self.timeout_s:g} s")
        except (BadRequest, wlib.WeightUpdateError) as exc:
            return result(False, f"Failed to initialize custom process group: {exc}")
        self.groups[kw["group_name"]] = group
        return result(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request, allow_empty=True)
            group = self.groups.pop(field(body, "group_name", str, DEFAULT_GROUP), None)
        except BadRequest as exc:
            return result(False, str(exc))
        if group is None:
            return result(False, "The group to be destroyed does not exist.")
        group.close()
        return result(True, "Succeeded to destroy custom process group.")

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request)
            name = field(body, "name", str, hint="a parameter name")
            size = field(body, "truncate_size", int, 100, check=lambda v: v >= 1, hint="an int >= 1")
            state = self.server.model.state_dict()
            num_layers = getattr(self.server.model.config, "num_hidden_layers", None)
            target = wlib.target_of(name, state, num_layers)
            if target is None:
                raise BadRequest(f"{name} is in a layer this engine does not serve")
        except (BadRequest, wlib.WeightUpdateError) as exc:
            return error(400, str(exc))
        t = state[target.param][target.index] if target.index else state[target.param]
        return web.json_response(t.detach().float().reshape(-1)[:size].cpu().tolist())

    async def update_version(self, request: web.Request) -> web.Response:
        try:
            b = await json_body(request)
            version = field(b, "new_version", str, hint="a string")
            abort_all = field(b, "abort_all_requests", bool, True)
        except BadRequest as exc:
            return result(False, f"Failed to update weight version: {exc}")
        sched = self.server.scheduler
        await self.server.run_on_scheduler(lambda: sched.set_weight_version(version, abort_all))
        return result(True, f"Weight version updated to {version}", new_version=version)
