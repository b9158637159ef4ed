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
        self._f = open(self.path, "ab")

    def _truncate_torn_tail(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)

    def append(self, record: dict) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        pos = self._f.tell()
        try:
            self._f.write(line)
            self._f.flush()
            if self.fsync:
                os.fsync(self._f.fileno())
        except OSError as e:
            # Roll back a partial line so the log stays parseable, then report.
            try:
                self._f.truncate(pos)
                self._f.seek(pos)
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
