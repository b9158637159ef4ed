"""The random draw of a benchmark env's episode (its length, its duration): from the reset seed the
run loop passes (agentrl/policy/seeding.py: the k-th group of every run of one seed gets the same
seeds, so two runs play the same workload), or, reset without a seed, from the episode id (a replayed
episode plays the same draw)."""
from __future__ import annotations

import hashlib
import random


def episode_rng(env_seed: int, episode_id: str, reset_seed: int | None = None) -> random.Random:
    key = f"{env_seed}:seed:{reset_seed}" if reset_seed is not None else f"{env_seed}:{episode_id}"
    return random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))
