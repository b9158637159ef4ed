#!/usr/bin/env python
"""Megatron backend on the GPU machine, in one command (see bench/megatron.py):

  python bench/gpu/megatron_gpu.py all --out-dir $OUT

runs `dual` under torchrun on 2 GPUs, then `single` (this process, GPU 0), then `merge`, writing
single.json, dual.json and megatron.json into --out-dir. On a CPU machine the same command runs
with small sizes (gloo) as a smoke test: --small.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("all", "single", "dual", "merge"))
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--small", action="store_true", help="CPU smoke sizes: no 5-layer model, 16 MiB export")
    p.add_argument("--export-gib", type=float, default=8.0)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--five-layer-experts", type=int, default=8)
    p.add_argument("--offload-json", type=Path, default=ROOT / "bench/results/offload_h200.json")
    a = p.parse_args(argv)
    from bench import megatron as mb

    single, dual, merged = a.out_dir / "single.json", a.out_dir / "dual.json", a.out_dir / "megatron.json"
    if a.mode == "single":
        mb.run_single(single, five_layer=not a.small, five_layer_experts=a.five_layer_experts)
    if a.mode == "dual":
        mb.run_dual(dual, export_gib=0.03 if a.small else a.export_gib, bucket_mb=4 if a.small else a.bucket_mb,
                    small=a.small)
    if a.mode == "all":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               os.environ.get("AGENTRL_BENCH_PORT", "29611"), str(Path(__file__).resolve()), "dual",
               "--out-dir", str(a.out_dir), "--export-gib", str(a.export_gib), "--bucket-mb", str(a.bucket_mb)]
        if a.small:
            cmd.append("--small")
        rc = subprocess.run(cmd, env={**os.environ, "NCCL_NVLS_ENABLE": "0"}, check=False).returncode
        print(f"[megatron-bench] dual exited with {rc}", flush=True)
        # After the two-GPU part (short), so a slow single-GPU part cannot starve it of time.
        mb.run_single(single, five_layer=not a.small, five_layer_experts=a.five_layer_experts)
    if a.mode in ("all", "merge"):
        report = mb.merge(single, dual, a.offload_json, merged)
        print({k: report.get(k) for k in (*mb.HEADLINES, "missing_headlines")}, flush=True)
        return 0 if not report["missing_headlines"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
