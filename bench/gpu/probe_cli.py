"""The command line the GPU probes share: `--out X.json` measures on a GPU and writes the report there,
`--compile-only` compiles each case for sm_90 here (bench/kernel_resources.py) and prints its resources."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable


def run_probe(doc: str, argv: list[str] | None, compile_only: Callable[[], int],
              measure: Callable[[], dict], schedules: list[dict] | None = None) -> int:
    """The probes' command line; schedules: the probe's list, which --schedules replaces (in place)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, help="where the JSON report goes (required unless --compile-only)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 here and print the resources")
    if schedules is not None:
        ap.add_argument("--schedules", type=json.loads, help="a JSON list of schedules to run instead of the "
                        f"probe's own ({len(schedules)})")
    a = ap.parse_args(argv)
    if getattr(a, "schedules", None) is not None:
        if not isinstance(a.schedules, list) or not all(isinstance(x, dict) for x in a.schedules):
            ap.error("--schedules must be a JSON list of objects, e.g. '[{}, {\"kernel\": \"pair\"}]'")
        schedules[:] = a.schedules
    if a.compile_only:
        return compile_only()
    if a.out is None:
        ap.error("--out is required unless --compile-only")
    a.out.write_text(json.dumps(measure(), indent=1) + "\n")
    return 0


def schedule_row(schedule: dict, run: Callable[..., Any], check: Callable[[], dict], flops: float,
                 baseline_ms: float, warmup: int, rep: int) -> dict:
    """One schedule's report row, printed: run(**schedule) once, check() -> its differences from the reference,
    then its time (triton's do_bench), TFLOP/s and speedup over baseline_ms; a schedule that fails to compile
    or run reports its error (a finding, not a crash)."""
    import triton

    row: dict[str, Any] = {"schedule": schedule}
    try:
        run(**schedule)
        row |= check()
        ms = triton.testing.do_bench(lambda: run(**schedule), warmup=warmup, rep=rep)
        row |= {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                "speedup_over_triton": round(baseline_ms / ms, 3)}
    except Exception as exc:  # noqa: BLE001 -- a schedule that fails to compile or run is a finding
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[-1][:300] if str(exc) else ''}"
    print(json.dumps(row), flush=True)
    return row
