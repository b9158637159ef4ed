#!/usr/bin/env python3
"""Summarise a GPU run of the loop (RUN_DIR of `train --config gpu_smoke`) into the JSON the issue
names: step time, weight-update time and GB/s, trainer idle ratio, peak GPU memory, machine and
versions. Usage: gpu_loop_report.py RUN_DIR OUT.json [--nvidia-smi-mib N]"""

from __future__ import annotations

import json
import platform
import statistics
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    run, out = Path(argv[0]), Path(argv[1])
    extra = dict(zip(argv[2::2], argv[3::2], strict=False))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    steady = rows[1:] or rows  # the first step carries compile and warm-up costs

    def med(key: str) -> float | None:
        vals = [r[key] for r in steady if isinstance(r.get(key), int | float)]
        return round(statistics.median(vals), 4) if vals else None

    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "transformers", "megatron.core", "ray", "pydantic"):
        try:
            versions[mod] = __import__(mod, fromlist=["_"]).__version__
        except Exception:  # noqa: BLE001 - report what is there
            versions[mod] = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    report = {
        "what": "train --config gpu_smoke: Megatron trainer rank + embedded engine sharing one GPU under Ray",
        "machine": {"gpu": gpu, "gpus": torch.cuda.device_count(), "cpu_count": __import__("os").cpu_count(),
                    "platform": platform.platform()},
        "versions": versions,
        "steps": summary["steps"], "wall_s": round(summary["wall_s"], 1), "startup_s": round(summary["startup_s"], 1),
        "step_time_s_median": med("step_time_s"),
        "weight_update_s_median": med("sync_s"), "weight_update_paused_s_median": med("sync_paused_s"),
        "weight_update_gbps_median": med("sync_gbps"), "weight_update_bytes": steady[-1].get("sync_bytes"),
        "trainer_idle_ratio_final": round(rows[-1]["trainer_idle_ratio"], 3),
        "trainer_peak_gpu_gb": max((r.get("trainer_peak_gpu_gb") or 0.0) for r in rows),
        "reward_mean_by_step": [round(r["reward_mean"], 3) for r in rows],
        "staleness_max_by_step": [r["staleness_max"] for r in rows],
        "episodes_finished": rows[-1]["episodes_finished"], "episodes_infra_error": rows[-1]["episodes_infra_error"],
        **extra,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
