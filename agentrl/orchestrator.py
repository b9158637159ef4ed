"""The run loop: admit episodes, drain complete groups into training, sync weights, repeat.

async mode: generation never waits for training. Groups are admitted whenever the staleness-
aware capacity allows (agentrl.policy.admission); the trainer takes a batch as soon as enough
complete groups are in the buffer; weights go to the engines after every step while episodes keep
running. sync mode (for comparison): admit one step's groups, wait for all of them, train, sync.

Without partial rollout a group whose oldest token is already past the staleness bound can never
train; it is cancelled as soon as the run loop learns so (agentrl/policy/stale_cancel.py,
buffer.cancel_stale_groups), not left to generate to its end. Every group is admitted with a draw
number and its episodes' reset seeds (agentrl/policy/seeding.py), so that the k-th group of two runs
of one seed plays the same task with the same seeds.

Everything is built from the resolved plan: the trainer ranks (TrainerGroup), the engines
(EngineGroup), the weight transport. The loop sleeps until something happens (a group completes
or retires in the buffer, a group's episodes end, a step finishes), at most LOOP_TICK_S.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from agentrl.agent.trajectory import INFRA_ERROR_PREFIX
from agentrl.config.plan import RunPlan
from agentrl.config.schema import RunConfig
from agentrl.loggers import RunLoggers
from agentrl.policy.admission import AdmissionPolicy
from agentrl.policy.dynamic_sampling import DynamicSampler
from agentrl.policy.retry import RetryPolicy, UnplayableTasks, failure_kind
from agentrl.policy.seeding import GroupSeeds, SeedSchedule
from agentrl.policy.stale_cancel import CANCELLED, StaleCancelPolicy
from agentrl.progress import Progress

LOOP_TICK_S = 1.0  # longest the loop sleeps with nothing happening (progress panel, health checks)
ENGINE_CHECK_INTERVAL_S = 5.0  # how often dead engines are looked for (and server info refreshed)
PLOT_EVERY_STEPS = 5  # curves.png redrawn every this many steps, and at the end
ZERO_VARIANCE = "zero_variance"  # the retirement reason of a group dynamic sampling left out
# How often running groups are checked for staleness between weight updates (always right after one):
# a group's oldest token becomes known only when its first generation returns, possibly after an update.
DOOM_CHECK_INTERVAL_S = 2.0


class Orchestrator:
    def __init__(self, cfg: RunConfig, plan: RunPlan, progress: Progress | None = None):
        self.cfg, self.plan = cfg, plan
        self.run_dir = Path(cfg.logging.run_dir)
        self.run_id = f"{cfg.recipe}-{uuid.uuid4().hex[:8]}"
        self.progress = progress or Progress()
        a = cfg.algorithm
        self.admission = AdmissionPolicy(a.prompts_per_step, a.group_size, cfg.buffer.max_staleness,
                                         cfg.buffer.max_episodes_in_flight, lead_steps=cfg.rollout.partial_lead_steps)
        self.retry = RetryPolicy()
        self.unplayable = UnplayableTasks()
        self.dynamic = DynamicSampler.from_config(a)
        self.outcomes: Counter[str] = Counter()
        self.generated_tokens = 0  # by episodes that ended (finished, failed or cancelled)
        self.generated_unfinished = 0  # by episodes still running when the loop ended (set at its end)
        self.seeds = SeedSchedule(cfg.seed, a.group_size)
        self.stale_cancel = StaleCancelPolicy(cfg.buffer.max_staleness, per_token=cfg.rollout.partial)
        # groups_cancelled_stale, episodes_cancelled (stopped mid-run), tokens_cancelled (every token the
        # cancelled groups generated, finished episodes' too: all of it wasted)
        self.cancelled: Counter[str] = Counter()
        self._doom_checked: tuple[int, float] = (-1, 0.0)  # (version, monotonic time) of the last check
        self.readmit: list[tuple[str, str]] = []  # (task, lineage) of groups to run again
        self.version = 0
        self.step = 0
        self.trainer_busy_s = 0.0
        self.loop_started: float | None = None
        self.startup_s = 0.0
        self.eval_results: dict[int, dict] = {}
        self._lineage: dict[str, str] = {}  # group id -> the group id of its first admission
        self._handled: set[str] = set()  # groups whose loss the loop accounted for itself (lost worker)
        self._infra_seen: set[str] = set()  # infra_error kinds already explained in a note
        self._group_tasks: set[asyncio.Task] = set()
        self._eval_tasks: set[asyncio.Task] = set()
        self._worker_load: list[int] = []
        self._engines_suspect = False
        self._training: asyncio.Task | None = None  # the optimizer step in flight, if any
        self._ready_cache = 0  # complete groups in the buffer, as of this loop iteration
        self._wake = asyncio.Event()
        self._out_of_rotation: set[int] = set()  # restarted engines still waiting for current weights
        self._resumable: list[dict] = []  # groups in flight at a crash, handed back by the buffer
        self.stop_requested: str | None = None  # why the loop should end early (request_stop)
        self._checkpointed_step: int | None = None  # the step the latest checkpoint holds
        self.loggers = RunLoggers([])  # tensorboard / wandb, opened in _start when configured
        self.ray = None

    # -- set-up --------------------------------------------------------------------------------
    async def _start(self) -> None:
        import ray

        from agentrl.buffer.replay import ReplayBuffer
        from agentrl.cluster.engines import EngineGroup
        from agentrl.cluster.episode_worker import EpisodeWorker
        from agentrl.cluster.ray_env import init_ray
        from agentrl.cluster.trainer_group import TrainerGroup
        from agentrl.metrics import RunMetrics

        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(self.cfg.model_dump_json(indent=2))
        (self.run_dir / "plan.json").write_text(json.dumps(self.plan.to_json(), indent=2))
        self.loggers = RunLoggers.open(self.cfg.logging, self.run_dir, self.run_id,
                                       self.cfg.model_dump(mode="json"), note=self.progress.note)
        self.ray = init_ray(self.cfg, self.plan)
        self.metrics = RunMetrics(self.run_id)
        if self.ray.dashboard_url:
            self.progress.note(f"Ray dashboard: {self.ray.dashboard_url}")
        self.progress.begin(self.run_id, self.cfg.mode, self.cfg.train.max_steps, self.ray.dashboard_url)
        await self._sweep_sandboxes(stale_only=True)

        lay = self.plan.layout
        self.trainers = TrainerGroup(self.cfg, self.plan, self.run_id, self.run_dir)
        self.engines = EngineGroup(self.cfg, self.plan, self.run_dir, self.run_id)
        # Trainer ranks and engines start side by side: neither needs the other until the first
        # weight push, and each is minutes at scale (Megatron building a 744B model, SGLang loading
        # it), so start-up costs the slower of the two rather than their sum.
        self.progress.note(f"starting {lay.world} trainer rank(s) ({self.plan.backend}, {lay.describe()}) and "
                           f"{len(self.plan.engines)} {self.plan.engine_kind} engine(s)")
        _, self.urls = await _together(self.trainers.start(), self.engines.start())
        resumed = await self.trainers.resume()
        self.version = await self.trainers.version()
        if resumed:
            self.step = int(resumed["step"])
            self._checkpointed_step = self.step
            self.outcomes.update(resumed.get("outcomes", {}))
        self._roll_back_metrics()
        # Named, so that episode workers look it up instead of receiving its handle: Ray cannot
        # restart an actor whose constructor arguments hold references (ray issue 53727).
        self.buffer_name = f"{self.run_id}-replay-buffer"
        self.buffer = ray.remote(ReplayBuffer).options(num_cpus=0, name=self.buffer_name).remote(
            str(self.run_dir), self.cfg.algorithm.group_size, self.cfg.buffer.max_staleness, self.cfg.buffer.fsync,
            resume_step=self.step, partial=self.cfg.rollout.partial, stale_tokens=self.cfg.algorithm.stale_tokens,
            resume_in_flight=self.cfg.buffer.resume_in_flight)
        await self._note_recovery(resumed)

        sync = await self.trainers.push_weights(self.urls)
        if sync["failed_engines"]:
            raise RuntimeError(f"engines refused the initial weights: {sync['failed_engines']}")
        self.progress.note(f"engines at weight version {self.version} ({sync['sync_bytes'] / 1e6:.0f} MB in "
                           f"{sync['sync_s']:.1f} s)")
        await self._write_processes()
        worker = ray.remote(EpisodeWorker)
        self.workers = [
            # max_restarts: a worker that dies (OOM, a crash) is started again; the groups it held
            # fail and are handled by the retry policy (_run_group).
            worker.options(num_cpus=0, max_concurrency=10_000, max_restarts=-1, name=f"{self.run_id}-episodes-{i}")
            .remote(self.cfg.model_dump(mode="json"), self.urls, self.buffer_name, self.run_id, i, str(self.run_dir))
            for i in range(self.cfg.cluster.episode_workers)
        ]
        self._worker_load = [0] * len(self.workers)
        await self._set_up_tasks(resumed)
        for g in self._resumable:  # buffer.resume_in_flight: the groups in flight at the crash go on
            self._launch_group(g["task_id"], None, resume=g)

    async def _note_recovery(self, resumed: dict | None) -> None:
        rec = await self.buffer.recovery.remote()
        for why in rec["malformed"][:5]:
            self.progress.note(f"replay log: skipped {why}")
        kept = rec["recovered_trajectories"]
        if resumed:
            self.progress.note(f"resumed from step {self.step}: {kept} acknowledged trajectories from the replay log, "
                               f"{rec['recovered_untrained_groups']} group(s) waiting to train")
        elif kept:
            self.progress.note(f"no checkpoint: starting at step 0, {kept} acknowledged trajectories kept "
                               f"({rec['recovered_untrained_groups']} complete group(s) waiting to train)")
        if rec["rolled_back_steps"]:
            self.progress.note(f"{rec['rolled_back_steps']} step(s) after the checkpoint were lost with the crash; "
                               "their groups train again")
        if rec["incomplete_at_resume"]:
            self.progress.note(f"{rec['incomplete_at_resume']} group(s) were incomplete at the crash: retired and "
                               "admitted again")
        self.seeds.on_resume(rec["next_draw"])
        retired = await self.buffer.pop_retired.remote()
        self.admission.on_resume(self.version, rec["recovered_untrained_groups"] + len(retired))
        self._handle_retired(retired)
        self._resumable = await self.buffer.resumable.remote()  # admitted again (on_start) when launched
        if self._resumable:
            eps = sum(len(g["snapshots"]) for g in self._resumable)
            self.progress.note(f"{len(self._resumable)} group(s) were in flight at the crash: they go on "
                               f"({eps} recorded episode(s) continue, the others start)")

    def _roll_back_metrics(self) -> None:
        """metrics.jsonl keeps only the steps of the surviving history: rows of steps after the
        checkpoint (their update was lost) move to metrics.rolled_back.jsonl."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        keep, drop = [], []
        for line in path.read_text().splitlines():
            try:
                (keep if json.loads(line).get("step", 0) <= self.step else drop).append(line)
            except ValueError:
                drop.append(line)
        if drop:
            with open(self.run_dir / "metrics.rolled_back.jsonl", "a") as f:
                f.write("\n".join(drop) + "\n")
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            tmp.replace(path)

    async def _set_up_tasks(self, resumed: dict | None) -> None:
        from agentrl.agent.runner import split_tasks
        from agentrl.policy.curriculum import PassRateCurriculum
        from agentrl.policy.sampling import RoundRobinSampler

        all_ids, suggested = await self.workers[0].task_ids.remote()
        self.train_tasks, self.eval_tasks = split_tasks(self.cfg, all_ids, suggested)
        if self.cfg.env.curriculum.sampler == "pass_rate":
            self.sampler = PassRateCurriculum.from_config(self.train_tasks, self.cfg.env.curriculum, seed=self.cfg.seed)
        else:
            self.sampler = RoundRobinSampler(self.train_tasks, self.cfg.seed)
        if resumed and resumed.get("sampler"):
            self.sampler.load_state_dict(resumed["sampler"])
        if resumed and resumed.get("dynamic_sampling"):
            self.dynamic.load_state_dict(resumed["dynamic_sampling"])
        self.progress.note(f"{len(self.train_tasks)} training task(s), {len(self.eval_tasks)} eval task(s)")

    # -- episodes ------------------------------------------------------------------------------
    def _admit(self) -> None:
        if self.cfg.mode == "sync":
            if self._group_tasks or self._training is not None:
                return
            cap = self.cfg.algorithm.prompts_per_step - self._ready_cache
        else:
            cap = self.admission.capacity(self.version)
        for _ in range(max(cap, 0)):
            if self.readmit:
                task_id, lineage = self.readmit.pop(0)
            else:
                task_id, lineage = self.unplayable.draw(self.sampler.next_task, self.train_tasks), None
                if task_id is None:
                    return  # this round's draws found only unplayable tasks; the next round draws again
            self._launch_group(task_id, lineage)

    def _launch_group(self, task_id: str, lineage: str | None, resume: dict | None = None) -> None:
        n = self.cfg.algorithm.group_size
        seeds: GroupSeeds | list[int] | None
        if resume:
            gid, seeds = resume["group_id"], resume.get("seeds")  # a continued group keeps its logged seeds
        else:
            gid = f"g{uuid.uuid4().hex[:10]}"  # unique across restarts; the seeds carry the reproducibility
            seeds = self.seeds.assign(lineage)
            self.seeds.started(lineage or gid, seeds)
        self._lineage[gid] = lineage or gid
        w = min(range(len(self.workers)), key=lambda i: self._worker_load[i])
        self._worker_load[w] += n
        self.admission.on_start()  # a resumed group counts whole, its accepted episodes too
        t = asyncio.create_task(self._run_group(w, task_id, gid, n, resume, seeds))
        self._group_tasks.add(t)
        t.add_done_callback(self._group_done)

    def _group_done(self, t: asyncio.Task) -> None:
        self._group_tasks.discard(t)
        self._wake.set()

    async def _run_group(self, w: int, task_id: str, gid: str, n: int, resume: dict | None = None,
                         seeds: GroupSeeds | list[int] | None = None) -> None:
        if isinstance(seeds, GroupSeeds):
            try:  # logged before any episode runs: a resumed run never draws these seeds again
                await self.buffer.admitted.remote(gid, task_id, seeds.draw, seeds.attempt, list(seeds.seeds))
            except Exception as e:  # the replay log cannot be written: nothing durable can follow
                self._worker_load[w] -= n
                self.admission.on_episodes_end(n)
                self.admission.on_group_retired()
                self.request_stop(f"the replay log refused group {gid}'s admission: {e}")
                return
            seeds = list(seeds.seeds)
        try:
            summaries = await self.workers[w].run_group.remote(task_id, gid, n, False, resume, seeds)
        except Exception as e:  # the worker actor died: the group cannot complete
            self.admission.on_episodes_end(n)
            self._handled.add(gid)
            try:  # what the worker had sent of this group can never complete: retire it, counted
                await self.buffer.retire_incomplete.remote(gid, "worker_lost")
            except Exception as err:  # noqa: BLE001 - the log keeps the trajectories; resume sees them
                self.progress.note(f"could not retire group {gid} of the failed worker: {err}")
            self.outcomes["infra_error:worker"] += n
            self.metrics.on_episodes_lost(n)
            again = self._on_group_left(gid, task_id, ["infra_error:worker"])
            self.progress.note(f"episode worker {w} failed ({type(e).__name__}) during group {gid} of {task_id}; "
                               + (f"re-admitting task {task_id}" if again else "its task is not retried"))
            return
        finally:
            self._worker_load[w] -= n
        self.admission.on_episodes_end(n)
        for s in summaries:
            self.metrics.on_episode(s)
            self.generated_tokens += s["generated"]
            if s["outcome"] == CANCELLED:
                continue
            self.outcomes[s["outcome"]] += 1
            if failure_kind(s["outcome"]) == "data" and s.get("error"):
                self.unplayable.note_error(task_id, s["error"])  # why, should the task be left out
            if s["outcome"] == INFRA_ERROR_PREFIX + "engine":
                # An engine that failed an episode may be dead: look now, not at the next interval,
                # so routers stop sending it new episodes that would fail the same way.
                self._engines_suspect = True
            if s["outcome"].startswith("infra_error") and s["outcome"] not in self._infra_seen:
                # The first failure of each kind says why, once (the rest are counted in metrics).
                self._infra_seen.add(s["outcome"])
                self.progress.note(f"first {s['outcome']} (task {task_id}): {s.get('error') or 'no detail'}")
        stopped = [s for s in summaries if s["outcome"] == CANCELLED]
        if stopped:
            await self._retire_cancelled(gid, task_id, summaries, stopped[0].get("error") or CANCELLED)
            return
        trainable = [s["reward"] or 0.0 for s in summaries if not s["outcome"].startswith("infra_error")]
        if len(trainable) == n:
            self.sampler.observe(task_id, trainable)
            await self._filter_zero_variance(gid, task_id, trainable)

    async def _retire_cancelled(self, gid: str, task_id: str, summaries: list[dict], reason: str) -> None:
        """A group the stale-cancellation policy stopped: the buffer retires it (its accepted
        trajectories stay in the log, accounted for by the record), and the fact comes back through
        _handle_retired like a stale group's (its admission slot frees up; stale_policy decides)."""
        self.cancelled["groups_cancelled_stale"] += 1
        self.cancelled["episodes_cancelled"] += sum(1 for s in summaries if s["outcome"] == CANCELLED)
        self.cancelled["tokens_cancelled"] += sum(s["generated"] for s in summaries)
        try:
            await self.buffer.retire_cancelled.remote(gid, task_id, reason)
        except Exception as err:  # noqa: BLE001 - the log keeps the trajectories; resume retires the group
            self.progress.note(f"could not retire cancelled group {gid}: {err}")

    async def _cancel_doomed(self) -> None:
        """Cancel the running groups that can never train (agentrl/policy/stale_cancel.py): right after
        a weight update, and every DOOM_CHECK_INTERVAL_S while their first tokens come back."""
        if (not self.cfg.buffer.cancel_stale_groups or self.cfg.mode != "async" or self.stale_cancel.per_token
                or not getattr(self, "workers", None)):
            return
        version, at = self._doom_checked
        if version == self.version and time.monotonic() - at < DOOM_CHECK_INTERVAL_S:
            return
        self._doom_checked = (self.version, time.monotonic())
        facts = await asyncio.gather(*(w.oldest_versions.remote() for w in self.workers), return_exceptions=True)
        cancels = [self.workers[w].cancel_group.remote(gid, self.stale_cancel.reason(oldest, self.version))
                   for w, groups in enumerate(facts) if isinstance(groups, dict)  # a failed worker: _run_group's
                   for gid, oldest in groups.items() if self.stale_cancel.doomed(oldest, self.version)]
        if cancels:
            await asyncio.gather(*cancels, return_exceptions=True)  # each cancelled group's _run_group follows up

    async def _filter_zero_variance(self, gid: str, task_id: str, rewards: list[float]) -> None:
        """Dynamic sampling: a group whose rewards are all equal carries no gradient; when the policy
        drops it, it leaves the buffer untrained and its admission slot goes to a new group."""
        from agentrl.policy.dynamic_sampling import GroupRewards

        sel = self.dynamic.select([GroupRewards(gid, task_id, tuple(rewards))])
        if sel.dropped and await self.buffer.retire_ready.remote(gid, ZERO_VARIANCE):
            self._handled.discard(gid)  # the buffer's fact comes back through _handle_retired

    def _handle_retired(self, retired: list) -> None:
        for r in retired:
            if r.group_id in self._handled:
                self._handled.discard(r.group_id)
                continue
            self._on_group_left(r.group_id, r.task_id, list(r.outcomes) or [f"infra_error:{r.reason}"],
                                stale=r.reason.startswith("stale"), reason=r.reason)

    def _on_group_left(self, gid: str, task_id: str, outcomes: list[str], stale: bool = False,
                       reason: str = "") -> bool:
        """A started group left untrained: its admission slot frees up and the policies say whether
        it runs again (returned; when not, their reason is noted)."""
        self.admission.on_group_retired()
        lineage = self._lineage.pop(gid, gid)
        again = self._run_again(task_id, lineage, outcomes, stale, reason)
        if not again:
            self.seeds.forget(lineage)
        return again

    def _run_again(self, task_id: str, lineage: str, outcomes: list[str], stale: bool, reason: str) -> bool:
        if reason == ZERO_VARIANCE:
            return False  # dynamic sampling: the freed slot admits a new group, not this one again
        if stale:
            if self.cfg.buffer.stale_policy == "regenerate":
                self.readmit.append((task_id, lineage))
                return True
            return False
        decision = self.retry.decide(lineage, outcomes)
        if decision.retry:
            self.readmit.append((task_id, lineage))
        else:
            self.progress.note(f"group of task {task_id}: {decision.reason}"
                               + ("; the task is left out of sampling" if decision.kind == "data" else ""))
            if decision.kind == "data":
                self.unplayable.mark(task_id, decision.reason)
        return decision.retry

    # -- evaluation ----------------------------------------------------------------------------
    def _start_eval(self, at_version: int) -> None:
        if not self.eval_tasks or at_version in self.eval_results:
            return
        self.eval_results[at_version] = {}
        t = asyncio.create_task(self._eval(at_version))
        self._eval_tasks.add(t)
        t.add_done_callback(self._eval_tasks.discard)

    async def _eval(self, at_version: int) -> None:
        from agentrl.agent.runner import passed

        n = self.cfg.env.eval_samples
        runs = [self.workers[i % len(self.workers)].run_group.remote(task, f"eval{at_version}-{task}", n, True)
                for i, task in enumerate(self.eval_tasks)]
        summaries = [s for group in await asyncio.gather(*runs) for s in group]
        for s in summaries:
            self.metrics.on_episode(s)
        scored = [s for s in summaries if not s["outcome"].startswith("infra_error")]
        n_pass = sum(1 for s in scored if passed(s["outcome"], s["reward"]))
        self.eval_results[at_version] = {
            "eval_version": at_version, "eval_pass_rate": n_pass / len(scored) if scored else None,
            "eval_samples": len(scored), "eval_infra_errors": len(summaries) - len(scored)}
        self.progress.note(f"eval at version {at_version}: {n_pass}/{len(scored)} passed")

    # -- training ------------------------------------------------------------------------------
    async def _train(self, batch: Any) -> dict:
        t0 = time.perf_counter()
        # The trajectories go buffer -> object store -> every rank; the driver holds only the reference.
        metrics = await self.trainers.train_step(self.buffer.batch_trajectories.remote(batch.batch_id))
        step = self.step + 1
        await self.buffer.mark_trained.remote(step, batch.batch_id)
        for g in batch.group_ids:
            lineage = self._lineage.pop(g, g)
            self.retry.on_trained(lineage)
            self.seeds.forget(lineage)
        sync = await self.trainers.push_weights(self._in_rotation())
        failed = sync.pop("failed_engines")
        if failed:
            # Dead or not, an engine that missed this update must not serve: routers stop sending to
            # it; the next health check restarts it if it died, re-sends the weights, and only then
            # puts it back (an engine that is up but failed mid-session may still be paused).
            self.progress.note(f"weight sync skipped {len(failed)} engine(s) that failed: {sorted(failed)}")
            for i, url in enumerate(self.urls):
                if url in failed and i not in self._out_of_rotation:
                    self._out_of_rotation.add(i)
                    await self._engine_down(i)
            self._engines_suspect = True
        self.version = await self.trainers.version()
        for i in range(len(self.urls)):
            if i not in self._out_of_rotation:
                self.metrics.set_engine(i, version=self.version)
        self.step = step
        if step % self.cfg.train.checkpoint_every == 0 or step == self.cfg.train.max_steps:
            await self._save_checkpoint()
        self.trainer_busy_s += time.perf_counter() - t0
        return {**metrics, **sync, **batch.tokens, "staleness_max": max(batch.staleness), "staleness_mean":
                sum(batch.staleness) / len(batch.staleness), "staleness": batch.staleness}

    async def _save_checkpoint(self) -> None:
        await self.trainers.save_checkpoint({"step": self.step, "outcomes": dict(self.outcomes),
                                             "sampler": self.sampler.state_dict(),
                                             "dynamic_sampling": self.dynamic.state_dict()})
        self._checkpointed_step = self.step

    def request_stop(self, reason: str) -> None:
        """End the run early but cleanly (a scheduler's SIGTERM, Ctrl-C): no new optimizer step
        starts, the one in flight finishes and is recorded, a checkpoint of it is saved unless the
        latest already holds it, then the usual shutdown runs. Episodes in flight are stopped; their
        acknowledged trajectories stay in the replay log. Safe to call from a signal handler on the
        loop (it only sets state)."""
        if self.stop_requested is None:
            self.stop_requested = reason
            self._wake.set()

    def _in_rotation(self) -> list[str]:
        return [u for i, u in enumerate(self.urls) if i not in self._out_of_rotation]

    def _record(self, metrics: dict, started: float) -> dict:
        now = time.perf_counter()
        wall, loop = now - started, now - (self.loop_started or started)
        row = {"step": self.step, "weight_version": self.version, "reward_mean": metrics["reward_mean"],
               "staleness_max": metrics["staleness_max"], "staleness_mean": metrics["staleness_mean"],
               "episodes_infra_error": sum(v for k, v in self.outcomes.items() if k.startswith("infra_error")),
               "episodes_finished": sum(self.outcomes.values()), "outcomes": dict(self.outcomes),
               "episodes_per_s": sum(self.outcomes.values()) / wall, "gen_tokens_per_s": self.generated_tokens / wall,
               "generated_tokens": self.generated_tokens, **{k: self.cancelled[k] for k in
                                                             ("groups_cancelled_stale", "episodes_cancelled", "tokens_cancelled")},
               # Over the loop only: start-up (model load, engine start) is its own field.
               "trainer_idle_ratio": 1.0 - self.trainer_busy_s / max(loop, 1e-9), "startup_s": self.startup_s,
               "trainer_busy_s": self.trainer_busy_s,  # cumulative over the loop: idle between any two rows
               "wall_s": wall, "time": time.time(), "retries": dict(self.retry.counters),
               **self.dynamic.metrics(), **self.sampler.metrics(),
               **{k: v for k, v in metrics.items() if k not in ("reward_mean", "staleness_max", "staleness_mean")}}
        done_evals = [r for r in self.eval_results.values() if r.get("eval_pass_rate") is not None]
        if done_evals:
            row.update(max(done_evals, key=lambda r: r["eval_version"]))
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        self.progress.step(row)
        self.metrics.on_step(row)
        self.loggers.log(row)
        return row

    # -- the loop ------------------------------------------------------------------------------
    async def run(self) -> dict:
        started = time.perf_counter()
        last_row: dict = {}
        try:
            await self._start()
            self.loop_started = time.perf_counter()
            self.startup_s = self.loop_started - started
            if self.cfg.env.eval_every:
                self._start_eval(self.version)
            last_health = time.monotonic()
            B = self.cfg.algorithm.prompts_per_step  # noqa: N806 - the batch size of the formulas
            while (self.step < self.cfg.train.max_steps and not self.stop_requested) or self._training is not None:
                self._handle_retired(await self.buffer.pop_retired.remote())
                self._ready_cache = await self.buffer.ready_groups.remote()
                self._admit()
                await self._cancel_doomed()
                self._update_gauges()
                if (self._training is None and self.step < self.cfg.train.max_steps and not self.stop_requested
                        and self._ready_cache >= B):
                    batch = await self.buffer.take_batch.remote(B, self.version)
                    if batch is not None:
                        self._training = asyncio.create_task(self._train(batch))
                if self._training is not None and self._training.done():
                    metrics = self._training.result()
                    self._training = None
                    last_row = self._record(metrics, started)
                    if self.step % PLOT_EVERY_STEPS == 0:
                        self._plot()
                    if self.cfg.env.eval_every and self.step % self.cfg.env.eval_every == 0:
                        self._start_eval(self.version)
                    continue
                if time.monotonic() - last_health > ENGINE_CHECK_INTERVAL_S or self._engines_suspect:
                    self._engines_suspect = False
                    await self._check_engines()
                    last_health = time.monotonic()
                await self._sleep(B)
            self.generated_unfinished = await self._tokens_in_flight()
            if self.stop_requested:
                await self._stop_early()
            else:
                if self.cfg.env.eval_every:
                    self._start_eval(self.version)
                await asyncio.gather(*self._eval_tasks)
            self._plot()
            summary = {"steps": self.step, "wall_s": time.perf_counter() - started, "startup_s": self.startup_s,
                       "stopped": self.stop_requested, "generated_tokens": self.generated_tokens,
                       "generated_tokens_unfinished": self.generated_unfinished, **self.cancelled,
                       "last": last_row,
                       "evals": sorted(self.eval_results.values(), key=lambda r: r.get("eval_version", 0)),
                       "buffer": await self.buffer.stats.remote(), "retries": dict(self.retry.counters)}
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            return summary
        finally:
            self.progress.end()
            self.loggers.close(failed=sys.exc_info()[0] is not None)
            await self._shutdown()

    async def _tokens_in_flight(self) -> int:
        """Tokens generated so far by the training episodes still running (counted nowhere else)."""
        counts = await asyncio.gather(*(w.tokens_in_flight.remote() for w in self.workers), return_exceptions=True)
        return sum(c for c in counts if isinstance(c, int))

    async def _stop_early(self) -> None:
        """request_stop's end: evals still running are dropped (their episodes are stopped with the
        workers), and the last step is checkpointed so that a resume loses no optimizer step."""
        for t in self._eval_tasks:
            t.cancel()
        await asyncio.gather(*self._eval_tasks, return_exceptions=True)
        if self.step > 0 and self._checkpointed_step != self.step:
            self.progress.note(f"stopping ({self.stop_requested}): saving a checkpoint of step {self.step}")
            await self._save_checkpoint()

    async def _sleep(self, batch_groups: int) -> None:
        """Until the buffer has a batch (or a retired group), a group's episodes end, the step in
        flight finishes, or LOOP_TICK_S passes."""
        self._wake.clear()
        waits = [asyncio.ensure_future(self.buffer.wait_ready.remote(batch_groups, LOOP_TICK_S)),
                 asyncio.ensure_future(self._wake.wait())]
        if self._training is not None:
            waits.append(self._training)
        done, pending = await asyncio.wait(waits, timeout=LOOP_TICK_S + 1.0, return_when=asyncio.FIRST_COMPLETED)
        for f in pending:
            if f is not self._training:
                f.cancel()

    def _update_gauges(self) -> None:
        self.metrics.set_in_flight(self.admission.running_episodes, 0)
        self.metrics.set_buffer(self._ready_cache)
        self.progress.update(step=self.step, version=self.version, in_flight=self.admission.running_episodes,
                             buffer=self._ready_cache, outcomes=self.outcomes, metrics=self.metrics)

    def _plot(self) -> None:
        from agentrl.plot import plot_run

        try:
            plot_run(self.run_dir, evals={v: r.get("eval_pass_rate") for v, r in self.eval_results.items()})
        except Exception as e:  # a plot must never take the run down
            self.progress.note(f"could not draw curves.png: {e}")

    async def _check_engines(self) -> None:
        # Routers stop sending to a restarted engine; it rejoins only once it holds the current
        # weights, so no episode is served by the restarted engine's initial weights.
        restarted = await self.engines.check(on_down=self._engine_down)
        for i in restarted:
            self.progress.note(f"engine {i} restarted; re-sending weights version {self.version}")
            self._out_of_rotation.add(i)
        if restarted:
            await self._write_processes()
        for i in sorted(self._out_of_rotation):
            sync = await self.trainers.push_weights([self.urls[i]])
            if not sync["failed_engines"]:
                self._out_of_rotation.discard(i)
                await asyncio.gather(*(w.engine_up.remote(self.urls[i]) for w in self.workers))
        for i in range(len(self.urls)):
            try:
                self.metrics.set_engine_from_server_info(i, await self.engines.server_info(i))
            except Exception:  # noqa: BLE001 - an engine between restarts has no info; the next check retries
                pass

    async def _write_processes(self) -> None:
        """RUN_DIR/processes.json: where every trainer rank and engine runs (node IP, pid), for
        operators and for tests that must end exactly the process they mean."""
        engines = [{"index": i, "url": u, "pid": await self.engines.pid(i)} for i, u in enumerate(self.urls)]
        tmp = self.run_dir / "processes.json.tmp"
        tmp.write_text(json.dumps({"trainers": self.trainers.info, "engines": engines}, indent=2))
        tmp.replace(self.run_dir / "processes.json")

    async def _engine_down(self, i: int) -> None:
        await asyncio.gather(*(w.engine_down.remote(self.urls[i]) for w in self.workers))

    async def _sweep_sandboxes(self, stale_only: bool = False) -> None:
        """Delete the sandboxes episode workers did not close (a worker interrupted by Ctrl-C or
        killed leaves its sandboxes behind); at start, those of earlier runs that died."""
        from agentrl.sandbox.factory import make_provider

        try:
            provider = make_provider(self.cfg.sandbox, self.run_id)
            n = await (provider.sweep_stale() if stale_only else provider.sweep())
            await provider.aclose()
        except Exception as e:  # noqa: BLE001 - report and go on
            self.progress.note(f"could not sweep sandboxes: {e}")
            return
        if n:
            what = "of earlier runs that died" if stale_only else "the episode workers left behind"
            self.progress.note(f"deleted {n} sandbox(es) {what}")

    async def _shutdown(self) -> None:
        for t in list(self._group_tasks) + list(self._eval_tasks):
            t.cancel()
        if getattr(self, "workers", None):
            await asyncio.gather(*(w.shutdown.remote() for w in self.workers), return_exceptions=True)
            await self._sweep_sandboxes()
        if getattr(self, "engines", None):
            try:
                await self.engines.stop()
            except Exception as e:  # noqa: BLE001 - shutting down: report and go on
                self.progress.note(f"could not stop every engine: {e}")
        if self.ray is not None:
            self.ray.shutdown()


async def _together(*calls: Any) -> list[Any]:
    """Await calls concurrently; on the first failure cancel the rest (what they started is
    stopped by Orchestrator._shutdown) and raise that failure itself, not an ExceptionGroup, so
    that the launcher's handling of each error type still sees it."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
