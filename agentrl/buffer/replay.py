"""The replay buffer: complete GRPO groups, a staleness bound, and a durable log.

Plain class (no Ray import): the orchestrator turns it into an actor with `ray.remote`, so
importing it has no side effects. Records in the log:
  {"type": "traj", ...Trajectory}            accepted (written and fsynced before `add` returns)
  {"type": "retired", "group", "reason"}      left untrained: stale, or an infra error in the group
  {"type": "trained", "step", "groups"}       trained by optimizer step `step`
On restart with the checkpoint's step s, groups trained at steps <= s stay trained, groups of
later steps (their update was lost with the crash) return to the buffer, and every accepted
trajectory of an untrained group is back: nothing accepted is lost, nothing is trained twice.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.agent.trajectory import INFRA_ERROR_PREFIX, Trajectory
from agentrl.buffer.log import DurableLog
from agentrl.buffer.staleness import StalenessBound

LOG_NAME = "replay.log.jsonl"


@dataclass
class Group:
    group_id: str
    task_id: str
    trajectories: dict[str, Trajectory] = field(default_factory=dict)

    def oldest_version(self) -> int | None:
        vs = [t.oldest_version for t in self.trajectories.values() if t.oldest_version is not None]
        return min(vs) if vs else None

    def has_infra_error(self) -> bool:
        return any(t.outcome.startswith(INFRA_ERROR_PREFIX) for t in self.trajectories.values())


@dataclass
class Batch:
    group_ids: list[str]
    trajectories: list[Trajectory]
    staleness: list[int]  # per group: version lag of its oldest token at take time


class ReplayBuffer:
    def __init__(self, directory: str | Path, group_size: int, max_staleness: int, stale_policy: str = "regenerate",
                 fsync: bool = True, max_group_retries: int = 2, resume_step: int = 0):
        if stale_policy not in ("drop", "regenerate"):
            raise ValueError(f"buffer.stale_policy must be 'drop' or 'regenerate', not {stale_policy!r}")
        self.group_size = group_size
        self.bound = StalenessBound(max_staleness)
        self.stale_policy = stale_policy
        self.max_group_retries = max_group_retries
        self.path = Path(directory) / LOG_NAME
        self._pending: dict[str, Group] = {}  # incomplete groups
        self._ready: OrderedDict[str, Group] = OrderedDict()  # complete, not yet trained
        self._done: set[str] = set()  # trained or retired group ids
        self._seen: set[str] = set()  # accepted episode ids (add is idempotent)
        self._retries: dict[str, int] = {}  # task id -> infra retries so far
        self._regenerate: list[dict] = []
        self.counters = {"accepted": 0, "duplicates": 0, "stale_dropped": 0, "stale_regenerated": 0,
                         "infra_groups_retried": 0, "infra_groups_dropped": 0, "trained_groups": 0,
                         "recovered_trajectories": 0, "recovered_untrained_groups": 0}
        self._log = DurableLog(self.path, fsync=fsync)  # opening drops a torn, unacknowledged tail
        self._recover(resume_step)

    # -- recovery ------------------------------------------------------------------------------
    def _recover(self, resume_step: int) -> None:
        for rec in DurableLog.read(self.path):
            kind = rec.pop("type")
            if kind == "traj":
                self._insert(Trajectory.from_dict(rec))
                self.counters["recovered_trajectories"] += 1
            elif kind == "retired":
                self._forget(rec["group"])
            elif kind == "trained":
                # Groups trained after the checkpoint we resume from were never trained as far
                # as the resumed model knows: they stay ready, in their original order.
                if rec["step"] <= resume_step:
                    for g in rec["groups"]:
                        self._forget(g)
        for g in list(self._ready.values()):
            self._check_infra(g)  # a crash may have come between a trajectory and its group's retirement
        self.counters["recovered_untrained_groups"] = len(self._ready)

    def _forget(self, group_id: str) -> None:
        self._pending.pop(group_id, None)
        self._ready.pop(group_id, None)
        self._done.add(group_id)

    def _insert(self, t: Trajectory) -> bool:
        if t.episode_id in self._seen or t.group_id in self._done:
            return False
        self._seen.add(t.episode_id)
        g = self._pending.setdefault(t.group_id, Group(t.group_id, t.task_id))
        g.trajectories[t.episode_id] = t
        if len(g.trajectories) >= self.group_size:
            del self._pending[t.group_id]
            self._ready[t.group_id] = g
        return True

    # -- ingest --------------------------------------------------------------------------------
    def add(self, trajectory: Trajectory | dict) -> bool:
        """Accept one trajectory: logged durably, then acknowledged (True). A repeat of an
        accepted episode id is acknowledged without a second copy. Raises LogWriteError when
        the log cannot be written; then nothing was accepted."""
        t = trajectory if isinstance(trajectory, Trajectory) else Trajectory.from_dict(trajectory)
        if t.episode_id in self._seen:
            self.counters["duplicates"] += 1
            return True
        if t.group_id in self._done:
            return True  # the group was already retired or trained; a late straggler
        self._log.append({"type": "traj", **t.to_dict()})
        self._insert(t)
        self.counters["accepted"] += 1
        if t.group_id in self._ready:
            self._check_infra(self._ready[t.group_id])
        return True

    def _check_infra(self, g: Group) -> None:
        if not g.has_infra_error():
            return
        n = self._retries.get(g.task_id, 0)
        if n < self.max_group_retries:
            self._retries[g.task_id] = n + 1
            self.counters["infra_groups_retried"] += 1
            self._retire(g, "infra_error", regenerate=True)
        else:
            self.counters["infra_groups_dropped"] += 1
            self._retire(g, "infra_error_retries_exhausted", regenerate=False)

    def _retire(self, g: Group, reason: str, regenerate: bool) -> None:
        self._log.append({"type": "retired", "group": g.group_id, "reason": reason})
        self._forget(g.group_id)
        if regenerate:
            self._regenerate.append({"task_id": g.task_id, "reason": reason, "group_id": g.group_id})

    # -- serve ---------------------------------------------------------------------------------
    def ready_groups(self) -> int:
        return len(self._ready)

    def take_batch(self, num_groups: int, current_version: int) -> Batch | None:
        """Oldest-first complete groups within the staleness bound, or None if fewer than
        `num_groups` are ready. Stale groups met on the way are dropped or sent back for
        regeneration, per policy, and counted. Taken groups stay in the log until
        `mark_trained`; a crash before that returns them on restart."""
        chosen: list[tuple[Group, int]] = []
        for gid in list(self._ready):
            g = self._ready[gid]
            oldest = g.oldest_version()
            lag = 0 if oldest is None else self.bound.lag(oldest, current_version)
            if oldest is not None and not self.bound.admits(oldest, current_version):
                regen = self.stale_policy == "regenerate"
                self.counters["stale_regenerated" if regen else "stale_dropped"] += 1
                self._retire(g, f"stale_lag_{lag}", regenerate=regen)
                continue
            chosen.append((g, lag))
            if len(chosen) == num_groups:
                break
        if len(chosen) < num_groups:
            return None
        for g, _ in chosen:
            del self._ready[g.group_id]
        trajs = [t for g, _ in chosen for t in g.trajectories.values()]
        return Batch([g.group_id for g, _ in chosen], trajs, [lag for _, lag in chosen])

    def give_back(self, batch: Batch) -> None:
        """Return a taken batch (the step failed before training); order is restored."""
        groups = {t.group_id: None for t in batch.trajectories}
        by_id: dict[str, Group] = {}
        for t in batch.trajectories:
            by_id.setdefault(t.group_id, Group(t.group_id, t.task_id)).trajectories[t.episode_id] = t
        old = list(self._ready.items())
        self._ready.clear()
        for gid in groups:
            self._ready[gid] = by_id[gid]
        self._ready.update(old)

    def mark_trained(self, step: int, group_ids: list[str]) -> None:
        self._log.append({"type": "trained", "step": step, "groups": list(group_ids)})
        for g in group_ids:
            self._done.add(g)
        self.counters["trained_groups"] += len(group_ids)

    def retire_incomplete(self, group_id: str, reason: str) -> int:
        """Retire a group that can never complete (the worker running it died), so the log accounts
        for the part of it that was accepted; the caller admits the task again. Returns how many
        of its trajectories were accepted."""
        g = self._pending.get(group_id)
        if g is None:
            return 0
        self._retire(g, reason, regenerate=False)
        return len(g.trajectories)

    def pop_regenerate(self) -> list[dict]:
        out, self._regenerate = self._regenerate, []
        return out

    def stats(self) -> dict:
        return {**self.counters, "ready_groups": len(self._ready), "pending_groups": len(self._pending)}

    def close(self) -> None:
        self._log.close()
