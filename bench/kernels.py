"""Kernel benchmark at GLM-5.2 dimensions: `python -m bench.kernels --out PATH`.

Runs the Triton kernels of kernels/ on a CUDA device (warm-up, the kernels' own autotuning,
then CUDA-event timing, median of several runs), checks each against its torch reference, times
that reference where it fits in memory, and writes JSON:
{"machine", "versions", "ceilings", "kernels": [{"name", "shape", "ms", "tflops" | "gbps",
"fraction_of_ceiling", "reference_ms", "speedup", "correct", ...}], "tuning"}.
A kernel that fails records its error and the run goes on; the JSON is rewritten after every
kernel, so a run cut short still leaves what it measured. Imports only the stdlib at module
level (torch, triton and kernels/ are imported when the run starts): no Ray, no agentrl deps.
The cases and the entry format (`make_entry`, the ceilings) are in bench/kernel_cases.py; the
indexer family also times each top-k config and `impl="fused"` (entry indexer_topk_fused).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import kernel_cases
from bench.machine import machine


@dataclass(frozen=True)
class BenchShapes:
    lp_tokens: int = 16384
    hidden: int = 6144
    vocab: int = 154880
    idx_contexts: tuple[int, ...] = (65536, 32768, 131072)  # first one is compared with torch
    idx_heads: int = 32
    idx_dim: int = 128
    topk: int = 2048
    idx_chunk_rows: int = 4096
    mla_tokens: int = 4096
    mla_context: int = 65536
    mla_heads: int = 64
    mla_dv: int = 512
    mla_dr: int = 64
    quant_shape: tuple[int, int] = (154880, 6144)
    check_rows: int = 256  # rows checked against the fp32 references


GLM52 = BenchShapes()
TINY = BenchShapes(lp_tokens=40, hidden=64, vocab=300, idx_contexts=(96,), idx_heads=4, idx_dim=16, topk=32,
                   idx_chunk_rows=32, mla_tokens=8, mla_context=64, mla_heads=16, mla_dv=32, mla_dr=16,
                   quant_shape=(200, 300), check_rows=16)


class Timer:
    """Median wall time of ``fn`` in ms: CUDA events on a GPU, perf_counter elsewhere."""

    def __init__(self, torch_mod, device):
        self.torch, self.device = torch_mod, device

    def __call__(self, fn: Callable[[], Any], warmup: int = 1, min_iters: int = 3, max_iters: int = 20,
                 budget_ms: float = 400.0) -> float:
        cuda = self.device.type == "cuda"
        for _ in range(warmup):
            fn()
        if cuda:
            self.torch.cuda.synchronize(self.device)
        times: list[float] = []
        while len(times) < min_iters or (sum(times) < budget_ms and len(times) < max_iters):
            if cuda:
                start = self.torch.cuda.Event(enable_timing=True)
                stop = self.torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def _machine_info(device) -> tuple[dict, dict]:
    host = {**machine(), "device": str(device)}
    return host, host["versions"]


def run_kernel_bench(out_path: str | Path, shapes: BenchShapes = GLM52, only: set[str] | None = None,
                     device: str | None = None) -> dict:
    """Benchmark every kernel family (or those in ``only``) and write the JSON report to out_path."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out_path = Path(out_path)
    host, versions = _machine_info(dev)
    report: dict[str, Any] = {"machine": host, "versions": versions, "ceilings": kernel_cases.CEILINGS,
                              "shapes": asdict(shapes), "kernels": [], "tuning": {}}
    if dev.type != "cuda":
        report["warning"] = "no CUDA device: timings are CPU/interpreter times, not kernel performance"
    timer = Timer(torch, dev)
    cases = kernel_cases.CASES
    for family, case in cases.items():
        if only and family not in only:
            continue
        print(f"[bench] {family}: start", flush=True)
        t0 = time.time()
        try:
            for entry in case(torch, dev, shapes, timer):
                report["kernels"].append(entry)
                print(f"[bench]   {json.dumps(entry)}", flush=True)
                _save(out_path, report)  # a device call cut short keeps every entry measured so far
        except Exception as exc:  # noqa: BLE001 -- record and go on: one GPU call should yield all it can
            report["kernels"].append({"name": family, "error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc()[-4000:]})
            print(f"[bench]   {family} FAILED: {type(exc).__name__}: {exc}", flush=True)
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        report["tuning"] = kernel_cases.tuning_summary()
        print(f"[bench] {family}: done in {time.time() - t0:.1f}s", flush=True)
        _save(out_path, report)
    _save(out_path, report)
    return report


def _save(out_path: Path, report: dict) -> None:
    """The report so far, replaced whole (a reader never sees half a file)."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out_path)


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON report to write")
    parser.add_argument("--only", default="", help="comma-separated families: logprobs,indexer,sparse_mla,sparse_mla_bwd,fp8")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes on a GPU (a smoke test of the harness; on CPU: pytest "
                             "tests/kernels/test_kernels_bench.py)")
    args = parser.parse_args(argv)
    only = {x.strip() for x in args.only.split(",") if x.strip()} or None
    unknown = (only or set()) - {"logprobs", "indexer", "sparse_mla", "sparse_mla_bwd", "fp8"}
    if unknown:
        parser.error(f"--only: unknown kernel families {sorted(unknown)}")
    cuda = _has_cuda()
    if not args.tiny and not cuda:
        print("[bench] no CUDA device: the GLM-5.2 shapes need an H200-class GPU (on CPU the harness is "
              "checked by `pytest tests/kernels/test_kernels_bench.py`)", file=sys.stderr)
        return 2
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton's interpreter would run them (TRITON_INTERPRET=1, set before triton is imported), but the whole
        # tiny set takes over 15 minutes there on 2 cores; the tests cover the harness on CPU in seconds
        print("[bench] no CUDA device: --tiny runs the kernels on a GPU; on CPU the harness is checked by "
              "`pytest tests/kernels/test_kernels_bench.py` (Triton's interpreter)", file=sys.stderr)
        return 2
    report = run_kernel_bench(args.out, TINY if args.tiny else GLM52, only)
    failed = [k["name"] for k in report["kernels"] if "error" in k or k.get("correct") is False]
    print(f"[bench] wrote {args.out}; {len(report['kernels'])} entries; failed/incorrect: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
