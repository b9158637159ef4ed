"""The command line of one engine process on one node, built where it runs (only that node knows
its IP and free ports); the dry run calls it with placeholder addresses."""

from __future__ import annotations

import sys

from agentrl.config.schema import RunConfig
from agentrl.rollout.sglang_cmd import build_sglang_command


def engine_argv(cfg: RunConfig, spec, *, node_rank: int, host: str, port: int,
                dist_init_addr: str | None) -> list[str]:
    """argv of node `node_rank` of engine `spec` (an agentrl.config.plan.EngineSpec)."""
    nnodes = len(spec.nodes)
    if spec.kind == "embedded":
        e = cfg.rollout.embedded
        argv = [sys.executable, "-m", "agentrl.cli", "engine", "serve", "--model", spec.model_path,
                "--host", host, "--port", str(port), "--max-batch-size", str(e.max_batch_size),
                "--prefix-cache-tokens", str(e.prefix_cache_tokens)]
        if e.torch_threads:
            argv += ["--torch-threads", str(e.torch_threads)]
        return argv
    from agentrl.models.arch import get_arch

    return build_sglang_command(cfg.rollout.sglang, spec.model_path, host=host, port=port, nnodes=nnodes,
                                node_rank=node_rank, dist_init_addr=dist_init_addr,
                                dsa=get_arch(cfg.model.name).has_dsa)
