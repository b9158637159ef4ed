"""The `sglang.launch_server` command line of one engine, built from the typed SGLangConfig.

Flag names are SGLang 0.5.23's: the DSA attention backend is `dsa` and its kernels are chosen by
`--dsa-prefill-backend` / `--dsa-decode-backend` (the old `--nsa-*` flags are gone). Each flag
is spelled once, here; the config never carries flag strings.
"""

from __future__ import annotations

from agentrl.config.schema import SGLangConfig


def engine_world_size(cfg: SGLangConfig) -> int:
    return cfg.gpus_per_engine


def build_sglang_command(
    cfg: SGLangConfig,
    model_path: str,
    *,
    host: str,
    port: int,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
    dsa: bool = True,
) -> list[str]:
    """argv of one engine process (one per node when an engine spans nodes)."""
    world = engine_world_size(cfg)
    cmd = [*cfg.launcher, "-m", "sglang.launch_server", "--model-path", model_path,
           "--host", host, "--port", str(port), "--tp-size", str(world)]
    if nnodes > 1:
        if not dist_init_addr:
            raise ValueError("an engine spanning several nodes needs dist_init_addr (host:port of its node 0)")
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
    cmd += ["--ep-size", str(cfg.ep_size or world)]
    if cfg.enable_dp_attention:
        cmd += ["--enable-dp-attention", "--dp-size", str(cfg.dp_size or world)]
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
