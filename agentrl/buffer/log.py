"""The replay buffer's durable log: one JSON record per line, appended and fsynced before the
writer acknowledges. A torn last line (a crash mid-write) was never acknowledged; readers skip
it and the writer truncates it away on open."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path


class LogWriteError(OSError):
    """The log could not be written (disk full, permissions); nothing was acknowledged."""


class DurableLog:
    def __init__(self, path: Path, fsync: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._truncate_torn_tail()
        # Unbuffered: a failed write must leave no bytes in a userspace buffer that a later flush
        # would put into the middle of the log (found by the faults suite on a full tmpfs).
        self._f = open(self.path, "ab", buffering=0)

    def _truncate_torn_tail(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)

    def append(self, record: dict) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        fd = self._f.fileno()
        pos = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(line)
            while view:  # a write may be partial (the disk filled mid-line): finish it or fail
                view = view[os.write(fd, view):]
            if self.fsync:
                os.fsync(fd)
        except OSError as e:
            # Roll back the partial line so the log stays parseable (ftruncate needs no free space),
            # then report.
            try:
                os.ftruncate(fd, pos)
            except OSError:
                pass
            raise LogWriteError(e.errno, f"replay log {self.path}: {e.strerror}; record not accepted") from e

    def close(self) -> None:
        self._f.close()

    @staticmethod
    def read(path: Path) -> Iterator[dict]:
        path = Path(path)
        if not path.exists():
            return
        with open(path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    return  # torn tail: never acknowledged
                yield json.loads(raw)
