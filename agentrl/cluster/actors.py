"""The actors of a run, as plain classes; the orchestrator makes them Ray actors with
`ray.remote(...)`, so importing this module starts nothing.

- TrainerWorker: owns the TrainerBackend; trains on batches, pushes weights to engines, checkpoints.
- EngineActor: owns one engine process (SGLang or embedded), restarts it when it dies.
- EpisodeWorker: runs many episodes at once on one asyncio loop; sends trajectories to the buffer.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from agentrl.agent.trajectory import Trajectory
from agentrl.config.schema import RunConfig


class TrainerWorker:
    def __init__(self, cfg: dict, run_dir: str):
        import torch

        from agentrl.models.policy import load_policy
        from agentrl.train.torch_backend import TorchBackend

        self.cfg = RunConfig.model_validate(cfg)
        self.run_dir = Path(run_dir)
        torch.manual_seed(self.cfg.seed)
        backend = self.cfg.train.backend
        if backend == "megatron" or (backend == "auto" and torch.cuda.is_available()):
            from agentrl.train.megatron_backend import megatron_backend_from_config

            self.backend = megatron_backend_from_config(self.cfg, self.run_dir)
            return
        model, tok = load_policy(self.cfg.model.path or self.cfg.model.name, seed=self.cfg.seed,
                                 cache_dir=self.run_dir / "model_cache")
        self.backend = TorchBackend(model, self.cfg.train, self.cfg.algorithm,
                                    pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
                                    temperature=self.cfg.rollout.temperature, run_dir=self.run_dir)

    def version(self) -> int:
        return self.backend.version

    def resume(self) -> dict | None:
        """Load the latest checkpoint if there is one; returns its extra state (step, counters)."""
        latest = self.run_dir / "checkpoints" / "latest"
        if not latest.exists():
            return None
        return self.backend.load_checkpoint(latest)

    def train_step(self, trajectories: list[Trajectory], group_ids: list[str]) -> dict[str, float]:
        return self.backend.train_step(trajectories, group_ids)

    async def push_weights(self, urls: list[str]) -> dict[str, float]:
        from agentrl.sync.weights import push_weights

        return await push_weights(urls, self.backend.named_weights(), self.backend.version,
                                  pause_mode=self.cfg.rollout.pause_mode, fp8=self.cfg.rollout.weight_sync_fp8)

    def save_checkpoint(self, extra: dict) -> None:
        self.backend.save_checkpoint(self.run_dir / "checkpoints" / "latest", extra)


class EngineActor:
    def __init__(self, index: int, argv: list[str], host: str, port: int, env: dict[str, str], run_dir: str):
        from agentrl.cluster.engine_process import EngineProcess, local_engine_argv

        self.index = index
        argv, self.url = local_engine_argv(argv, host, port)  # the actor's own interpreter
        self.proc = EngineProcess(argv, self.url, Path(run_dir) / "logs" / f"engine_{index}.log", env=env)

    async def start(self) -> str:
        await self.proc.start()
        return self.url

    async def ensure_alive(self) -> bool:
        return await self.proc.ensure_alive()

    def alive(self) -> bool:
        return self.proc.alive()

    def pid(self) -> int | None:
        return self.proc.pid

    async def server_info(self) -> dict:
        from agentrl.rollout.client import EngineClient

        async with EngineClient(self.url, timeout_s=5.0) as c:
            return await c.server_info()

    def stop(self) -> None:
        self.proc.stop()


class EpisodeWorker:
    """Runs groups of episodes; every episode talks to the engines through a session-affine router."""

    def __init__(self, cfg: dict, engine_urls: list[str], buffer: Any, run_id: str, index: int, run_dir: str):
        """`buffer`: the replay buffer actor, or its name (looked up here, so a restarted worker
        finds it again)."""
        self.cfg = RunConfig.model_validate(cfg)
        self.engine_urls = list(engine_urls)
        if isinstance(buffer, str):
            import ray

            buffer = ray.get_actor(buffer)
        self.buffer = buffer
        self.run_id = run_id
        self.index = index
        self.run_dir = Path(run_dir)
        self._ready = False
        self._tasks: set[asyncio.Task] = set()

    def _setup(self) -> None:
        if self._ready:
            return
        from agentrl.envs.registry import available_envs
        from agentrl.models.tokenizer import load_tokenizer, stop_token_ids
        from agentrl.rollout.router import Router
        from agentrl.rollout.types import SamplingParams
        from agentrl.sandbox.factory import make_provider

        self.tokenizer = load_tokenizer(self.cfg.model.path or self.cfg.model.name)
        self.router = Router(self.engine_urls, timeout_s=self.cfg.rollout.request_timeout_s)
        from agentrl.metrics import RunMetrics

        self.metrics = RunMetrics(self.run_id)
        self.provider = self.metrics.wrap_provider(make_provider(self.cfg.sandbox, self.run_id))
        eps = available_envs()
        if self.cfg.env.name not in eps:
            raise ValueError(f"env.name={self.cfg.env.name!r} is not installed; known: {', '.join(eps)}")
        self.env_cls = eps[self.cfg.env.name].load()
        r = self.cfg.rollout
        self.sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                       stop_token_ids=stop_token_ids(self.tokenizer))
        self.transcripts = None
        if self.cfg.logging.transcripts:
            (self.run_dir / "transcripts").mkdir(parents=True, exist_ok=True)
            self.transcripts = open(self.run_dir / "transcripts" / f"worker_{self.index}.jsonl", "a")
        self._ready = True

    def _make_env(self):
        if hasattr(self.env_cls, "from_config"):
            return self.env_cls.from_config(self.cfg, provider=self.provider)
        return self.env_cls(**self.cfg.env.kwargs)

    def task_ids(self) -> tuple[list[str], dict[str, list[str]]]:
        """The env's task ids and its suggested splits ({"train": [...], "eval": [...]} or {})."""
        self._setup()
        env = self._make_env()
        splits = env.splits() if hasattr(env, "splits") else {}
        return list(env.task_ids()), dict(splits)

    def engine_down(self, url: str) -> None:
        """Stop routing to `url` (it died); its sessions move to their next engine on the ring."""
        self._setup()
        self.router.mark_down(url)

    def engine_up(self, url: str) -> None:
        """`url` is back and holds the current weights: its sessions return to it."""
        self._setup()
        self.router.mark_up(url)

    async def run_group(self, task_id: str, group_id: str, n: int, evaluate: bool = False) -> list[dict]:
        """Run n episodes of one task concurrently; trajectories go to the buffer unless evaluating.
        Returns one summary per episode."""
        self._setup()
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            return list(await asyncio.gather(*(self._episode(task_id, group_id, k, evaluate) for k in range(n))))
        finally:
            self._tasks.discard(task)

    async def _episode(self, task_id: str, group_id: str, k: int, evaluate: bool) -> dict:
        from agentrl.agent.episode import run_episode
        from agentrl.view import turn_versions

        episode_id = f"{group_id}-{k}"
        t0 = time.time()
        traj = await run_episode(self._make_env(), self.router, self.tokenizer, task_id, self.cfg.agent,
                                 self.sampling, episode_id, group_id)
        if not evaluate:
            await self.buffer.add.remote(traj)
        summary = {"episode_id": episode_id, "task_id": task_id, "group_id": group_id, "outcome": traj.outcome,
                   "reward": traj.reward, "tokens": len(traj.token_ids), "generated": traj.num_generated,
                   "turns": traj.num_turns, "oldest_version": traj.oldest_version, "evaluate": evaluate,
                   "duration_s": time.time() - t0}
        if self.transcripts is not None:
            self.transcripts.write(json.dumps({
                **summary, "time": time.time(), "timings": traj.timings, "info": traj.info,
                "turn_versions": turn_versions(traj.loss_mask, traj.weight_versions),
                "text": self.tokenizer.decode(traj.token_ids[traj.prompt_len:]),
                "versions": sorted({v for v in traj.weight_versions if v >= 0}),
            }) + "\n")
            self.transcripts.flush()
        return summary

    async def shutdown(self) -> None:
        """Cancel running episodes (each closes its sandbox in `finally`) and sweep leftovers."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ready:
            await self.provider.aclose()
            if self.transcripts:
                self.transcripts.close()
