"""The command line the GPU probes share: `--out X.json` measures on a GPU and writes the report there,
`--compile-only` compiles each case for sm_90 here (bench/kernel_resources.py) and prints its resources."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable


def run_probe(doc: str, argv: list[str] | None, compile_only: Callable[[], int],
              measure: Callable[[], dict]) -> int:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, help="where the JSON report goes (required unless --compile-only)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 here and print the resources")
    a = ap.parse_args(argv)
    if a.compile_only:
        return compile_only()
    if a.out is None:
        ap.error("--out is required unless --compile-only")
    a.out.write_text(json.dumps(measure(), indent=1) + "\n")
    return 0
