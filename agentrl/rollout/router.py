"""Session-affine routing over several engines: every turn of an episode hits the same engine.

A consistent-hash ring (blake2b, `virtual_nodes` points per engine) maps a session id to the
first *up* engine clockwise from its hash. So:
- the mapping is a pure function of (session id, engine set): sticky with no table to keep;
- when an engine goes down only its sessions move (to their next engine on the ring), and when it
  comes back exactly those sessions return; adding or removing an engine likewise moves only the
  sessions whose arc changes hands (~1/N of them). The engine set is fixed for a Router's life: a
restarted engine keeps its URL (agentrl.cluster.engines) and comes back through mark_up/refresh.
An engine is marked down when a request cannot connect (`EngineUnavailable`: the request never
reached it, so sending it to the session's next engine is safe) or by `mark_down`; `refresh()`
probes down engines' /health and brings them back. Any other failure is the caller's to handle:
generation is never retried blindly.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
from collections.abc import Callable

from agentrl.rollout.client import EngineClient, EngineUnavailable
from agentrl.rollout.types import GenerateResult, SamplingParams


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes; knows nothing about health."""

    def __init__(self, nodes: list[str], virtual_nodes: int = 64) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self.virtual_nodes = virtual_nodes
        self._points: list[tuple[int, str]] = []
        for node in nodes:
            self.add(node)

    @property
    def nodes(self) -> list[str]:
        return sorted({n for _, n in self._points})

    def add(self, node: str) -> None:
        if node in self.nodes:
            raise ValueError(f"engine {node!r} is already on the ring")
        for i in range(self.virtual_nodes):
            bisect.insort(self._points, (_hash(f"{node}#{i}"), node))

    def remove(self, node: str) -> None:
        if node not in self.nodes:
            raise ValueError(f"engine {node!r} is not on the ring")
        self._points = [p for p in self._points if p[1] != node]

    def lookup(self, key: str, skip: set[str] = frozenset()) -> str:
        """The first node clockwise from hash(key) that is not in `skip`."""
        if not self._points:
            raise LookupError("no engines on the ring")
        start = bisect.bisect(self._points, (_hash(key), ""))
        n = len(self._points)
        for i in range(n):
            node = self._points[(start + i) % n][1]
            if node not in skip:
                return node
        raise LookupError("every engine is down")


class Router:
    """A `Generator` that delegates to the session's engine through one EngineClient per engine."""

    def __init__(self, engines: list[str], *, timeout_s: float = 600.0, virtual_nodes: int = 64,
                 client_factory: Callable[[str], EngineClient] | None = None) -> None:
        if not engines:
            raise ValueError("Router needs at least one engine URL")
        if len(set(engines)) != len(engines):
            raise ValueError(f"duplicate engine URLs in {engines}")
        factory = client_factory or (lambda url: EngineClient(url, timeout_s=timeout_s))
        self._ring = HashRing(list(engines), virtual_nodes)
        self._clients = {url: factory(url) for url in engines}
        self._down: set[str] = set()
        self.in_flight = {url: 0 for url in engines}
        self.served = {url: 0 for url in engines}

    @property
    def engines(self) -> list[str]:
        return self._ring.nodes

    @property
    def down(self) -> set[str]:
        return set(self._down)

    def engine_for(self, session_id: str) -> str:
        return self._ring.lookup(session_id, self._down)

    def client(self, url: str) -> EngineClient:
        return self._clients[url]

    def mark_down(self, url: str) -> None:
        self._clients[url]  # KeyError for an unknown engine
        self._down.add(url)

    def mark_up(self, url: str) -> None:
        self._down.discard(url)

    async def refresh(self) -> set[str]:
        """Probe /health of down engines; those that answer come back. Returns the engines still down."""
        down = list(self._down)
        alive = await asyncio.gather(*(self._clients[u].health() for u in down))
        for url, ok in zip(down, alive):
            if ok:
                self._down.discard(url)
        return self.down

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       rid: str | None = None) -> GenerateResult:
        tried = set()
        while True:
            url = self.engine_for(session_id)
            if url in tried:  # a concurrent refresh() revived an engine that just refused us
                raise LookupError(f"no reachable engine for session {session_id!r}")
            tried.add(url)
            self.in_flight[url] += 1
            try:
                result = await self._clients[url].generate(input_ids, sampling, session_id=session_id, rid=rid)
            except EngineUnavailable:
                # Never reached the engine: safe to move this session to its next engine.
                self._down.add(url)
                if len(self._down) == len(self._clients):
                    raise
                continue
            finally:
                self.in_flight[url] -= 1
            self.served[url] += 1
            return result

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients.values()))
