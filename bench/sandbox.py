"""Sandbox overhead: create / exec / delete latency of the local (bubblewrap) backend and of the
Daytona backend (the real SDK) against its local stand-in.

Each round creates a sandbox, runs `true` in it `execs` times and closes it, timing each phase;
then `concurrency` sandboxes go through the same cycle at once, which is how episodes use them.
The stand-in answers on 127.0.0.1 with no network or image build, so its numbers are the SDK's and
our provider's own overhead (HTTP round trips, polling, retries), not Daytona's cloud latency.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.machine import machine

STANDIN_KEY = "standin-bench-key"  # the stand-in's own key, not a secret


async def _cycle(provider: Any, spec: Any, execs: int) -> dict[str, float]:
    t0 = time.perf_counter()
    box = await provider.create(spec)
    t1 = time.perf_counter()
    exec_s = []
    try:
        for _ in range(execs):
            e0 = time.perf_counter()
            r = await box.exec("true", timeout_s=60)
            exec_s.append(time.perf_counter() - e0)
            if r.exit_code != 0:
                raise RuntimeError(f"`true` exited {r.exit_code} in the sandbox: {r.output[:200]}")
    finally:
        d0 = time.perf_counter()
        await box.close()
        d1 = time.perf_counter()
    return {"create_s": t1 - t0, "exec_s": statistics.median(exec_s) if exec_s else 0.0, "delete_s": d1 - d0}


def _stats(cycles: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {"cycles": len(cycles)}
    for k in ("create_s", "exec_s", "delete_s"):
        xs = sorted(c[k] for c in cycles)
        out[f"{k[:-2]}_ms_median"] = statistics.median(xs) * 1e3
        out[f"{k[:-2]}_ms_p90"] = xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))] * 1e3
    return out


async def _bench(provider: Any, spec: Any, rounds: int, execs: int, concurrency: int) -> dict:
    seq = [await _cycle(provider, spec, execs) for _ in range(rounds)]
    t0 = time.perf_counter()
    par = await asyncio.gather(*(_cycle(provider, spec, execs) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"sequential": _stats(seq), "concurrent": {**_stats(list(par)), "sandboxes": concurrency, "wall_s": wall,
                                                      "sandboxes_per_s": concurrency / wall}}


@contextmanager
def _standin_env():
    """The Daytona SDK reads its key from the environment: point it at the stand-in for the
    duration of the bench and put back whatever was there."""
    saved = {k: os.environ.get(k) for k in ("DAYTONA_API_KEY", "DAYTONA_USE_DEPRECATED_POLLING")}
    os.environ["DAYTONA_API_KEY"] = STANDIN_KEY
    os.environ["DAYTONA_USE_DEPRECATED_POLLING"] = "true"  # the stand-in has no socket.io
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def _local(rounds: int, execs: int, concurrency: int, root: Path) -> dict:
    from agentrl.config.schema import SandboxConfig
    from agentrl.sandbox.base import SandboxSpec
    from agentrl.sandbox.local import LocalSandboxProvider

    provider = LocalSandboxProvider(SandboxConfig(max_concurrent_creates=concurrency), "bench-local", root_dir=root)
    try:
        report = await _bench(provider, SandboxSpec(), rounds, execs, concurrency)
    finally:
        await provider.aclose()
    base = provider.base_dir
    report["left_behind"] = len(list(base.iterdir())) if base.exists() else 0  # sandbox folders not removed
    return report


async def _daytona(url: str, rounds: int, execs: int, concurrency: int) -> dict:
    from agentrl.config.schema import SandboxConfig
    from agentrl.sandbox.base import SandboxSpec
    from agentrl.sandbox.daytona import DaytonaSandboxProvider

    provider = DaytonaSandboxProvider(SandboxConfig(backend="daytona", daytona_api_url=url,
                                                    max_concurrent_creates=concurrency), "bench-daytona")
    try:
        return await _bench(provider, SandboxSpec(image="ubuntu:22.04", workdir="."), rounds, execs, concurrency)
    finally:
        await provider.aclose()


def run_sandbox_bench(out_path: str | Path, rounds: int = 10, execs: int = 5, concurrency: int = 8,
                      backends: tuple[str, ...] = ("local", "daytona")) -> dict:
    if min(rounds, execs, concurrency) < 1:
        raise ValueError("rounds, execs and concurrency must be >= 1")
    if not backends or set(backends) - {"local", "daytona"}:
        raise ValueError(f"backends must be among local, daytona; got {backends}")
    report: dict[str, Any] = {"benchmark": "sandbox", "machine": machine(),
                              "settings": {"rounds": rounds, "execs_per_sandbox": execs, "concurrency": concurrency},
                              "backends": {}}
    if "local" in backends:
        with tempfile.TemporaryDirectory(prefix="agentrl-sandbox-bench-") as tmp:
            report["backends"]["local"] = asyncio.run(_local(rounds, execs, concurrency, Path(tmp)))
    if "daytona" in backends:
        from bench.doubles import start_daytona_standin

        url, handle = start_daytona_standin(api_key=STANDIN_KEY)
        try:
            with _standin_env():
                report["backends"]["daytona_standin"] = asyncio.run(_daytona(url, rounds, execs, concurrency))
            d = report["backends"]["daytona_standin"]
            d["left_behind"] = len(handle.live())
            d["standin_created"], d["standin_deleted"] = len(handle.created), len(handle.deleted)
            d["standin_commands"] = len(handle.commands_run)
        finally:
            handle.stop()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    return report
