"""The replay buffer's sidecar for in-flight episodes (buffer.resume_in_flight): partial.log.jsonl.

One line per progress record of one episode ({"type": "progress", ...} with the fields of
agentrl.agent.resume.EpisodeSnapshot: an append-only delta of its token stream, the env steps run
since its last record, its counters), written through the replay log's DurableLog: appended and
fsynced before `append` returns; a torn last line was never acknowledged and is dropped.

Reading merges each episode's chain. A record starting at token 0 begins the chain again (an
episode started over); a record that does not follow on (its start is not the length so far: an
earlier record was lost) ends the chain there, and the episode resumes from the last record that
did. The replay log stays the only record of accepted trajectories: an episode it holds is done,
whatever its chain says. On open, the buffer keeps the chains of episodes still in flight and
rewrites the file as one merged record each (a temporary file, fsynced, renamed over the old one),
so the sidecar holds at most one record per live episode plus what the run appends after.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from agentrl.agent.resume import EpisodeSnapshot
from agentrl.buffer.log import DurableLog

PARTIAL_LOG_NAME = "partial.log.jsonl"
RECORD_TYPE = "progress"


def read_chains(path: Path, on_malformed: Callable[[int, str], None]) -> dict[str, EpisodeSnapshot]:
    """Every episode's merged chain, by episode id (in first-seen order)."""
    chains: dict[str, EpisodeSnapshot] = {}
    ended: set[str] = set()  # chains cut by a missing record, until a record restarts them
    for number, rec in enumerate(DurableLog.read(path, on_malformed), start=1):
        if rec.get("type") != RECORD_TYPE:
            on_malformed(number, f"{path}:{number}: not a progress record (type {rec.get('type')!r})")
            continue
        try:
            delta = EpisodeSnapshot.from_record(rec)
        except (TypeError, ValueError) as e:
            on_malformed(number, f"{path}:{number}: invalid progress record: {e}")
            continue
        eid = delta.episode_id
        if delta.start == 0:
            chains[eid] = delta
            ended.discard(eid)
        elif eid in chains and eid not in ended and not chains[eid].extend(delta):
            ended.add(eid)
    return chains


class PartialLog:
    """Appends progress records; `open_compacted` starts it from the chains worth keeping."""

    def __init__(self, path: Path, fsync: bool = True):
        self.path, self.fsync = Path(path), fsync
        self._log: DurableLog | None = None

    def read(self, on_malformed: Callable[[int, str], None]) -> dict[str, EpisodeSnapshot]:
        return read_chains(self.path, on_malformed)

    def open_compacted(self, keep: list[EpisodeSnapshot]) -> None:
        """Replace the file by one merged record per snapshot in `keep`, then open it for appending."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:  # "wb": what a crashed compaction left in it goes
            f.writelines((json.dumps({"type": RECORD_TYPE, **snap.to_record()}, separators=(",", ":")) + "\n").encode()
                         for snap in keep)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a crash
        finally:
            os.close(dir_fd)
        self._log = DurableLog(self.path, fsync=self.fsync)

    def append(self, record: dict) -> None:
        if self._log is None:
            raise RuntimeError("PartialLog.append before open_compacted")
        self._log.append({"type": RECORD_TYPE, **record})

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
