"""A small explicit autotuner shared by the kernels.

Why not ``triton.autotune``: it cannot run under ``TRITON_INTERPRET=1`` (it times with CUDA
events), it hides which config won, and one config that fails to compile (too much shared
memory for a 576-wide tile, say) aborts the whole call. Here each config is tried once per
shape key on CUDA, failures are skipped and remembered, and the winner is inspectable
(the benchmark reports it). On CPU the first config is used: it is the small, safe one.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options of one kernel variant (names match the kernel's constexprs)."""

    params: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 3

    @staticmethod
    def make(num_warps: int = 4, num_stages: int = 3, **params: int) -> KernelConfig:
        return KernelConfig(tuple(sorted(params.items())), num_warps, num_stages)

    def __getitem__(self, name: str) -> int:
        return dict(self.params)[name]

    def describe(self) -> str:
        inner = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{inner},warps={self.num_warps},stages={self.num_stages}"


@dataclass
class TuneRecord:
    best: KernelConfig
    timings_ms: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class Autotuner:
    """Pick the fastest config per (kernel, shape key); one instance per kernel family."""

    def __init__(self, name: str, configs: list[KernelConfig], reps: int = 3):
        if not configs:
            raise ValueError(f"autotuner {name!r} needs at least one config")
        self.name = name
        self.configs = configs
        self.reps = reps
        self.records: dict[Any, TuneRecord] = {}

    def choose(self, key: Any, device: torch.device, launch: Callable[[KernelConfig], None]) -> KernelConfig:
        """Return the config to use for ``key``; on CUDA, time every config the first time.

        ``launch(cfg)`` must run the kernel once and only write its own outputs, so running
        it several times is harmless.
        """
        record = self.records.get(key)
        if record is not None:
            return record.best
        if device.type != "cuda" or len(self.configs) == 1:
            self.records[key] = TuneRecord(self.configs[0])
            return self.configs[0]
        timings: dict[str, float] = {}
        errors: dict[str, str] = {}
        best, best_ms = None, float("inf")
        for cfg in self.configs:
            try:
                launch(cfg)  # compile + warm up
                torch.cuda.synchronize(device)
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.reps):
                    launch(cfg)
                stop.record()
                stop.synchronize()
                ms = start.elapsed_time(stop) / self.reps
            except Exception as exc:  # noqa: BLE001 -- a config the compiler or device rejects: skip it
                errors[cfg.describe()] = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            timings[cfg.describe()] = ms
            if ms < best_ms:
                best, best_ms = cfg, ms
        if best is None:
            raise RuntimeError(f"{self.name}: every config failed for key {key}: {errors}")
        self.records[key] = TuneRecord(best, timings, errors)
        return best

    def summary(self) -> dict[str, Any]:
        """JSON-friendly view of what was tuned (used by the benchmark report)."""
        return {
            str(key): {"best": rec.best.describe(), "ms": rec.timings_ms, "errors": rec.errors}
            for key, rec in self.records.items()
        }
