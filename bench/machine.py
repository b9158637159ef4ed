"""What machine a benchmark ran on, for every report under bench/results/.

Standard library only at module level: kernels.py and offload.py run on the GPU machine, which has
torch and triton but not the rest of agentrl's dependencies. torch is imported inside `machine()`
only to describe a GPU, and only when it is installed; package versions come from the installed
distributions' metadata, so nothing heavy is imported just to read a version.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
from typing import Any

# Distribution names whose versions a report records when they are installed.
VERSIONED_PACKAGES = ("torch", "triton", "ray", "megatron-core", "transformers")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)  # kB -> GiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def versions() -> dict[str, str]:
    """python plus every package of VERSIONED_PACKAGES that is installed."""
    found = {"python": platform.python_version()}
    for dist in VERSIONED_PACKAGES:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _gpus() -> list[dict[str, Any]]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"name": p.name, "memory_gb": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count,
                    "capability": f"{p.major}.{p.minor}"})
    return out


def machine() -> dict[str, Any]:
    """Host, CPU, memory, GPUs (through torch, when installed) and package versions."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count()
    info: dict[str, Any] = {"hostname": socket.gethostname(), "platform": platform.platform(),
                            "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(), "affinity_cpus": affinity,
                            "memory_gb": _memory_gb(), "gpus": _gpus(), "versions": versions()}
    try:
        import torch

        info["versions"]["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return info
