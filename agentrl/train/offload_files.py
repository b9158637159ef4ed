"""Files and buffers of the disk-offloaded optimizer: bucket layout, aligned (optionally pinned)
host buffers, whole-file positional reads/writes (O_DIRECT when the filesystem allows it) and the
atomically committed manifest.

On-disk format (one directory per optimizer, i.e. per rank):
  bucket_<BBBBB>.<SSSSSSSS>.bin   bucket B's state after committed step S: fp32 master, then fp32
                                  exp_avg, then fp32 exp_avg_sq (numel each), zero-padded to 4 KiB.
  manifest.json                   the last committed step, the layout fingerprint and the per-param
                                  step counts; replaced with write-tmp + fsync + rename + fsync(dir).
A bucket file is written once, into a new inode, and never modified: a step writes
`bucket_*.<S+1>.bin`, fdatasyncs each, commits the manifest, then unlinks the step-S files. A kill
at any point leaves the files named by the manifest intact (a torn step is discarded whole), and a
checkpoint can hard-link them. One file per bucket (rather than .master/.m/.v) keeps a bucket to one
sequential read and one sequential write; the layout lives in the manifest, so no header is needed.
Imports only the stdlib and torch (the GPU benchmark runs this without the rest of agentrl).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN = 4096  # O_DIRECT needs block-aligned buffers, offsets and lengths; 4 KiB covers every disk we use
STATE_BYTES_PER_ELEMENT = 12  # fp32 master + exp_avg + exp_avg_sq
MANIFEST = "manifest.json"
FORMAT = "agentrl-offload-adamw/1"


def round_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of the flattened param `param` live at `offset` in their bucket."""

    param: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Bucket:
    index: int
    numel: int
    segments: tuple[Segment, ...]

    @property
    def file_bytes(self) -> int:
        return round_up(self.numel * STATE_BYTES_PER_ELEMENT)

    def file_name(self, step: int) -> str:
        return f"bucket_{self.index:05d}.{step:08d}.bin"


def plan_buckets(numels: list[int], bucket_mb: int) -> list[Bucket]:
    """Cut the params, in the given order, into buckets of about `bucket_mb` MiB of optimizer state
    (12 bytes per element). A param larger than a bucket is split across buckets, so the host
    buffers stay bounded whatever the largest tensor (an embedding can be several GB)."""
    if bucket_mb < 1:
        raise ValueError(f"offload_bucket_mb must be >= 1, got {bucket_mb}")
    cap = max(1, bucket_mb * 2**20 // STATE_BYTES_PER_ELEMENT)
    buckets: list[Bucket] = []
    segs: list[Segment] = []
    fill = 0
    for p, n in enumerate(numels):
        start = 0
        while start < n:
            take = min(n - start, cap - fill)
            segs.append(Segment(p, start, start + take, fill))
            fill += take
            start += take
            if fill == cap:
                buckets.append(Bucket(len(buckets), fill, tuple(segs)))
                segs, fill = [], 0
    if segs:
        buckets.append(Bucket(len(buckets), fill, tuple(segs)))
    return buckets


class HostBuffer:
    """A 4 KiB-aligned host byte buffer, page-locked when CUDA is available (async H2D/D2H copies
    need pinned memory), with float32 views and a writable memoryview for os.preadv / os.pwrite."""

    def __init__(self, nbytes: int, pin: bool):
        self.nbytes = round_up(max(nbytes, 1))
        raw = torch.empty(self.nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
        skip = (-raw.data_ptr()) % ALIGN
        self._raw = raw  # keeps the allocation alive
        self.bytes = raw[skip : skip + self.nbytes]
        self.f32 = self.bytes.view(torch.float32)
        # memoryview over the same memory without numpy (the GPU benchmark may not have numpy)
        self._cbuf = (ctypes.c_char * self.nbytes).from_address(self.bytes.data_ptr())
        self.view = memoryview(self._cbuf).cast("B")


def direct_io_supported(directory: Path) -> bool:
    """Whether O_DIRECT reads and writes work in `directory` (tmpfs and some overlay filesystems
    refuse it with EINVAL at open or at the first I/O)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    probe = Path(directory) / ".direct_io_probe"
    buf = HostBuffer(ALIGN, pin=False)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError:
        return False
    try:
        os.pwrite(fd, buf.view, 0)
        os.preadv(fd, [buf.view], 0)
        return True
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def read_file_into(path: Path, view: memoryview, direct: bool) -> None:
    """Fill `view` from the start of `path` (whole-file sequential read)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], done)
            if n == 0:
                raise OSError(errno.EIO, f"{path} is shorter than expected ({done} of {len(view)} bytes)")
            done += n
    finally:
        os.close(fd)


def write_new_file(path: Path, view: memoryview, direct: bool) -> None:
    """Write `view` into a new inode at `path` and fdatasync it (data and size are durable on return).
    An old file of that name is unlinked first, never overwritten: it may be a checkpoint's hard link."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o644)
    try:
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, manifest: dict) -> None:
    """Atomic commit point of a step: readers see the old or the new manifest, never a mix."""
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    fsync_dir(directory)


def read_manifest(directory: Path) -> dict | None:
    path = directory / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); delete {directory} to start fresh") from e
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def remove_unreferenced(directory: Path, keep: set[str]) -> None:
    """Delete bucket files a torn step (or an interrupted cleanup) left behind."""
    for path in directory.glob("bucket_*.bin"):
        if path.name not in keep:
            path.unlink(missing_ok=True)
    (directory / (MANIFEST + ".tmp")).unlink(missing_ok=True)


def unlink_all(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard link (free, and safe because bucket files are never modified); copy across filesystems."""
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            while chunk := fi.read(64 * 2**20):
                fo.write(chunk)
            fo.flush()
            os.fsync(fo.fileno())
