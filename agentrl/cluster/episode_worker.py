"""EpisodeWorker: one Ray actor that runs many episodes at once on one asyncio loop and sends every
trajectory to the replay buffer. A plain class; the orchestrator makes it an actor, so importing
this module starts nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentrl.config.schema import RunConfig


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
        self.runner = EpisodeRunner(self.cfg, self.router, provider, transcripts=transcripts)
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
                        resume: dict | None = None) -> list[dict]:
        """Run n episodes of one task concurrently; trajectories go to the buffer unless evaluating.
        Returns one EpisodeSummary dict per episode run. `resume` (a group the buffer handed back after
        a restart: accepted episode ids, progress records) runs only the episodes not yet accepted,
        continuing the recorded ones. With buffer.resume_in_flight every episode records its progress."""
        from agentrl.agent.resume import EpisodeSnapshot, ProgressRecorder

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
            traj, summary = await runner.run(task_id, eid, group_id, evaluate=evaluate, resume=snap, recorder=rec)
            if not evaluate:
                await self.buffer.add.remote(traj)
            return summary.to_dict()

        try:
            return list(await asyncio.gather(*(one(k) for k in range(n) if f"{group_id}-{k}" not in done)))
        finally:
            self._tasks.discard(task)

    async def shutdown(self) -> None:
        """Cancel running episodes (each closes its sandbox in `finally`) and close the provider."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.runner is not None:
            await self.runner.provider.aclose()
            self.runner.close()
