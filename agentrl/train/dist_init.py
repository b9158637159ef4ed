"""How a trainer rank joins the trainer's torch.distributed world (no torch import here: the
rehearsal's dry ranks build their backend without it, which saves every one of their actor
processes torch's ~2 s import)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistInit:
    """How this process joins the trainer's torch.distributed world. The TrainerGroup passes it to
    every rank as arguments: rank 0's node IP and a port that was free there, this rank's global and
    node-local rank. Nothing is read from the environment."""

    rank: int
    world: int
    master_addr: str
    master_port: int
    local_rank: int = 0
    timeout_s: float = 600.0  # a rank that never arrives fails the others instead of hanging them

    @classmethod
    def single(cls) -> DistInit:
        """A world of one on a free loopback port (tests, one-rank tools)."""
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return cls(0, 1, "127.0.0.1", s.getsockname()[1])
