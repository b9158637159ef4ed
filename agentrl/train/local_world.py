"""Run one function on N local trainer ranks (spawned processes, gloo on a free loopback port), the
way tests and CPU benchmarks exercise the Megatron backend at a parallel layout.

`run_ranks(fn, world, *args)` starts `world` processes with the "spawn" start method (a fresh
interpreter each: megatron's process-global parallel_state is never shared with the caller),
calls `fn(dist_init, *args)` in each and returns the results by rank. `fn` must be importable by
name (a module-level function), and a script calling run_ranks needs the `if __name__ ==
"__main__":` guard (spawn re-imports the main module). A rank that raises fails the call with its
traceback; a rank that dies or hangs fails it (after `timeout_s`). Ranks are not daemonic
(dist_checkpointing starts writer processes of its own); they are joined, or killed, before
run_ranks returns. Each rank uses `threads` torch threads (few cores, several ranks).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from agentrl.train.megatron_parallel import DistInit

DEFAULT_TIMEOUT_S = 600.0
POLL_S = 1.0  # how often a silent wait checks whether a rank died
FAILURE_GRACE_S = 20.0  # after one rank fails, how long to wait for the others' tracebacks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], dist_init: DistInit, args: tuple, threads: int, results: Any) -> None:
    try:
        import torch

        torch.set_num_threads(threads)
        # Plain pickle bytes: a tensor sent as itself would travel as a shared-memory handle that
        # dies with this process before the caller reads it.
        value = pickle.dumps(fn(dist_init, *args))
        results.put((dist_init.rank, True, value))
    except BaseException:  # noqa: BLE001 - reported to the caller with the traceback
        results.put((dist_init.rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs: list, results: Any, world: int, timeout_s: float) -> dict[int, Any]:
    out: dict[int, Any] = {}
    failed: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) + len(failed) < world:
        try:
            rank, ok, value = results.get(timeout=POLL_S)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in out and r not in failed]
            if dead or time.monotonic() > deadline:
                break
            continue
        if ok:
            out[rank] = pickle.loads(value)
        else:
            failed[rank] = value
            # the other ranks fail soon after (their collectives lose a peer); report them together
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    if failed:
        raise RuntimeError("\n".join(f"rank {r} of {world} failed:\n{tb}" for r, tb in sorted(failed.items())))
    missing = [r for r in range(world) if r not in out]
    if missing:
        codes = [procs[r].exitcode for r in missing]
        raise TimeoutError(f"ranks {missing} of {world} gave no result within {timeout_s:.0f} s (exit codes {codes})")
    return out


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
              threads: int = 1) -> list[Any]:
    """`fn(DistInit(rank, world, ...), *args)` on `world` spawned ranks; their results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, DistInit(r, world, "127.0.0.1", port, r, timeout_s), args,
                                                   threads, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = _collect(procs, results, world, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
