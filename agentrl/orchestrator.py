"""The run loop: admit episodes, drain complete groups into training, sync weights, repeat.

async mode: generation never waits for training. Groups are admitted whenever the staleness-
aware capacity allows; the trainer takes a batch as soon as enough complete groups are in the
buffer; weights go to the engines after every step while episodes keep running.
sync mode (for comparison): admit one step's groups, wait for all of them, train, sync, repeat.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import time
import uuid
from collections import Counter, deque
from pathlib import Path
from typing import Any

from agentrl.buffer.staleness import AdmissionControl
from agentrl.config.plan import RunPlan
from agentrl.config.schema import RunConfig
from agentrl.loggers import RunLoggers
from agentrl.progress import Progress


class Orchestrator:
    def __init__(self, cfg: RunConfig, plan: RunPlan, progress: Progress | None = None):
        self.cfg, self.plan = cfg, plan
        self.run_dir = Path(cfg.logging.run_dir)
        self.run_id = f"{cfg.recipe}-{uuid.uuid4().hex[:8]}"
        self.progress = progress or Progress()
        a = cfg.algorithm
        self.admission = AdmissionControl(a.prompts_per_step, a.group_size, cfg.buffer.max_staleness,
                                          cfg.buffer.max_episodes_in_flight, cfg.buffer.max_tokens_in_flight)
        self.outcomes: Counter[str] = Counter()
        self.generated_tokens = 0
        self.regen: deque[str] = deque()
        self.version = 0
        self.step = 0
        self.trainer_busy_s = 0.0
        self.eval_results: dict[int, dict] = {}
        self._group_tasks: set[asyncio.Task] = set()
        self._eval_tasks: set[asyncio.Task] = set()
        self._worker_load: list[int] = []
        self._engines_suspect = False
        self._training: asyncio.Task | None = None  # the optimizer step in flight, if any
        self._ready_cache = 0  # complete groups in the buffer, as of this loop iteration
        self._out_of_rotation: set[str] = set()  # restarted engines still waiting for current weights
        self.loggers = RunLoggers([])  # tensorboard / wandb, opened in _start when configured

    # -- set-up --------------------------------------------------------------------------------
    async def _start(self) -> None:
        import ray

        from agentrl.buffer.replay import ReplayBuffer
        from agentrl.cluster.actors import EngineActor, EpisodeWorker, TrainerWorker
        from agentrl.cluster.ray_env import engine_bundles, in_bundle, init_ray, role_placement_group, trainer_bundles

        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(self.cfg.model_dump_json(indent=2))
        self.loggers = RunLoggers.open(self.cfg.logging, self.run_dir, self.run_id,
                                       self.cfg.model_dump(mode="json"), note=self.progress.note)
        self.ray = init_ray(self.cfg)
        from agentrl.metrics import RunMetrics

        self.metrics = RunMetrics(self.run_id)
        if self.ray.dashboard_url:
            self.progress.note(f"Ray dashboard: {self.ray.dashboard_url}")
        self.progress.begin(self.run_id, self.cfg.mode, self.cfg.train.max_steps, self.ray.dashboard_url)
        cfg_dict = self.cfg.model_dump(mode="json")

        self.train_pg = role_placement_group("train", trainer_bundles(self.plan), f"{self.run_id}-train")
        self.infer_pg = role_placement_group("inference", engine_bundles(self.plan), f"{self.run_id}-inference")
        self.progress.note(f"loading {self.cfg.model.name} in the trainer")
        self.trainer = ray.remote(TrainerWorker).options(num_cpus=1, **in_bundle(self.train_pg, 0)).remote(
            cfg_dict, str(self.run_dir))
        resumed = await self.trainer.resume.remote()
        if resumed:
            self.step = int(resumed["step"])
            self.outcomes.update(resumed.get("outcomes", {}))
            self.progress.note(f"resumed from step {self.step}")
        self.version = await self.trainer.version.remote()
        # Named, so that episode workers look it up instead of receiving its handle: Ray cannot
        # restart an actor whose constructor arguments hold references (ray issue 53727).
        self.buffer_name = f"{self.run_id}-replay-buffer"
        self.buffer = ray.remote(ReplayBuffer).options(num_cpus=0, name=self.buffer_name).remote(
            str(self.run_dir), self.cfg.algorithm.group_size, self.cfg.buffer.max_staleness,
            self.cfg.buffer.stale_policy, self.cfg.buffer.fsync, resume_step=self.step)

        # engine_bundles() gives one bundle per node an engine spans: engine i starts at the bundle
        # after all earlier engines' nodes. GPUs are requested so Ray sets CUDA_VISIBLE_DEVICES.
        self.engines, first_bundle = [], 0
        for e in self.plan.engines:
            gpus = e.gpus // len(e.nodes) if e.gpus else 0
            self.engines.append(ray.remote(EngineActor).options(
                num_cpus=0, num_gpus=gpus, max_concurrency=4, **in_bundle(self.infer_pg, first_bundle)).remote(
                e.index, e.command, self.cfg.cluster.host, e.port, e.env, str(self.run_dir)))
            first_bundle += len(e.nodes)
        self.progress.note(f"starting {len(self.engines)} {self.plan.engine_kind} engine(s)")
        self.urls = list(await asyncio.gather(*(e.start.remote() for e in self.engines)))
        sync = await self.trainer.push_weights.remote(self.urls)
        if sync["failed_engines"]:
            raise RuntimeError(f"engines refused the initial weights: {sync['failed_engines']}")
        self.progress.note(f"engines at weight version {self.version} ({sync['sync_bytes'] / 1e6:.0f} MB in "
                           f"{sync['sync_s']:.1f} s)")
        self.workers = [
            # max_restarts: a worker that dies (OOM, a crash) is started again; the groups it held
            # fail and are re-admitted by _run_group.
            ray.remote(EpisodeWorker).options(num_cpus=0, max_concurrency=10_000, max_restarts=-1).remote(
                cfg_dict, self.urls, self.buffer_name, self.run_id, i, str(self.run_dir))
            for i in range(self.cfg.cluster.episode_workers)
        ]
        self._worker_load = [0] * len(self.workers)
        self.train_tasks, self.eval_tasks = await self._splits()
        rng = random.Random(self.cfg.seed)
        order = list(self.train_tasks)
        rng.shuffle(order)
        self.task_iter = itertools.cycle(order)
        self.progress.note(f"{len(self.train_tasks)} training task(s), {len(self.eval_tasks)} eval task(s)")

    async def _splits(self) -> tuple[list[str], list[str]]:
        """Training and eval tasks: the config's lists, else the env's own splits, else all tasks."""
        all_ids, splits = await self.workers[0].task_ids.remote()
        env = self.cfg.env
        eval_ids = list(env.eval_tasks or splits.get("eval", []))
        train = list(env.train_tasks or splits.get("train") or [t for t in all_ids if t not in eval_ids])
        unknown = [t for t in train + eval_ids if t not in all_ids]
        if unknown:
            raise ValueError(f"env.train_tasks / env.eval_tasks name unknown task(s) {unknown}; known: {all_ids}")
        if not train:
            raise ValueError("no training task: set env.train_tasks or point env.tasks_dir at a folder of tasks")
        return train, eval_ids

    # -- episodes ------------------------------------------------------------------------------
    def _admit(self) -> None:
        if self.cfg.mode == "sync":
            if self._group_tasks or self._training is not None:
                return
            cap = self.cfg.algorithm.prompts_per_step - self._ready_cache
        else:
            cap = self.admission.capacity(self.version)
        for _ in range(max(cap, 0)):
            task_id = self.regen.popleft() if self.regen else next(self.task_iter)
            self._launch_group(task_id)

    def _launch_group(self, task_id: str) -> None:
        n = self.cfg.algorithm.group_size
        gid = f"g{uuid.uuid4().hex[:10]}"
        w = min(range(len(self.workers)), key=lambda i: self._worker_load[i])
        self._worker_load[w] += n
        self.admission.on_start(n)
        t = asyncio.create_task(self._run_group(w, task_id, gid, n))
        self._group_tasks.add(t)
        t.add_done_callback(self._group_tasks.discard)

    async def _run_group(self, w: int, task_id: str, gid: str, n: int) -> None:
        try:
            summaries = await self.workers[w].run_group.remote(task_id, gid, n)
        except Exception as e:  # the worker actor died: the group cannot complete
            self.progress.note(f"episode worker {w} failed ({type(e).__name__}); re-admitting task {task_id}")
            try:  # what the worker had sent of this group can never complete: retire it, counted
                await self.buffer.retire_incomplete.remote(gid, "worker_lost")
            except Exception as err:  # noqa: BLE001 - the log keeps the trajectories; resume sees them
                self.progress.note(f"could not retire group {gid} of the failed worker: {err}")
            self.outcomes["infra_error:worker"] += n
            self.metrics.on_episodes_lost(n)
            for _ in range(n):
                self.admission.on_episode_end()
            self.admission.on_group_retired()
            self.regen.append(task_id)
            return
        finally:
            self._worker_load[w] -= n
        for s in summaries:
            self.metrics.on_episode(s)
            self.outcomes[s["outcome"]] += 1
            self.generated_tokens += s["generated"]
            self.admission.on_episode_end(s["tokens"])

    async def _collect_regenerations(self) -> None:
        for item in await self.buffer.pop_regenerate.remote():
            self.admission.on_group_retired()
            self.regen.append(item["task_id"])

    # -- evaluation ----------------------------------------------------------------------------
    def _start_eval(self, at_version: int) -> None:
        if not self.eval_tasks or at_version in self.eval_results:
            return
        self.eval_results[at_version] = {}
        t = asyncio.create_task(self._eval(at_version))
        self._eval_tasks.add(t)
        t.add_done_callback(self._eval_tasks.discard)

    async def _eval(self, at_version: int) -> None:
        n = self.cfg.env.eval_samples
        runs = [self.workers[i % len(self.workers)].run_group.remote(task, f"eval{at_version}-{task}", n, True)
                for i, task in enumerate(self.eval_tasks)]
        summaries = [s for group in await asyncio.gather(*runs) for s in group]
        for s in summaries:
            self.metrics.on_episode(s)
        scored = [s for s in summaries if not s["outcome"].startswith("infra_error")]
        passed = sum(1 for s in scored if (s["reward"] or 0.0) >= 1.0)
        self.eval_results[at_version] = {
            "eval_version": at_version, "eval_pass_rate": passed / len(scored) if scored else None,
            "eval_samples": len(scored), "eval_infra_errors": len(summaries) - len(scored)}
        self.progress.note(f"eval at version {at_version}: {passed}/{len(scored)} passed")

    # -- training ------------------------------------------------------------------------------
    async def _train(self, batch: Any) -> dict:
        t0 = time.perf_counter()
        group_ids = [t.group_id for t in batch.trajectories]
        metrics = await self.trainer.train_step.remote(batch.trajectories, group_ids)
        step = self.step + 1
        await self.buffer.mark_trained.remote(step, batch.group_ids)
        sync = await self.trainer.push_weights.remote(self.urls)
        failed = sync.pop("failed_engines")
        if failed:  # a dead engine: restarted and re-sent these weights by the next health check
            self.progress.note(f"weight sync skipped {len(failed)} engine(s) that failed: {sorted(failed)}")
            self._engines_suspect = True
        self.version = await self.trainer.version.remote()
        for i in range(len(self.engines)):
            self.metrics.set_engine(i, version=self.version)
        self.step = step
        if step % self.cfg.train.checkpoint_every == 0 or step == self.cfg.train.max_steps:
            await self.trainer.save_checkpoint.remote({"step": step, "outcomes": dict(self.outcomes)})
        self.trainer_busy_s += time.perf_counter() - t0
        return {**metrics, **sync, "staleness_max": max(batch.staleness), "staleness_mean":
                sum(batch.staleness) / len(batch.staleness), "staleness": batch.staleness}

    def _record(self, metrics: dict, started: float) -> dict:
        wall = time.perf_counter() - started
        row = {"step": self.step, "weight_version": self.version, "reward_mean": metrics["reward_mean"],
               "staleness_max": metrics["staleness_max"], "staleness_mean": metrics["staleness_mean"],
               "episodes_infra_error": sum(v for k, v in self.outcomes.items() if k.startswith("infra_error")),
               "episodes_finished": sum(self.outcomes.values()), "outcomes": dict(self.outcomes),
               "episodes_per_s": sum(self.outcomes.values()) / wall, "gen_tokens_per_s": self.generated_tokens / wall,
               "trainer_idle_ratio": 1.0 - self.trainer_busy_s / wall, "wall_s": wall, "time": time.time(),
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
            if self.cfg.env.eval_every:
                self._start_eval(self.version)
            last_health = time.monotonic()
            while self.step < self.cfg.train.max_steps or self._training is not None:
                await self._collect_regenerations()
                self._ready_cache = await self.buffer.ready_groups.remote()
                self._admit()
                self.metrics.set_in_flight(self.admission.running_episodes, self.admission.tokens_in_flight)
                self.metrics.set_buffer(self._ready_cache)
                self.progress.update(step=self.step, version=self.version, in_flight=self.admission.running_episodes,
                                     buffer=self._ready_cache, outcomes=self.outcomes, metrics=self.metrics)
                if (self._training is None and self.step < self.cfg.train.max_steps
                        and self._ready_cache >= self.cfg.algorithm.prompts_per_step):
                    batch = await self.buffer.take_batch.remote(self.cfg.algorithm.prompts_per_step, self.version)
                    if batch is not None:
                        self._training = asyncio.create_task(self._train(batch))
                if self._training is not None and self._training.done():
                    metrics = self._training.result()
                    self._training = None
                    last_row = self._record(metrics, started)
                    if self.step % 5 == 0:
                        self._plot()
                    if self.cfg.env.eval_every and self.step % self.cfg.env.eval_every == 0:
                        self._start_eval(self.version)
                if time.monotonic() - last_health > 5.0 or self._engines_suspect:
                    self._engines_suspect = False
                    await self._check_engines()
                    last_health = time.monotonic()
                await asyncio.sleep(0.05)
            if self.cfg.env.eval_every:
                self._start_eval(self.version)
            await asyncio.gather(*self._eval_tasks)
            self._plot()
            summary = {"steps": self.step, "wall_s": time.perf_counter() - started, "last": last_row,
                       "evals": sorted(self.eval_results.values(), key=lambda r: r.get("eval_version", 0)),
                       "buffer": await self.buffer.stats.remote()}
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            return summary
        finally:
            self.progress.end()
            self.loggers.close(failed=sys.exc_info()[0] is not None)
            await self._shutdown()

    def _plot(self) -> None:
        from agentrl.plot import plot_run

        try:
            plot_run(self.run_dir, evals={v: r.get("eval_pass_rate") for v, r in self.eval_results.items()})
        except Exception as e:  # a plot must never take the run down
            self.progress.note(f"could not draw curves.png: {e}")

    async def _check_engines(self) -> None:
        for i, e in enumerate(self.engines):
            url = self.urls[i]
            if not await e.alive.remote():
                # Routers stop sending to it first; it rejoins only once it holds the current
                # weights, so no episode is served by the restarted engine's initial weights.
                await asyncio.gather(*(w.engine_down.remote(url) for w in self.workers))
                await e.ensure_alive.remote()
                self.progress.note(f"engine {i} restarted; re-sending weights version {self.version}")
                self._out_of_rotation.add(url)
            if url in self._out_of_rotation:
                sync = await self.trainer.push_weights.remote([url])
                if not sync["failed_engines"]:
                    self._out_of_rotation.discard(url)
                    await asyncio.gather(*(w.engine_up.remote(url) for w in self.workers))
            try:
                self.metrics.set_engine_from_server_info(i, await e.server_info.remote())
            except Exception:  # an engine between restarts has no info; the next check retries
                pass

    async def _sweep_sandboxes(self) -> None:
        """Delete the run's sandboxes that episode workers did not close: a worker interrupted by
        Ctrl-C (the whole process group gets SIGINT) or killed leaves its sandboxes behind."""
        from agentrl.sandbox.factory import make_provider

        try:
            provider = make_provider(self.cfg.sandbox, self.run_id)
            n = await provider.sweep()
            await provider.aclose()
        except Exception as e:  # noqa: BLE001 - shutting down: report and go on
            self.progress.note(f"could not sweep this run's sandboxes: {e}")
            return
        if n:
            self.progress.note(f"deleted {n} sandbox(es) the episode workers left behind")

    async def _shutdown(self) -> None:
        import ray

        for t in list(self._group_tasks) + list(self._eval_tasks):
            t.cancel()
        if getattr(self, "workers", None):
            await asyncio.gather(*(w.shutdown.remote() for w in self.workers), return_exceptions=True)
            await self._sweep_sandboxes()
        if getattr(self, "engines", None):
            await asyncio.gather(*(e.stop.remote() for e in self.engines), return_exceptions=True)
        if getattr(self, "ray", None) and self.ray.started_here:
            ray.shutdown()
