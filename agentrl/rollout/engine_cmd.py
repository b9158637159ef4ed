"""The command line of one engine process on one node, built where it runs (only that node knows
its IP and free ports); the dry run calls it with placeholder addresses, so it stays a pure function
of its arguments.

- SGLang: `{rollout.sglang.python} -m sglang.launch_server ...` (agentrl/rollout/sglang_cmd.py), in
  SGLang's own interpreter because it pins another torch.
- embedded: `{this interpreter} -m agentrl.cli engine serve ...`, on `--device cuda` when the plan
  gives the engine a GPU share (Ray then sets CUDA_VISIBLE_DEVICES for its actor), else cpu. It takes
  `--nnodes/--node-rank/--dist-init-addr` like SGLang.
"""

from __future__ import annotations

import sys

from agentrl.config.schema import RunConfig
from agentrl.rollout.sglang_cmd import build_sglang_command


def engine_argv(cfg: RunConfig, spec, *, node_rank: int, host: str, port: int | str,
                dist_init_addr: str | None, nccl_port: int | str | None = None) -> list[str]:
    """argv of node `node_rank` of engine `spec` (an agentrl.config.plan.EngineSpec).

    `port` is the HTTP port (node_rank 0 serves it); `dist_init_addr` ("ip:port" on the engine's
    node 0) is required for an engine spanning several nodes; `nccl_port` (SGLang only) a port free
    on this node."""
    nnodes = len(spec.nodes)
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"engine {spec.index}: node_rank {node_rank} is outside its {nnodes} node(s)")
    if nnodes > 1 and not dist_init_addr:
        raise ValueError(f"engine {spec.index} spans {nnodes} nodes: it needs dist_init_addr (ip:port on its node 0)")
    if spec.kind == "embedded":
        return _embedded_argv(cfg, spec, node_rank=node_rank, host=host, port=port, dist_init_addr=dist_init_addr)
    if spec.kind == "dry":  # train --rehearse: the same actor and rendezvous, no model (agentrl.cluster.dry_engine)
        argv = [sys.executable, "-m", "agentrl.cluster.dry_engine", "--host", host, "--port", str(port),
                "--model-path", spec.model_path]
        if nnodes > 1:
            argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
        return argv
    if spec.kind != "sglang":
        raise ValueError(f"engine {spec.index}: unknown kind {spec.kind!r}; use sglang, embedded or dry")
    s = cfg.rollout.sglang
    if spec.gpus_per_node >= 1 and spec.gpus_per_node * nnodes != s.gpus_per_engine:
        raise ValueError(f"engine {spec.index} holds {spec.gpus_per_node:g} GPU(s) on each of {nnodes} node(s) but "
                         f"rollout.sglang.gpus_per_engine={s.gpus_per_engine}; the plan and the config disagree")
    from agentrl.models.arch import get_arch

    return build_sglang_command(s, spec.model_path, host=host, port=port, nnodes=nnodes, node_rank=node_rank,
                                dist_init_addr=dist_init_addr, nccl_port=nccl_port,
                                dsa=get_arch(cfg.model.name).has_dsa)


def _embedded_argv(cfg: RunConfig, spec, *, node_rank: int, host: str, port: int | str,
                   dist_init_addr: str | None) -> list[str]:
    e = cfg.rollout.embedded
    argv = [sys.executable, "-m", "agentrl.cli", "engine", "serve", "--model", spec.model_path,
            "--host", host, "--port", str(port), "--device", "cuda" if spec.gpus_per_node > 0 else "cpu",
            "--dtype", e.dtype, "--max-batch-size", str(e.max_batch_size),
            "--prefix-cache-tokens", str(e.prefix_cache_tokens), "--static-decode-len", str(e.static_decode_len),
            "--admit-wait-steps", str(e.admit_wait_steps),
            "--weight-update-timeout-s", f"{e.weight_update_timeout_s:g}"]
    if e.torch_threads:
        argv += ["--torch-threads", str(e.torch_threads)]
    if len(spec.nodes) > 1:
        argv += ["--nnodes", str(len(spec.nodes)), "--node-rank", str(node_rank)]
    if dist_init_addr:
        argv += ["--dist-init-addr", dist_init_addr]
    return argv
