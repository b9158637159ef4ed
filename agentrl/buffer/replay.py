"""The replay buffer: complete GRPO groups, a staleness bound, and a durable log.

Plain class (no Ray import): the orchestrator turns it into an actor with `ray.remote`, so
importing it has no side effects. It stores and reports facts; what to do about a group that left
untrained (run it again or drop it) is the run loop's policies' call (agentrl/policy/).

Records in the log:
  {"type": "admitted", "group", "task",      a group about to start, with its episodes' reset seeds
   "draw", "attempt", "seeds"}               (agentrl/policy/seeding.py; written before it starts)
  {"type": "traj", ...Trajectory}            accepted (written and fsynced before `add` returns)
  {"type": "retired", "group", "reason"}      left untrained: stale, an infra error in the group,
                                              its worker lost, cancelled by the run loop, or
                                              incomplete at a resume
  {"type": "trained", "step", "groups"}       trained by optimizer step `step`
  {"type": "rollback", "to_step", "steps"}    a resume from the checkpoint of `to_step`: the updates
                                              of `steps` were lost with the crash; their groups
                                              are untrained again (and will be trained once more)
Recovery at checkpoint step s replays the log: groups trained at steps <= s of the surviving
history stay trained, groups of later steps return to the buffer in their original order, and
every accepted trajectory of an untrained group is back. Acknowledged trajectories of a group that
was still incomplete at the crash can never be completed (its other episodes died with the run):
the group is retired ("incomplete_at_resume") and reported, never stranded. Nothing accepted is
lost, nothing is trained twice.

With resume_in_flight, the episodes still running at a crash were recorded in a sidecar
(agentrl/buffer/partial_log.py); an incomplete group is then not retired at resume but kept
pending and handed to the run loop (`resumable`), which continues its recorded episodes and starts
its missing ones, so the group completes. With partial (rollout.partial) the staleness bound is
judged per token (agentrl/buffer/staleness.py) and a taken batch goes through the loss's
stale-token policy (agentrl/buffer/batch_view.py), whose token facts the Batch carries.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.agent.trajectory import INFRA_ERROR_PREFIX, Trajectory
from agentrl.buffer.batch_view import batch_view
from agentrl.buffer.log import DurableLog
from agentrl.buffer.partial_log import PARTIAL_LOG_NAME, PartialLog
from agentrl.buffer.staleness import StalenessBound

LOG_NAME = "replay.log.jsonl"
_TRAJ_PREFIX = b'{"type":"traj"'  # how DurableLog writes a trajectory record (compact separators, type first)


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

    def outcomes(self) -> list[str]:
        return [t.outcome for t in self.trajectories.values()]


@dataclass
class Batch:
    """A taken batch as the run loop sees it; its trajectories stay here (`batch_trajectories`) and
    go to the trainer ranks without passing through the driver."""

    batch_id: str
    group_ids: list[str]
    staleness: list[int]  # per group: version lag at take time, by the bound's rule
    num_trajectories: int
    tokens: dict = field(default_factory=dict)  # facts about its tokens (agentrl/buffer/batch_view.py)


@dataclass(frozen=True)
class Retired:
    """A fact: a group left the buffer untrained."""

    group_id: str
    task_id: str
    reason: str  # "infra_error", "stale_lag_<k>", "worker_lost", "incomplete_at_resume", or a policy's
    outcomes: tuple[str, ...]  # of its accepted episodes


class ReplayBuffer:
    def __init__(self, directory: str | Path, group_size: int, max_staleness: int, fsync: bool = True,
                 resume_step: int = 0, *, partial: bool = False, stale_tokens: str = "mask",
                 resume_in_flight: bool = False):
        self.group_size = group_size
        self.bound = StalenessBound(max_staleness, per_token=partial)
        self.stale_policy = stale_tokens if partial else None
        self.path = Path(directory) / LOG_NAME
        self._partial = PartialLog(Path(directory) / PARTIAL_LOG_NAME, fsync) if resume_in_flight else None
        self._resumable: list[dict] = []  # groups the run loop is to continue, collected once
        self._admitted: dict[str, list[int]] = {}  # at recovery: group id -> its episodes' seeds, as logged
        self.next_draw = 0  # past every draw number the log holds (agentrl/policy/seeding.py)
        self._pending: dict[str, Group] = {}  # incomplete groups
        self._ready: OrderedDict[str, Group] = OrderedDict()  # complete, not yet trained
        self._taken: dict[str, list[Group]] = {}  # batch id -> groups given to the trainer
        self._taken_view: dict[str, list[Trajectory]] = {}  # batch id -> what the trainer trains on
        self._done: set[str] = set()  # trained or retired group ids
        self._seen: set[str] = set()  # accepted episode ids (add is idempotent)
        self._retired: list[Retired] = []  # facts not yet collected by the run loop
        self._changed: asyncio.Event | None = None
        self.counters = {"accepted": 0, "duplicates": 0, "stale_retired": 0, "infra_groups_retired": 0,
                         "trained_groups": 0, "recovered_trajectories": 0, "recovered_untrained_groups": 0,
                         "incomplete_at_resume": 0, "rolled_back_steps": 0, "malformed_log_lines": 0,
                         "resumable_groups": 0, "resumable_episodes": 0, "progress_records": 0, "cancelled_groups": 0}
        self.malformed: list[str] = []  # one line per skipped log line: file, line number, why
        self._log = DurableLog(self.path, fsync=fsync)  # opening drops a torn, unacknowledged tail
        self._recover(resume_step)

    def __repr__(self) -> str:  # what the Ray dashboard shows for the buffer actor
        return f"ReplayBuffer(groups of {self.group_size}, log {self.path})"

    # -- recovery ------------------------------------------------------------------------------
    def _on_malformed(self, _number: int, why: str) -> None:
        if why not in self.malformed:
            self.malformed.append(why)

    def _recover(self, resume_step: int) -> None:
        done, rolled_back = self._surviving_history(resume_step)
        for rec in DurableLog.read(self.path, self._on_malformed):
            if rec["type"] == "admitted":
                self.next_draw = max(self.next_draw, int(rec.get("draw", -1)) + 1)
                if rec.get("group") not in done:
                    self._admitted[rec["group"]] = list(rec.get("seeds") or [])
            elif rec["type"] == "traj":
                rec.pop("type")
                try:
                    t = Trajectory.from_dict(rec)
                except (TypeError, ValueError, KeyError) as e:
                    self._on_malformed(0, f"{self.path}: trajectory record {rec.get('episode_id')!r} is invalid: {e}")
                    continue
                if t.group_id in done:
                    continue
                self._insert(t)
                self.counters["recovered_trajectories"] += 1
        self._done |= done
        if rolled_back:
            self._log.append({"type": "rollback", "to_step": resume_step, "steps": rolled_back})
            self.counters["rolled_back_steps"] = len(rolled_back)
        resumed = self._keep_in_flight() if self._partial is not None else {}
        for g in list(self._pending.values()):  # its other episodes died with the run: never completes
            self.counters["incomplete_at_resume"] += 1
            self._retire(g, "incomplete_at_resume")
        self._pending.update(resumed)  # back in: the run loop completes them
        for g in list(self._ready.values()):
            self._check_infra(g)  # a crash may have come between a trajectory and its group's retirement
        self.counters["recovered_untrained_groups"] = len(self._ready)
        self.counters["malformed_log_lines"] = len(self.malformed)
        self._admitted.clear()  # only the groups continued now needed their seeds

    def _keep_in_flight(self) -> dict[str, Group]:
        """resume_in_flight: the incomplete groups and the groups of recorded episodes (neither trained
        nor retired) become groups to continue, taken out of the pending set (returned) so that the
        incomplete-at-resume rule passes them by; the sidecar keeps only their chains."""
        chains = self._partial.read(self._on_malformed)
        live = {e: c for e, c in chains.items() if e not in self._seen and c.group_id not in self._done}
        tasks = {g.group_id: g.task_id for g in self._pending.values()}
        for c in live.values():
            tasks.setdefault(c.group_id, c.task_id)
        for gid, task in tasks.items():
            g = self._pending.setdefault(gid, Group(gid, task))
            if g.has_infra_error():
                continue  # it can never train: retired with the incomplete ones, the retry policy decides
            snaps = {e: c.to_record() for e, c in live.items() if c.group_id == gid}
            self._resumable.append({"group_id": gid, "task_id": task, "accepted": sorted(g.trajectories),
                                    "snapshots": snaps, "seeds": self._admitted.get(gid) or None})
            self.counters["resumable_episodes"] += len(snaps)
        self.counters["resumable_groups"] = len(self._resumable)
        kept = {r["group_id"] for r in self._resumable}
        self._partial.open_compacted([c for c in live.values() if c.group_id in kept])
        return {gid: self._pending.pop(gid) for gid in kept}

    def _surviving_history(self, resume_step: int) -> tuple[set[str], list[int]]:
        """(groups that stay trained or retired, steps rolled back now) from the log's control records."""
        trained_at: dict[str, int] = {}
        retired: set[str] = set()
        for rec in DurableLog.read(self.path, self._on_malformed):
            kind = rec["type"]
            if kind == "retired":
                retired.add(rec["group"])
            elif kind == "trained":
                for g in rec["groups"]:
                    trained_at[g] = int(rec["step"])
            elif kind == "rollback":
                to = int(rec["to_step"])
                trained_at = {g: s for g, s in trained_at.items() if s <= to}
        lost = sorted({s for s in trained_at.values() if s > resume_step})
        kept = {g for g, s in trained_at.items() if s <= resume_step}
        return kept | retired, lost

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
    def admitted(self, group_id: str, task_id: str, draw: int, attempt: int, seeds: list[int]) -> None:
        """Log a group about to start (before any of its episodes runs), so that a resumed run draws
        new seeds and a group continued after a crash gets its own back. Raises LogWriteError."""
        self._log.append({"type": "admitted", "group": group_id, "task": task_id, "draw": draw,
                          "attempt": attempt, "seeds": list(seeds)})
        self.next_draw = max(self.next_draw, draw + 1)

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
            self._notify()
        return True

    def _check_infra(self, g: Group) -> None:
        """A group with an infrastructure failure is never trained (its rewards are not the policy's)."""
        if g.has_infra_error():
            self.counters["infra_groups_retired"] += 1
            self._retire(g, "infra_error")

    def _retire(self, g: Group, reason: str) -> None:
        self._log.append({"type": "retired", "group": g.group_id, "reason": reason})
        self._forget(g.group_id)
        self._retired.append(Retired(g.group_id, g.task_id, reason, tuple(g.outcomes())))
        self._notify()

    # -- waiting -------------------------------------------------------------------------------
    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def wait_ready(self, min_groups: int, timeout_s: float) -> int:
        """Return the number of ready groups as soon as it reaches `min_groups`, a retired group is
        waiting to be collected, or `timeout_s` passes (whichever is first)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        if len(self._ready) >= min_groups or self._retired:
            return len(self._ready)
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            pass
        return len(self._ready)

    # -- serve ---------------------------------------------------------------------------------
    def ready_groups(self) -> int:
        return len(self._ready)

    def take_batch(self, num_groups: int, current_version: int) -> Batch | None:
        """Oldest-first complete groups within the staleness bound, or None if fewer than
        `num_groups` are ready. Stale groups met on the way are retired and reported. Taken groups
        stay in the log until `mark_trained`; a crash before that returns them on restart."""
        chosen: list[tuple[Group, int]] = []
        for gid in list(self._ready):
            g = self._ready[gid]
            lag = self.bound.group_lag(g.trajectories.values(), current_version)
            if lag is not None and lag > self.bound.max_staleness:
                self.counters["stale_retired"] += 1
                self._retire(g, f"stale_lag_{lag}")
                continue
            chosen.append((g, lag or 0))
            if len(chosen) == num_groups:
                break
        if len(chosen) < num_groups:
            return None
        batch_id = f"b{uuid.uuid4().hex[:10]}"
        for g, _ in chosen:
            del self._ready[g.group_id]
        self._taken[batch_id] = [g for g, _ in chosen]
        view, tokens = batch_view([t for g, _ in chosen for t in g.trajectories.values()], current_version,
                                  self.bound.max_staleness, self.stale_policy)
        self._taken_view[batch_id] = view
        return Batch(batch_id, [g.group_id for g, _ in chosen], [lag for _, lag in chosen], len(view), tokens)

    def batch_trajectories(self, batch_id: str) -> list[Trajectory]:
        """The trajectories of a taken batch, group by group."""
        if batch_id not in self._taken:
            raise KeyError(f"no taken batch {batch_id!r}")
        return list(self._taken_view[batch_id])

    def mark_trained(self, step: int, batch_id: str) -> None:
        groups = self._taken.pop(batch_id)
        self._taken_view.pop(batch_id, None)
        ids = [g.group_id for g in groups]
        self._log.append({"type": "trained", "step": step, "groups": ids})
        self._done.update(ids)
        self.counters["trained_groups"] += len(ids)

    def retire_incomplete(self, group_id: str, reason: str) -> int:
        """Retire a group that can never complete (the worker running it died), so the log accounts
        for the part of it that was accepted. Returns how many of its trajectories were accepted."""
        g = self._pending.get(group_id)
        if g is None:
            return 0
        self._retire(g, reason)
        return len(g.trajectories)

    def retire_cancelled(self, group_id: str, task_id: str, reason: str) -> bool:
        """Retire a group the run loop cancelled (agentrl/policy/stale_cancel.py), complete or not,
        with accepted trajectories or none: the fact comes back through `pop_retired` (one per group)
        and a late trajectory of it is dropped. False when it was already trained, taken or retired
        (its fact, if any, was given then)."""
        if group_id in self._done or any(g.group_id == group_id for gs in self._taken.values() for g in gs):
            return False
        g = self._pending.get(group_id) or self._ready.get(group_id) or Group(group_id, task_id)
        self.counters["cancelled_groups"] += 1
        self._retire(g, reason)
        return True

    def retire_ready(self, group_id: str, reason: str) -> bool:
        """Retire a complete group that is still waiting to train (a policy left it out, e.g. dynamic
        sampling's zero-variance filter); False if it is not waiting (already taken or gone)."""
        g = self._ready.get(group_id)
        if g is None:
            return False
        self._retire(g, reason)
        return True

    # -- in-flight episodes (resume_in_flight) -------------------------------------------------
    def record_partial(self, record: dict) -> bool:
        """Durably record one progress record of a running episode (agentrl/agent/resume.py);
        False when not kept (resume_in_flight off, or the episode or its group is already done).
        Raises LogWriteError when the sidecar cannot be written."""
        if self._partial is None or record.get("episode_id") in self._seen or record.get("group_id") in self._done:
            return False
        self._partial.append(record)
        self.counters["progress_records"] += 1
        return True

    def resumable(self) -> list[dict]:
        """The groups to continue after this resume, once: {group_id, task_id, accepted: [episode
        ids], snapshots: {episode id: progress record}}. They stay pending until complete."""
        out, self._resumable = self._resumable, []
        return out

    def pop_retired(self) -> list[Retired]:
        """Groups that left untrained since the last call (the run loop decides what to re-run)."""
        out, self._retired = self._retired, []
        return out

    def recovery(self) -> dict:
        """What the buffer found in its log when it opened (for the run's resume note)."""
        keys = ("recovered_trajectories", "recovered_untrained_groups", "incomplete_at_resume", "rolled_back_steps",
                "malformed_log_lines")
        return {**{k: self.counters[k] for k in keys}, "malformed": list(self.malformed), "next_draw": self.next_draw}

    def stats(self) -> dict:
        return {**self.counters, "ready_groups": len(self._ready), "pending_groups": len(self._pending)}

    def close(self) -> None:
        self._log.close()
        if self._partial is not None:
            self._partial.close()
