"""The replay buffer's durable log: one JSON record per line, appended and fsynced before the
writer acknowledges. A torn last line (a crash mid-write) was never acknowledged; readers skip
it and the writer truncates it away on open."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path


class LogWriteError(OSError):
    """The log could not be written (disk full, permissions); nothing was acknowledged."""


class MalformedLogError(ValueError):
    """A complete line of the log is not a record; the message names the file and line."""


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
    def read(path: Path, on_malformed: Callable[[int, str], None] | None = None) -> Iterator[dict]:
        """Records in order. A complete line that is not a JSON object (corruption, a stray edit) is
        skipped and reported to `on_malformed(line_number, why)`, so one bad line never makes the whole
        log unreadable; without a callback it raises MalformedLogError naming the line."""
        path = Path(path)
        if not path.exists():
            return
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if not raw.endswith(b"\n"):
                    return  # torn tail: never acknowledged
                try:
                    record = json.loads(raw)
                    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
                        raise ValueError("not a record object with a \"type\"")
                except ValueError as e:
                    why = f"{path}:{number}: malformed record ({e}): {raw[:80]!r}"
                    if on_malformed is None:
                        raise MalformedLogError(why) from None
                    on_malformed(number, why)
                    continue
                yield record
