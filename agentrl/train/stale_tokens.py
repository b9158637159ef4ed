"""Stale tokens under partial rollout (algorithm.stale_tokens), before the loss sees a batch: a
trajectory continued across weight updates holds tokens of several versions. `mask` leaves the
ones older than the staleness bound out of the loss mask (the bound then holds per trained token);
`tis` keeps them for their truncated importance weight (loss.py). Plain lists, no torch: the
replay buffer's actor applies it when a batch is taken, and importing torch there would cost its
process ~2 s of start-up.
"""

from __future__ import annotations

from dataclasses import replace

STALE_TOKEN_POLICIES = ("mask", "tis")


def stale_token_positions(loss_mask: list[int], versions: list[int], current_version: int,
                          max_staleness: int) -> list[int]:
    """Positions of sampled tokens whose version lags `current_version` by more than `max_staleness`."""
    return [i for i, (m, v) in enumerate(zip(loss_mask, versions)) if m and current_version - v > max_staleness]


def apply_stale_tokens(trajectory, current_version: int, max_staleness: int, policy: str):
    """(the trajectory the loss trains on, its stale token count): with `mask` a copy whose loss mask
    leaves the stale tokens out; with `tis` the trajectory itself (the TIS weight corrects them)."""
    if policy not in STALE_TOKEN_POLICIES:
        raise ValueError(f"algorithm.stale_tokens {policy!r} is unknown; use one of {STALE_TOKEN_POLICIES}")
    stale = stale_token_positions(trajectory.loss_mask, trajectory.weight_versions, current_version, max_staleness)
    if policy == "tis" or not stale:
        return trajectory, len(stale)
    mask = list(trajectory.loss_mask)
    for i in stale:
        mask[i] = 0
    return replace(trajectory, loss_mask=mask), len(stale)
