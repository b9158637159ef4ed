"""The engine process of `train --rehearse`: started by the real EngineActor exactly where and how a
run starts its engines (same ports, same multi-node rendezvous as the embedded engine,
agentrl.rollout.embedded.nodes), but it loads no model. It answers /health, /health_generate,
/server_info and /model_info, and refuses /generate (503), so the rehearsal checks the engine actor,
group and placement code a run uses without GPUs or SGLang.

  python -m agentrl.cluster.dry_engine --host H --port P [--nnodes N --node-rank R --dist-init-addr A]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

RENDEZVOUS_TIMEOUT_S = 300.0


def _app(args):
    from aiohttp import web

    info = {"engine": "agentrl-dry", "model_path": args.model_path, "weight_version": "0", "nnodes": args.nnodes,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid()}

    async def ok(_request):
        return web.Response(status=200)

    async def server_info(_request):
        return web.json_response({**info, "internal_states": [{"num_running": 0, "num_waiting": 0}]})

    async def model_info(_request):
        return web.json_response({"model_path": args.model_path, "weight_version": "0", "is_generation": True})

    async def refuse(_request):
        return web.json_response({"error": {"message": "dry engine (train --rehearse): no model"}}, status=503)

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/health_generate", ok)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/model_info", model_info)
    app.router.add_post("/generate", refuse)
    return app


async def _serve(args) -> int:
    from aiohttp import web

    from agentrl.rollout.embedded import nodes

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    store = None
    if args.nnodes > 1:
        if args.node_rank > 0:
            store = await asyncio.to_thread(nodes.join_nodes, args.dist_init_addr, args.node_rank, args.nnodes,
                                            RENDEZVOUS_TIMEOUT_S)
            while not stop.is_set():  # no HTTP on node_rank > 0, as SGLang; exit when node 0 goes
                if not await asyncio.to_thread(nodes.node0_alive, store):
                    return 3
                try:
                    await asyncio.wait_for(stop.wait(), nodes.WATCH_INTERVAL_S)
                except TimeoutError:
                    pass
            return 0
        store = await asyncio.to_thread(nodes.host_nodes, args.dist_init_addr, args.nnodes, RENDEZVOUS_TIMEOUT_S)
    runner = web.AppRunner(_app(args), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    print(f"dry engine at http://{args.host}:{args.port} ({args.nnodes} node(s))", file=sys.stderr, flush=True)
    await stop.wait()
    await runner.cleanup()
    del store
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agentrl.cluster.dry_engine", description=__doc__.splitlines()[0])
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model-path", default="")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", default=None)
    args = p.parse_args(argv)
    if args.nnodes > 1 and not args.dist_init_addr:
        p.error("--nnodes > 1 needs --dist-init-addr")
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
