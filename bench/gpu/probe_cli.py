"""The command line the Gluon pass probes share: `--out X.json` measures on a GPU, `--compile-only`
compiles each schedule for sm_90 here (bench/kernel_resources.py) and prints its resources."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable


def run_probe(doc: str, argv: list[str] | None, compile_only: Callable[[], int],
              measure: Callable[[Path], int]) -> int:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, help="where the JSON report goes (required unless --compile-only)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 here and print the resources")
    a = ap.parse_args(argv)
    if a.compile_only:
        return compile_only()
    if a.out is None:
        ap.error("--out is required unless --compile-only")
    return measure(a.out)
