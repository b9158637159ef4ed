"""`agentrl engine serve`: run the embedded engine (SGLang's native HTTP API) as a process.

Takes `--nnodes/--node-rank/--dist-init-addr` like SGLang (embedded/nodes.py). SIGINT and SIGTERM
end the process within SHUTDOWN_GRACE_S in any state (loading, waiting for other nodes, decoding,
blocked in a weight-update rendezvous): every blocking step runs on a daemon thread while the
event loop waits for the signal, and the process leaves with os._exit once the server has been
given its grace period, so no stuck thread can hold it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Run the embedded inference engine.")
SHUTDOWN_GRACE_S = 3.0  # the scheduler finishes its current step (~ms to ~1 s) in this time
EXIT_NODE0_LOST = 3


@app.command("serve")
def serve(
    model: Annotated[str, typer.Option("--model", help="Named model (tiny, smollm2-135m) or an HF folder.")],
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port; 0 picks a free one.")],
    host: Annotated[str, typer.Option("--host", help="Bind address.")] = "127.0.0.1",
    device: Annotated[str, typer.Option(help="cpu or cuda (the GPU Ray gave this process).")] = "cpu",
    max_batch_size: Annotated[int, typer.Option(min=1, help="Most sequences decoded together.")] = 32,
    prefix_cache_tokens: Annotated[int, typer.Option(min=0, help="Tokens of finished KV kept for reuse.")] = 262144,
    static_decode_len: Annotated[int, typer.Option(min=0, help="KV columns of static decode buffers, whose "
                                                   "steps replay CUDA graphs on a GPU; 0 decodes eagerly.")] = 0,
    admit_wait_steps: Annotated[int, typer.Option(min=0, help="Decode steps arriving requests may gather for "
                                                  "one prefill forward while a batch runs; 0 admits at once.")] = 0,
    torch_threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads; default: torch's.")] = None,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    seed: Annotated[int, typer.Option(help="Sampling seed (and the tiny model's init seed).")] = 0,
    cache_dir: Annotated[Path | None, typer.Option(help="Where converted named models are cached.")] = None,
    weight_update_timeout_s: Annotated[float, typer.Option(min=0.1, help="Bound on every weight-update "
                                                           "rendezvous and broadcast.")] = 120.0,
    nnodes: Annotated[int, typer.Option(min=1, help="Nodes of this engine.")] = 1,
    node_rank: Annotated[int, typer.Option(min=0, help="This process's node within the engine.")] = 0,
    dist_init_addr: Annotated[str | None, typer.Option(help="host:port of node 0's rendezvous.")] = None,
    nodes_timeout_s: Annotated[float, typer.Option(min=1, help="How long nodes wait for each other.")] = 600.0,
) -> None:
    """Load the model and serve /generate, weight updates and control endpoints until SIGINT/SIGTERM."""
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"--device {device!r}: use cpu or cuda")
    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"--dtype {dtype!r}: use float32 or bfloat16")
    if node_rank >= nnodes:
        raise typer.BadParameter(f"--node-rank {node_rank} must be below --nnodes {nnodes}")
    if nnodes > 1 and not dist_init_addr:
        raise typer.BadParameter("--nnodes > 1 needs --dist-init-addr (node 0's host:port)")
    # Not asyncio.run: its teardown joins the default executor's threads (up to 300 s for a stuck one).
    loop = asyncio.new_event_loop()
    try:
        code = loop.run_until_complete(_serve(
            model=model, port=port, host=host, device=device, max_batch_size=max_batch_size,
            prefix_cache_tokens=prefix_cache_tokens, static_decode_len=static_decode_len,
            admit_wait_steps=admit_wait_steps,
            torch_threads=torch_threads, dtype=dtype, seed=seed, cache_dir=cache_dir, weight_update_timeout_s=weight_update_timeout_s, nnodes=nnodes,
            node_rank=node_rank, dist_init_addr=dist_init_addr, nodes_timeout_s=nodes_timeout_s))
    except Exception as exc:  # noqa: BLE001 - one line naming the cause, then a non-zero exit
        typer.echo(f"error: {type(exc).__name__}: {exc}", err=True)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _check_listen(host: str, port: int) -> None:
    """Fail now, naming --host/--port, where the server could not listen."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            probe.bind(infos[0][4])
    except OSError as exc:
        raise ValueError(_listen_error(host, port, exc)) from None


