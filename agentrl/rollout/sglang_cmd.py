"""The `sglang.launch_server` command line of one engine process, built from the typed SGLangConfig.

Flag names are SGLang 0.5.23's (tests/data/sglang_0_5_23_flags.json is its parsed flag list):
- the DSA attention backend is `dsa`, its kernels `--dsa-prefill-backend` / `--dsa-decode-backend`
  (the `--nsa-*` flags are gone);
- attention data parallelism is `--attn-dp-size N` (`--enable-dp-attention --dp-size N` is the
  deprecated spelling that resolves to the same: attention-DP N, dp 1);
- a multi-node engine runs one process per node with `--nnodes/--node-rank/--dist-init-addr`; the
  dist-init address is node 0's torch rendezvous, and with attention DP SGLang also binds the six
  ports after it on node 0 for its ZMQ sockets (server_args.PortArgs: port_base = dist_init_port + 1);
- `--nccl-port` is a port free on each node (without it every process picks one at random);
- `--skip-server-warmup`: readiness is probed on /health_generate by the engine actor instead.
Each flag is spelled once, here; the config never carries flag strings.
"""

from __future__ import annotations

from agentrl.config.schema import SGLangConfig


def build_sglang_command(
    cfg: SGLangConfig,
    model_path: str,
    *,
    host: str,
    port: int | str,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
    nccl_port: int | str | None = None,
    dsa: bool = True,
) -> list[str]:
    """argv of one engine process (one per node when an engine spans nodes)."""
    world = cfg.gpus_per_engine
    cmd = [cfg.python, "-m", "sglang.launch_server", "--model-path", model_path,
           "--host", host, "--port", str(port), "--tp-size", str(world)]
    if nnodes > 1:
        if not dist_init_addr:
            raise ValueError("an engine spanning several nodes needs dist_init_addr (host:port of its node 0)")
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"node_rank {node_rank} is outside the engine's {nnodes} nodes")
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    if dist_init_addr:
        cmd += ["--dist-init-addr", dist_init_addr]
    if nccl_port is not None:
        cmd += ["--nccl-port", str(nccl_port)]
    cmd += ["--skip-server-warmup", "--ep-size", str(cfg.ep_size or world)]
    if cfg.enable_dp_attention:
        cmd += ["--attn-dp-size", str(cfg.dp_size or world)]
        if cfg.moe_dense_tp_size is not None:
            cmd += ["--moe-dense-tp-size", str(cfg.moe_dense_tp_size)]
        if cfg.enable_dp_lm_head:
            cmd += ["--enable-dp-lm-head"]
    if cfg.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", cfg.kv_cache_dtype]
    if cfg.quantization != "none":
        cmd += ["--quantization", cfg.quantization]
    if dsa:
        cmd += ["--attention-backend", cfg.attention_backend,
                "--dsa-prefill-backend", cfg.dsa_prefill_backend,
                "--dsa-decode-backend", cfg.dsa_decode_backend]
    if cfg.moe_a2a_backend != "none":
        cmd += ["--moe-a2a-backend", cfg.moe_a2a_backend, "--deepep-mode", cfg.deepep_mode]
    cmd += ["--page-size", str(cfg.page_size),
            "--mem-fraction-static", f"{cfg.mem_fraction_static:g}",
            "--max-running-requests", str(cfg.max_running_requests),
            "--watchdog-timeout", str(cfg.watchdog_timeout)]
    cmd += list(cfg.extra_args)
    return cmd
