"""Stale cancellation: stop a running group as soon as a weight update makes it untrainable.

Under the whole-group staleness rule (rollout.partial=false, agentrl/buffer/staleness.py) a group
trains at trainer version v only if v - (its OLDEST sampled token's version) <= max_staleness. The
version only grows, so once that lag is past the bound the group can never train: the replay
buffer would retire it as stale_lag_<k> when it completes, and every token its episodes generate
until then is wasted, in episodes that hold admission slots a trainable group could use.

The rule judges a running group by the oldest version among the tokens it is KNOWN to have sampled
(finished episodes and returned generations; the episode workers report it). That is never older
than the true oldest token (a token still in flight in an engine is not counted), so the lag it
gives is never larger than the true lag: a group this rule calls doomed is doomed, and a group it
spares may still be retired by the buffer once it completes.

Under the per-token rule (rollout.partial=true) a running group keeps sampling fresh tokens and
trains while its NEWEST token is within the bound: a running group is never doomed.
"""

from __future__ import annotations

from dataclasses import dataclass

CANCELLED = "cancelled"  # an episode summary's outcome when its group was cancelled (never a trajectory)
CANCEL_REASON_PREFIX = "stale_cancelled_lag_"  # the retirement reason: "stale..." re-admits like a stale group


@dataclass(frozen=True)
class StaleCancelPolicy:
    max_staleness: int
    per_token: bool = False  # rollout.partial: the per-token rule, under which no running group is doomed

    def lag(self, oldest_known_version: int | None, current_version: int) -> int | None:
        """The group's lag by its oldest known token; None when it has sampled nothing known yet."""
        return None if oldest_known_version is None else current_version - oldest_known_version

    def doomed(self, oldest_known_version: int | None, current_version: int) -> bool:
        """True when the group can never train at `current_version` or any later version."""
        if self.per_token:
            return False
        lag = self.lag(oldest_known_version, current_version)
        return lag is not None and lag > self.max_staleness

    def reason(self, oldest_known_version: int, current_version: int) -> str:
        return f"{CANCEL_REASON_PREFIX}{current_version - oldest_known_version}"
