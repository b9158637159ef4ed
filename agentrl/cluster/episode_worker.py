"""EpisodeWorker: one Ray actor that runs many episodes at once on one asyncio loop and sends every
trajectory to the replay buffer. A plain class; the orchestrator makes it an actor, so importing
this module starts nothing.

It reports facts about its running training groups (`oldest_versions`: the oldest weight version
among the tokens each group is known to have sampled, from a tally of every generation returned)
and cancels a group on request (`cancel_group`: the run loop's stale-cancellation policy,
agentrl/policy/stale_cancel.py). A cancelled group's run_group returns a CANCELLED summary for each
episode it stopped, with the tokens that episode had generated; cancelling a request aborts it on
its engine (agentrl/rollout/client.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from agentrl.config.schema import RunConfig
from agentrl.rollout.types import GenerateResult, Generator, SamplingParams


class GenerationTally:
    """A Generator that passes every call through and keeps, per session (an episode id), the tokens
    returned and the oldest weight version among them."""

    def __init__(self, inner: Generator):
        self.inner = inner
        self.tokens: dict[str, int] = {}
        self.oldest: dict[str, int] = {}

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       rid: str | None = None) -> GenerateResult:
        result = await self.inner.generate(input_ids, sampling, session_id=session_id, rid=rid)
        if result.output_ids:
            self.tokens[session_id] = self.tokens.get(session_id, 0) + len(result.output_ids)
        if result.weight_versions:
            v = min(int(x) for x in result.weight_versions)
            self.oldest[session_id] = min(v, self.oldest.get(session_id, v))
        return result

    def forget(self, session_id: str) -> None:
        self.tokens.pop(session_id, None)
        self.oldest.pop(session_id, None)


class EpisodeWorker:
    """Runs groups of episodes; every episode talks to the engines through a session-affine router."""

    def __init__(self, cfg: dict, engine_urls: list[str], buffer_name: str, run_id: str, index: int, run_dir: str):
        """`buffer_name`: the replay buffer actor's name, looked up here (Ray cannot restart an actor
        whose constructor arguments hold actor handles, ray issue 53727; a restarted worker finds it)."""
        self.cfg = RunConfig.model_validate(cfg)
        self.engine_urls = list(engine_urls)
        self.buffer_name, self.run_id, self.index = buffer_name, run_id, index
        self.run_dir = Path(run_dir)
        self.runner = None
        self._tasks: set[asyncio.Task] = set()
        self._episodes: dict[str, dict[str, asyncio.Task]] = {}  # training group id -> episode id -> task
        self._cancelled: dict[str, str] = {}  # group id -> why the run loop cancelled it

    def __repr__(self) -> str:
        return f"EpisodeWorker({self.index}, {len(self.engine_urls)} engine(s))"

    def _setup(self):
        if self.runner is not None:
            return self.runner
        import ray

        from agentrl.agent.runner import EpisodeRunner
        from agentrl.metrics import RunMetrics
        from agentrl.rollout.router import Router
        from agentrl.sandbox.factory import make_provider

        self.buffer = ray.get_actor(self.buffer_name)
        self.router = Router(self.engine_urls, timeout_s=self.cfg.rollout.request_timeout_s)
        self.metrics = RunMetrics(self.run_id)
        provider = self.metrics.wrap_provider(make_provider(self.cfg.sandbox, self.run_id))
        transcripts = self.run_dir / "transcripts" / f"worker_{self.index}.jsonl" if self.cfg.logging.transcripts else None
        self.tally = GenerationTally(self.router)
        self.runner = EpisodeRunner(self.cfg, self.tally, provider, transcripts=transcripts)
        return self.runner

    def task_ids(self) -> tuple[list[str], dict[str, list[str]]]:
        """The env's task ids and its suggested splits ({"train": [...], "eval": [...]} or {})."""
        return self._setup().tasks()

    def engine_down(self, url: str) -> None:
        """Stop routing to `url` (it died); its sessions move to their next engine on the ring."""
        self._setup()
        self.router.mark_down(url)

    def engine_up(self, url: str) -> None:
        """`url` is back and holds the current weights: its sessions return to it."""
        self._setup()
        self.router.mark_up(url)

    async def run_group(self, task_id: str, group_id: str, n: int, evaluate: bool = False,
                        resume: dict | None = None, seeds: list[int] | None = None) -> list[dict]:
        """Run n episodes of one task concurrently; trajectories go to the buffer unless evaluating.
        Returns one EpisodeSummary dict per episode run. `resume` (a group the buffer handed back after
        a restart: accepted episode ids, progress records) runs only the episodes not yet accepted,
        continuing the recorded ones. With buffer.resume_in_flight every episode records its progress.
        `seeds`: episode k's env reset seed (agentrl/policy/seeding.py)."""
        from agentrl.agent.resume import EpisodeSnapshot, ProgressRecorder
        from agentrl.agent.runner import EpisodeSummary
        from agentrl.policy.stale_cancel import CANCELLED

        runner = self._setup()
        task = asyncio.current_task()
        self._tasks.add(task)
        done, snapshots = set(resume["accepted"]) if resume else set(), resume["snapshots"] if resume else {}

        async def one(k: int) -> dict:
            eid = f"{group_id}-{k}"
            snap = EpisodeSnapshot.from_record(snapshots[eid]) if eid in snapshots else None
            rec = None
            if self.cfg.buffer.resume_in_flight and not evaluate:
                rec = ProgressRecorder(self.buffer.record_partial.remote, eid, group_id, task_id, n)
            traj, summary = await runner.run(task_id, eid, group_id, evaluate=evaluate, resume=snap, recorder=rec,
                                             seed=seeds[k] if seeds else None)
            if not evaluate:
                await self.buffer.add.remote(traj)
            return summary.to_dict()

        eids = [f"{group_id}-{k}" for k in range(n)]
        episodes = {eid: asyncio.ensure_future(one(k)) for k, eid in enumerate(eids) if eid not in done}
        if not evaluate:
            self._episodes[group_id] = episodes
        t0 = time.time()
        try:
            results = await asyncio.gather(*episodes.values(), return_exceptions=True)
            out = []
            for eid, r in zip(episodes, results):
                if isinstance(r, asyncio.CancelledError) and group_id in self._cancelled:
                    # Stopped by cancel_group: what it generated is counted, nothing went to the buffer.
                    r = EpisodeSummary(eid, task_id, group_id, CANCELLED, None, 0, self.tally.tokens.get(eid, 0), 0,
                                       self.tally.oldest.get(eid), evaluate, time.time() - t0,
                                       error=self._cancelled[group_id]).to_dict()
                elif isinstance(r, BaseException):
                    raise r
                out.append(r)
            return out
        finally:
            self._tasks.discard(task)
            self._episodes.pop(group_id, None)
            self._cancelled.pop(group_id, None)
            for eid in eids:
                self.tally.forget(eid)

    def oldest_versions(self) -> dict[str, int]:
        """Per running training group: the oldest weight version among the tokens its episodes are
        known to have sampled (finished episodes and returned generations); groups with none yet are
        left out."""
        if self.runner is None:
            return {}
        out = {}
        for gid, episodes in self._episodes.items():
            known = [self.tally.oldest[e] for e in episodes if e in self.tally.oldest]
            if known and gid not in self._cancelled:
                out[gid] = min(known)
        return out

    def tokens_in_flight(self) -> int:
        """Tokens returned so far to the training episodes still running (for the run's generated count)."""
        if self.runner is None:
            return 0
        return sum(self.tally.tokens.get(e, 0) for episodes in self._episodes.values()
                   for e, t in episodes.items() if not t.done())

    def cancel_group(self, group_id: str, reason: str) -> bool:
        """Stop the running episodes of a training group (each closes its env; a generation in flight
        is aborted on its engine); its run_group returns a CANCELLED summary for each of them. False
        when none was still running (the group ended or is not here)."""
        episodes = self._episodes.get(group_id, {})
        running = [t for t in episodes.values() if not t.done()]
        if not running:
            return False
        self._cancelled[group_id] = reason
        for t in running:
            t.cancel()
        return True

    async def shutdown(self) -> None:
        """Cancel running episodes (each closes its sandbox in `finally`) and close the provider."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.runner is not None:
            await self.runner.provider.aclose()
            self.runner.close()