def _listen_error(host: str, port: int, exc: OSError) -> str:
    return f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})"


def _load(model: str, device: str, dtype: str, seed: int, cache_dir: Path | None, torch_threads: int | None):
    import torch

    from agentrl.models.policy import load_policy

    if torch_threads:
        torch.set_num_threads(torch_threads)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no GPU here (is CUDA_VISIBLE_DEVICES empty?)")
    policy, tokenizer = load_policy(model, getattr(torch, dtype), seed=seed, cache_dir=cache_dir)
    return policy.to(device), tokenizer


async def _until(stop: asyncio.Event, awaitable):
    """The awaitable's result, or None if `stop` is set first."""
    task = asyncio.ensure_future(awaitable)
    waiter = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task in done:
        return task.result()
    task.cancel()
    return None


async def _serve(*, model, port, host, device, max_batch_size, prefix_cache_tokens, static_decode_len,
                 admit_wait_steps, torch_threads, dtype, seed, cache_dir, weight_update_timeout_s, nnodes, node_rank, dist_init_addr, nodes_timeout_s) -> int:
    from agentrl.rollout.embedded import nodes
    from agentrl.rollout.embedded.http_util import in_daemon_thread

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    if node_rank > 0:  # a rendezvous member: no model, no HTTP (as SGLang's non-zero ranks)
        store = await _until(stop, in_daemon_thread(nodes.join_nodes, dist_init_addr, node_rank, nnodes,
                                                    nodes_timeout_s))
        if store is None:
            return 0
        typer.echo(f"embedded engine node {node_rank}/{nnodes}: joined {dist_init_addr}", err=True)
        while not stop.is_set():
            if not await in_daemon_thread(nodes.node0_alive, store):
                typer.echo(f"node 0 at {dist_init_addr} is gone; exiting", err=True)
                return EXIT_NODE0_LOST
            await _until(stop, asyncio.sleep(nodes.WATCH_INTERVAL_S))
        return 0

    # Printed once SIGINT/SIGTERM end the process cleanly: a signal before this line (still importing)
    # meets Python's default disposition instead, which ends the process too, but by the signal.
    _check_listen(host, port)  # before a load that can take minutes
    typer.echo(f"embedded engine: loading {model} on {device}", err=True)
    loaded = await _until(stop, in_daemon_thread(_load, model, device, dtype, seed, cache_dir, torch_threads))
    if loaded is None:
        return 0
    policy, tokenizer = loaded
    store = None
    if nnodes > 1:
        typer.echo(f"embedded engine: waiting for {nnodes - 1} more node(s) at {dist_init_addr}", err=True)
        store = await _until(stop, in_daemon_thread(nodes.host_nodes, dist_init_addr, nnodes, nodes_timeout_s))
        if store is None:
            return 0
    from agentrl.rollout.embedded.server import EmbeddedEngineServer

    server = EmbeddedEngineServer(policy, tokenizer, model_path=model, max_batch_size=max_batch_size,
                                  prefix_cache_tokens=prefix_cache_tokens, static_decode_len=static_decode_len,
                                  admit_wait_steps=admit_wait_steps, seed=seed,
                                  weight_update_timeout_s=weight_update_timeout_s, join_threads_on_stop=False)
    try:
        url = await server.start(host, port)
    except OSError as exc:  # taken in the meantime
        raise ValueError(_listen_error(host, port, exc)) from None
    typer.echo(f"embedded engine: {model} on {device} (max batch {max_batch_size}, {nnodes} node(s)) at {url}")
    await stop.wait()
    try:
        await asyncio.wait_for(server.stop(), SHUTDOWN_GRACE_S)
    except TimeoutError:
        typer.echo(f"shutdown took over {SHUTDOWN_GRACE_S:g} s; exiting anyway", err=True)
    del store  # node 0's store goes with this process; the other nodes then exit
    return 0
