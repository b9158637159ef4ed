"""The nccl transport: one broadcast group per pipeline stage, from the stage's sender to every
engine rank, over SGLang 0.5.23's `/init_weights_update_group` + `/update_weights_from_distributed`
(gloo when the trainer runs on CPU, NCCL on GPU).

Groups (one per stage, on that stage's sender): world = 1 + the engines' GPUs, the sender rank 0,
engine i at rank_offset 1 + the GPUs of engines 0..i-1 (SGLang adds its tp_rank). A group is
built for the set of engines an update goes to and kept while that set holds; when it changes
(an engine failed, a restarted engine gets the current weights alone, then rejoins everyone) the
old group is destroyed on the sender and on every engine still answering, and a new one, under a
new name, is built. The engines' init calls are posted before the sender's rendezvous blocks
(the engines join the sender's tcp store; each side waits for the other).

Per bucket: the request is posted to every member, then the flat buffer is broadcast; the
sender waits for the broadcast (bounded by the group's timeout: gloo's own, or polling NCCL's work
and aborting the communicator) and for every member's answer (bounded by the HTTP timeout). Any
failure breaks the stage: the group is torn down, nothing more is sent on it, and the result says
`broken`, so the driver sends the stage again to the engines still alive, over a new group.

NCCL between the trainer and SGLang: NCCL refuses to build a communicator whose members run
different NCCL versions ("Mismatched NCCL version detected", init.cc, which compares the full
version code). torch 2.11 pins nvidia-nccl-cu13 2.28.9, SGLang 0.5.23's torch 2.14.1 pins 2.30.7
(the wheels' metadata), so the trainer's environment must load SGLang's NCCL: install
nvidia-nccl-cu13==2.30.7 beside torch 2.11 (torch loads libnccl.so.2 by soname; NCCL keeps its ABI
within 2.x) or put that libnccl.so.2 on LD_PRELOAD. `nccl_version_hint` adds this to a failed
rendezvous's message.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from agentrl.rollout.client import EngineClient
from agentrl.sync.nccl_export import Done, destroy_group, init_weights_update_group
from agentrl.sync.session import HEALTH_TIMEOUT_S, EngineLinks
from agentrl.sync.stage import StageSender
from agentrl.sync.transport import StageRequest

NCCL_POLL_S = 0.005  # how often a waiting sender looks at an NCCL broadcast (a 256 MiB one takes ~0.7 ms)
SGLANG_NCCL = "2.30.7"  # nvidia-nccl-cu13 pinned by torch 2.14.1, SGLang 0.5.23's torch


def nccl_version_hint() -> str:
    try:
        mine = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL
        return ""
    if mine == SGLANG_NCCL:
        return ""
    return (f" (this trainer's NCCL is {mine}, SGLang 0.5.23's is {SGLANG_NCCL}; NCCL refuses mixed versions: "
            f"install nvidia-nccl-cu13=={SGLANG_NCCL} in the trainer's environment)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass
class StageGroup:
    name: str
    members: tuple[str, ...]
    pg: Any = None
    offsets: dict[str, int] = field(default_factory=dict)


class _BroadcastPending:
    def __init__(self, owner: NcclTransport, group: StageGroup, work: Any, links: EngineLinks, futures: dict,
                 timeout_s: float):
        self.owner, self.group, self.work, self.links, self.futures = owner, group, work, links, futures
        self.timeout_s = timeout_s

    def wait(self) -> None:
        ok = self.owner.wait_work(self.work, self.timeout_s)
        before = set(self.links.failed)
        self.links.collect(self.futures)
        new = set(self.links.failed) - before
        if not ok and not new:  # nobody said why: every member is a suspect (the driver probes them)
            for u in self.group.members:
                self.links.failed.setdefault(u, f"broadcast on {self.group.name} failed or took over "
                                                f"{self.timeout_s:g} s")
        if not ok or new:
            self.owner.break_group(self.group)


class NcclTransport(StageSender):
    kind = "nccl"

    def __init__(self, *, rank: int = 0, device="cpu", node_ip: str = "127.0.0.1"):
        super().__init__(rank=rank, device=device)
        self.node_ip = node_ip
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.groups: dict[int, StageGroup] = {}
        self._generation = 0

    # ---- groups ------------------------------------------------------------------------------
    async def prepare(self, links: EngineLinks, request: StageRequest) -> None:
        g = self.groups.get(request.stage)
        members = tuple(links.live)
        if g is not None and g.pg is not None and g.members == members:
            return
        if g is not None:
            await self._retire(g)
        for attempt in range(2):  # an engine that cannot join is dropped, the rest try once more
            g = await self._build(request, links)
            if g.pg is not None or not links.live or attempt:
                break
        self.groups[request.stage] = g
        if g.pg is None:
            self.broken = True

    async def _build(self, request: StageRequest, links: EngineLinks) -> StageGroup:
        ranks = dict(zip(request.urls, request.engine_ranks or (1,) * len(request.urls), strict=True))
        urls = links.live
        self._generation += 1
        g = StageGroup(f"agentrl-w-pp{request.stage}-g{self._generation}", tuple(urls))
        at = 1
        for u in urls:
            g.offsets[u] = at
            at += ranks[u]
        port = free_port()
        futures = {u: links.post([u], lambda c, off=g.offsets[u]: c.init_weights_update_group(
            self.node_ip, port, off, at, group_name=g.name, backend=self.backend))[u] for u in urls}
        try:  # the engines' calls are on their way; now the rendezvous may block
            g.pg = await asyncio.to_thread(init_weights_update_group, self.node_ip, port, 0, at, g.name,
                                           self.backend, request.timeout_s)
        except Exception as exc:  # noqa: BLE001 - an engine that never joins times the rendezvous out
            why = f"rendezvous of {g.name} failed: {type(exc).__name__}: {str(exc)[:200]}{nccl_version_hint()}"
            await links.acollect(futures)  # engines that refused say so in their own words
            if not any(u in links.failed for u in urls):  # nobody did: every engine is a suspect
                for u in urls:
                    links.failed.setdefault(u, why)
            return g
        await links.acollect(futures)
        if any(u in links.failed for u in urls):  # joined the store but reported failure: do not trust it
            destroy_group(g.pg)
            g.pg = None
        return g

    async def _retire(self, g: StageGroup) -> None:
        """Destroy a group on the sender and on every member that still answers."""
        destroy_group(g.pg)
        g.pg = None

        async def tell(u: str) -> None:
            try:
                async with EngineClient(u, timeout_s=HEALTH_TIMEOUT_S, control_timeout_s=HEALTH_TIMEOUT_S) as c:
                    await c.destroy_weights_update_group(g.name)
            except Exception:  # noqa: BLE001, S110 - a dead or restarted engine has no such group
                pass
        await asyncio.gather(*(tell(u) for u in g.members))

    def break_group(self, g: StageGroup) -> None:
        self.broken = True
        destroy_group(g.pg)
        g.pg = None

    def wait_work(self, work: Any, timeout_s: float) -> bool:
        """True if the broadcast finished in time; a late NCCL one is aborted (its group is then dead)."""
        try:
            if self.backend == "gloo":
                work.wait()  # bounded by the group's own timeout
                return True
            deadline = time.monotonic() + timeout_s
            while not work.is_completed():
                if time.monotonic() > deadline:
                    return False
                time.sleep(NCCL_POLL_S)
            work.wait()
            return True
        except Exception:  # noqa: BLE001 - a peer that died mid-broadcast surfaces here
            return False

    # ---- buckets -----------------------------------------------------------------------------
    def send_bucket(self, links, request, bucket, flat, last):
        g = self.groups.get(request.stage)
        if self.broken or g is None or g.pg is None:
            return Done()
        version = request.version if last else None
        p = bucket.payload()
        futures = links.post(list(g.members), lambda c: c.update_weights_from_distributed(
            p["names"], p["dtypes"], p["shapes"], group_name=g.name, flush_cache=last and request.flush,
            weight_version=version, load_format="flattened_bucket"))
        try:  # NCCL builds its communicator here, at the first broadcast (where mixed versions fail)
            work = dist.broadcast(flat, src=0, group=g.pg, async_op=True)
        except Exception as exc:  # noqa: BLE001 - a group whose peer died refuses new work
            links.collect(futures)
            for u in g.members:
                links.failed.setdefault(u, f"broadcast on {g.name} failed: {str(exc)[:200]}{nccl_version_hint()}")
            self.break_group(g)
            return Done()
        return _BroadcastPending(self, g, work, links, futures, request.timeout_s)

    def close(self) -> None:
        for g in self.groups.values():
            destroy_group(g.pg)
            g.pg = None
        self.groups.clear()
