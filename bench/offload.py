"""Disk-offloaded AdamW benchmark: `python -m bench.offload --out PATH --state-gb N`.

1. The disk under --dir: sequential write (fdatasync'd), sequential read, and both at once (one
   file read while another is written, which is what an optimizer step does), in bucket-sized
   chunks. The page cache is bypassed with O_DIRECT, or, where the filesystem refuses O_DIRECT,
   by fdatasync + posix_fadvise(DONTNEED) before reading back (works without root).
2. DiskOffloadAdamW on fp32 params holding N GB of optimizer state (12 bytes per param; on the GPU
   when there is one): median step time, the bytes it moves per step (state read + state written),
   and that rate as a fraction of the measured read+write bandwidth.
3. torch.optim.AdamW on the same params, state in memory: the step-time overhead of offloading.
Writes JSON {"machine", "versions", "disk_read_gbps", "disk_write_gbps", "disk_mixed_gbps",
"offload_stream_efficiency", "step_time_offload_s", "step_time_inmemory_s", ...}; GB = 1e9 bytes.
Imports only the stdlib at module level; torch and the optimizer (stdlib + torch) inside the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.machine import machine

GB = 1e9


def _filesystem(path: Path) -> str:
    """Mount point and type of `path`, from /proc/mounts (longest matching mount point)."""
    best = ("?", "?")
    try:
        real = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mnt, fstype, *_ = line.split()
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, fstype)
    except OSError:
        pass
    return f"{best[0]} ({best[1]})"


class DiskProbe:
    """Sequential bandwidth of the disk under `directory`, page cache bypassed."""

    def __init__(self, directory: Path, chunk_bytes: int):
        from agentrl.train.offload_files import HostBuffer, direct_io_supported

        self.directory = directory
        self.direct = direct_io_supported(directory)
        self.chunk = HostBuffer(chunk_bytes, pin=False)
        self.chunk.bytes.random_(0, 256)  # incompressible, in case the device compresses
        self.chunk2 = HostBuffer(chunk_bytes, pin=False)

    @property
    def bypass(self) -> str:
        return "O_DIRECT" if self.direct else "fdatasync+posix_fadvise(DONTNEED)"

    def _flags(self) -> int:
        return os.O_DIRECT if self.direct else 0

    def write(self, path: Path, nbytes: int) -> float:
        t0 = time.perf_counter()
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | self._flags(), 0o644)
        try:
            done = 0
            while done < nbytes:
                view = self.chunk.view[: min(len(self.chunk.view), nbytes - done)]
                done += os.pwrite(fd, view, done)
            os.fdatasync(fd)
            elapsed = time.perf_counter() - t0
            if not self.direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # so the read below hits the disk
        finally:
            os.close(fd)
        return elapsed

    def read(self, path: Path) -> float:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY | self._flags())
        try:
            offset = 0
            while n := os.preadv(fd, [self.chunk2.view], offset):
                offset += n
        finally:
            os.close(fd)
        return time.perf_counter() - t0

    def measure(self, nbytes: int) -> dict[str, float]:
        a, b = self.directory / "disk_probe_a.bin", self.directory / "disk_probe_b.bin"
        write_s = self.write(a, nbytes)
        read_s = self.read(a)
        # Mixed: read `a` while writing `b`, as a step reads bucket i+1 while writing bucket i-1.
        times: dict[str, float] = {}
        reader = threading.Thread(target=lambda: times.__setitem__("read", self.read(a)))
        t0 = time.perf_counter()
        reader.start()
        times["write"] = self.write(b, nbytes)
        reader.join()
        mixed_s = time.perf_counter() - t0
        a.unlink()
        b.unlink()
        return {
            "disk_write_gbps": nbytes / write_s / GB,
            "disk_read_gbps": nbytes / read_s / GB,
            "disk_mixed_gbps": 2 * nbytes / mixed_s / GB,
            "disk_test_bytes": nbytes,
        }


def _params(torch, state_gb: float, device: str) -> list:
    """fp32 params holding `state_gb` GB of Adam state, in tensors of 16M elements (plus a remainder)."""
    total = int(state_gb * GB / 12)
    sizes = [16 * 2**20] * (total // (16 * 2**20)) + ([total % (16 * 2**20)] if total % (16 * 2**20) else [])
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, device=device, generator=gen) * 0.02)
        p.grad = torch.randn(n, device=device, generator=gen) * 1e-3
        params.append(p)
    return params


def _time_steps(torch, opt, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _cpu_update_s(torch, numel: int, chunk: int, fused: bool) -> float:
    """Time of the AdamW arithmetic alone over `numel` host elements (no disk): the CPU floor."""
    from agentrl.train.offload_adam import adamw_update, fused_adamw_update

    p, g, m, v, scratch = (torch.randn(chunk) for _ in range(5))
    v.abs_()
    t0 = time.perf_counter()
    for start in range(0, numel, chunk):
        n = min(chunk, numel - start)
        if fused:
            fused_adamw_update(p[:n], g[:n], m[:n], v[:n], 1, 1e-4, 0.9, 0.95, 1e-8, 0.1)
        else:
            adamw_update(p[:n], g[:n], m[:n], v[:n], scratch[:n], 1, 1e-4, 0.9, 0.95, 1e-8, 0.1)
    return time.perf_counter() - t0


def run_offload_bench(
    out_path: str | Path,
    state_gb: float = 0.3,
    *,
    directory: str | Path | None = None,
    bucket_mb: int = 64,
    steps: int = 3,
    disk_test_gb: float | None = None,
) -> dict[str, Any]:
    """Run the three measurements (module docstring) and write the JSON to `out_path`."""
    import torch

    from agentrl.train.offload_adam import DiskOffloadAdamW

    if state_gb <= 0 or steps < 1 or bucket_mb < 1:
        raise ValueError(
            f"need state_gb > 0, steps >= 1, bucket_mb >= 1 (got {state_gb}, {steps}, {bucket_mb})"
        )
    out_path = Path(out_path)
    base = Path(directory) if directory else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="agentrl-offload-bench-", dir=base))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    host = machine()
    result: dict[str, Any] = {
        "machine": host,
        "versions": host["versions"],
        "directory": str(work),
        "filesystem": _filesystem(work),
        "device": device,
        "state_gb": state_gb,
        "bucket_mb": bucket_mb,
        "steps_timed": steps,
    }
    try:
        chunk = bucket_mb * 2**20  # O_DIRECT needs whole aligned chunks
        probe = DiskProbe(work, chunk)
        disk_bytes = (
            -(-int((disk_test_gb if disk_test_gb else max(1.0, min(2.0, state_gb))) * GB) // chunk) * chunk
        )
        result.update(probe.measure(disk_bytes), cache_bypass=probe.bypass)

        params = _params(torch, state_gb, device)
        numel = sum(p.numel() for p in params)
        opt = DiskOffloadAdamW(
            params, work / "opt", lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=bucket_mb
        )
        opt.step()  # warm-up: buffers, threads, CUDA stream
        offload = _time_steps(torch, opt, steps)
        moved = 2 * opt.state_bytes
        step_s = statistics.median(offload)
        serial_s = opt.state_bytes / (result["disk_read_gbps"] * GB) + opt.state_bytes / (
            result["disk_write_gbps"] * GB
        )
        result.update(
            params=numel,
            state_bytes=opt.state_bytes,
            buckets=len(opt.buckets),
            optimizer_direct_io=opt.direct_io,
            pinned=opt.pinned,
            bytes_moved_per_step=moved,
            step_times_offload_s=offload,
            step_time_offload_s=step_s,
            offload_stream_gbps=moved / step_s / GB,
            offload_stream_efficiency=moved / step_s / GB / result["disk_mixed_gbps"],
            offload_stream_efficiency_vs_serial=serial_s / step_s,
            cpu_update_s=_cpu_update_s(torch, numel, min(numel, bucket_mb * 2**20 // 12), opt.fused),
            fused_update=opt.fused,
            last_step_profile_s=opt.last_step_profile,
        )
        opt.close()
        del opt

        inmem = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        inmem.step()
        times = _time_steps(torch, inmem, steps)
        result.update(step_times_inmemory_s=times, step_time_inmemory_s=statistics.median(times))
        result["offload_overhead_x"] = step_s / result["step_time_inmemory_s"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where to write the JSON result")
    ap.add_argument(
        "--state-gb", type=float, default=0.3, help="optimizer state size in GB (12 bytes per param)"
    )
    ap.add_argument("--dir", default=None, help="node-local directory to test (default: the temp dir)")
    ap.add_argument(
        "--bucket-mb", type=int, default=64, help="offload bucket size (optimizer.offload_bucket_mb)"
    )
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps (after one warm-up)")
    ap.add_argument("--disk-test-gb", type=float, default=None, help="raw disk test size (default 1-2 GB)")
    args = ap.parse_args(argv)
    result = run_offload_bench(
        args.out,
        args.state_gb,
        directory=args.dir,
        bucket_mb=args.bucket_mb,
        steps=args.steps,
        disk_test_gb=args.disk_test_gb,
    )
    keys = (
        "disk_read_gbps",
        "disk_write_gbps",
        "disk_mixed_gbps",
        "step_time_offload_s",
        "step_time_inmemory_s",
        "offload_stream_efficiency",
        "offload_overhead_x",
    )
    print(json.dumps({k: result.get(k) for k in keys}, indent=2))


if __name__ == "__main__":
    main()
