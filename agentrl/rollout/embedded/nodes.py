"""The embedded engine across several nodes: a rendezvous, as SGLang's `--nnodes/--node-rank/
--dist-init-addr` processes meet, so a multi-node engine of the plan comes up for real on CPU.

Node 0 serves a torch TCPStore at the dist-init address and waits until every other node has
checked in, only then starts serving HTTP (so it reports healthy only with all nodes up). A node
of rank > 0 checks in and stays up without serving HTTP; it exits when node 0's store goes away
(its engine is then restarted whole). The model itself is not sharded: only node 0 runs it.
"""

from __future__ import annotations

import datetime
import time

READY_KEY = "agentrl/engine_ready"
WATCH_INTERVAL_S = 2.0  # how often a node > 0 checks that node 0 is still there


def node_key(rank: int) -> str:
    return f"agentrl/engine_node{rank}"


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr {addr!r}: use host:port (node 0's IP and a free port there)")
    return host.strip("[]"), int(port)


def host_nodes(addr: str, nnodes: int, timeout_s: float):
    """Node 0: serve the store on addr's port and wait for nodes 1..nnodes-1. Returns the store
    (keep it referenced: the other nodes watch it)."""
    import torch.distributed as dist

    _, port = parse_addr(addr)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("0.0.0.0", port, nnodes, is_master=True, timeout=timeout, wait_for_workers=False)
    store.wait([node_key(r) for r in range(1, nnodes)], timeout)
    store.set(READY_KEY, str(nnodes))
    return store


def join_nodes(addr: str, node_rank: int, nnodes: int, timeout_s: float):
    """Node `node_rank` > 0: check in at node 0's store and wait until node 0 has every node."""
    import torch.distributed as dist

    host, port = parse_addr(addr)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, nnodes, is_master=False, timeout=timeout)
    store.set(node_key(node_rank), str(time.time()))
    store.wait([READY_KEY], timeout)
    return store


def node0_alive(store) -> bool:
    """False once node 0's store no longer answers."""
    try:
        return store.check([READY_KEY])
    except Exception:  # noqa: BLE001 - any transport error means node 0 is gone
        return False
