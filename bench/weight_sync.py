"""Weight sync: time and GB/s of a full update through the local tensor path.

What the run loop does after every optimizer step (agentrl/sync/weights.py): pause the engine in
`retract` mode, write the model's HF-named tensors as safetensors buckets (in /dev/shm), have the
engine load each bucket, bump its weight version, continue. Measured against a real embedded engine
process for each model; the phases reported are the whole update (`sync_s`), the time the engine
stays paused (`sync_paused_s`) and the bytes moved. The update is checked for effect: the engine's
weight_version must equal the version sent.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

from bench.machine import machine


async def _bench_model(url: str, model: Any, rounds: int, bucket_mb: int) -> dict:
    from agentrl.rollout.client import EngineClient
    from agentrl.sync.weights import push_weights

    runs = []
    for i in range(rounds):
        r = await push_weights([url], ((n, t.detach()) for n, t in model.state_dict().items()), 1000 + i,
                               bucket_bytes=bucket_mb << 20)
        if r["failed_engines"]:
            raise RuntimeError(f"weight update failed: {r['failed_engines']}")
        runs.append(r)
    client = EngineClient(url)
    try:
        info = await client.server_info()
    finally:
        await client.aclose()
    version = str(info.get("weight_version"))
    if version != str(1000 + rounds - 1):
        raise RuntimeError(f"engine reports weight_version {version}, expected {1000 + rounds - 1}")
    sync = [r["sync_s"] for r in runs]
    return {"bytes": runs[0]["sync_bytes"], "buckets": runs[0]["sync_buckets"], "rounds": rounds,
            "sync_s_median": statistics.median(sync), "sync_s_min": min(sync),
            "sync_paused_s_median": statistics.median(r["sync_paused_s"] for r in runs),
            "gbps_median": runs[0]["sync_bytes"] / statistics.median(sync) / 1e9,
            "gbps_best": runs[0]["sync_bytes"] / min(sync) / 1e9, "engine_weight_version": version}


def run_weight_sync_bench(out_path: str | Path, models: tuple[str, ...] = ("tiny", "smollm2-135m"), rounds: int = 5,
                          bucket_mb: int = 256, torch_threads: int = 1) -> dict:
    """Full updates of each model into its own embedded engine; writes and returns the report."""
    import torch

    from agentrl.models.policy import load_policy
    from bench.engine import _EngineProcess

    if rounds < 1 or bucket_mb < 1 or not models:
        raise ValueError("need rounds >= 1, bucket_mb >= 1 and at least one model")
    torch.set_num_threads(torch_threads)
    report: dict[str, Any] = {"benchmark": "weight_sync", "machine": machine(),
                              "settings": {"rounds": rounds, "bucket_mb": bucket_mb, "pause_mode": "retract",
                                           "path": "safetensors buckets in /dev/shm -> update_weights_from_tensor"},
                              "models": {}}
    for name in models:
        model, _ = load_policy(name)
        with _EngineProcess(name, 4, torch_threads, 0, 600.0) as url:
            report["models"][name] = asyncio.run(_bench_model(url, model, rounds, bucket_mb))
        del model
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    return report
