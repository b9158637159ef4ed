"""Process checks for the engine tests."""

from __future__ import annotations


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's corpse waits for whichever subreaper adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
