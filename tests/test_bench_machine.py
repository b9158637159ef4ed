"""The shared machine() helper: stdlib-only at import, and the fields every report records."""

import subprocess
import sys

from bench.machine import machine


def test_machine_reports_host_cpu_memory_and_versions():
    m = machine()
    assert m["hostname"] and m["cpu_count"] >= 1 and m["affinity_cpus"] >= 1
    assert m["memory_gb"] is None or m["memory_gb"] > 0
    assert isinstance(m["gpus"], list)
    assert m["versions"]["python"].count(".") == 2
    assert "torch" in m["versions"]  # installed in the project's venv


def test_importing_machine_and_gpu_benches_pulls_in_no_third_party_module():
    # kernels/offload run on the GPU machine with only stdlib + torch: importing them (and the
    # helper) must not import pydantic, ray, typer, numpy or transformers.
    code = ("import sys; import bench.machine, bench.offload, bench.kernels; "
            "bad = [m for m in ('pydantic', 'ray', 'typer', 'transformers', 'torch') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
