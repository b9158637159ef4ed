"""bench/gpu/parallel_gpu.py at toy sizes on CPU: every part runs and its CPU-checkable numbers hold
(the integrator runs it at full size on one H200)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_part_runs_at_toy_size(tmp_path):
    out = tmp_path / "parallel_gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/gpu/parallel_gpu.py"), "--small", "--out", str(out),
                           "--offload-dir", str(tmp_path / "optim")], capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = json.loads(out.read_text())["parts"]
    assert all(p["ok"] for p in parts.values()), {n: p.get("error") for n, p in parts.items()}
    assert max(parts["tp1_parity"]["tiny_parity"]["rel_diff_vs_torch"]) <= 1e-5
    experts = parts["grouped_experts"]["experts_4"]
    assert experts["out_max_rel_diff"] <= 1e-5 and experts["dx_max_rel_diff"] <= 1e-5
    cp = parts["cp_offset"]
    assert cp["calls"]["fallback"] == 0 and cp["calls"]["offset_runs"] > 0 and cp["topk_overlap_vs_dense_min"] == 1.0
    mem = parts["memory_slice"]
    assert mem["state_accounted"] == mem["state_measured"] and mem["disk_state_gib"] > 0
