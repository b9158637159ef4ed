"""The one episode harness: what the run loop's episode workers, `agentrl eval` and the learning
benchmark all use to play an episode of a run config and report it.

Defined once here: the env of a run (registry.make_run_env), the sampling parameters of a run, the
pass rule, the train / eval split, and the per-episode summary every report is built from.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentrl.agent.trajectory import SCORED, Trajectory
from agentrl.config.schema import RunConfig
from agentrl.rollout.types import Generator, SamplingParams

PASS_REWARD = 1.0  # an episode passes when its tests gave it the full reward


def passed(outcome: str, reward: float | None) -> bool:
    """The pass rule of every report: scored by the task's tests with the full reward."""
    return outcome == SCORED and reward is not None and reward >= PASS_REWARD


def sampling_params(cfg: RunConfig, tokenizer: Any) -> SamplingParams:
    """The sampling parameters of a run's episodes (training, evaluation and benchmarks alike)."""
    from agentrl.models.tokenizer import stop_token_ids

    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                          stop_token_ids=stop_token_ids(tokenizer))


def split_tasks(cfg: RunConfig, all_ids: list[str], suggested: dict[str, list[str]]) -> tuple[list[str], list[str]]:
    """(train, eval) task ids: the config's lists, else the env's suggested splits, else every task
    not held out for eval. Unknown ids and an empty training set are errors naming the field."""
    env = cfg.env
    eval_ids = list(env.eval_tasks or suggested.get("eval", []))
    train = list(env.train_tasks or suggested.get("train") or [t for t in all_ids if t not in eval_ids])
    unknown = [t for t in train + eval_ids if t not in all_ids]
    if unknown:
        raise ValueError(f"env.train_tasks / env.eval_tasks name unknown task(s) {unknown}; known: {all_ids}")
    if not train:
        raise ValueError("no training task: set env.train_tasks or point env.tasks_dir at a folder of tasks")
    return train, eval_ids


@dataclass(frozen=True)
class EpisodeSummary:
    """What every report says of one episode (the trajectory itself goes to the buffer)."""

    episode_id: str
    task_id: str
    group_id: str
    outcome: str
    reward: float | None
    tokens: int
    generated: int
    turns: int
    oldest_version: int | None
    evaluate: bool
    duration_s: float
    error: str | None = None  # why an infra_error episode failed, in one line (capped)

    @property
    def passed(self) -> bool:
        return passed(self.outcome, self.reward)

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


class EpisodeRunner:
    """Plays episodes of one run config against `generator` (a router or one engine client), in
    sandboxes from `provider`; optionally writes every episode's transcript to `transcripts`."""

    def __init__(self, cfg: RunConfig, generator: Generator, provider: Any, *, transcripts: Path | None = None):
        from agentrl.models.tokenizer import load_tokenizer

        self.cfg, self.generator, self.provider = cfg, generator, provider
        self.tokenizer = load_tokenizer(cfg.model.path or cfg.model.name)
        self.sampling = sampling_params(cfg, self.tokenizer)
        self._transcripts = None
        if transcripts is not None:
            transcripts.parent.mkdir(parents=True, exist_ok=True)
            self._transcripts = open(transcripts, "a")

    def make_env(self):
        from agentrl.envs.registry import make_run_env

        return make_run_env(self.cfg, self.provider)

    def tasks(self) -> tuple[list[str], dict[str, list[str]]]:
        """The env's task ids and its suggested splits ({} when it suggests none)."""
        from agentrl.envs.base import SplitEnv

        env = self.make_env()
        return list(env.task_ids()), dict(env.splits()) if isinstance(env, SplitEnv) else {}

    async def run(self, task_id: str, episode_id: str, group_id: str, *, evaluate: bool = False,
                  resume: Any = None, recorder: Any = None, seed: int | None = None) -> tuple[Trajectory, EpisodeSummary]:
        """`resume` (an agentrl.agent.resume.EpisodeSnapshot) continues a recorded episode in a fresh
        sandbox, or plays it again from the start when the sandbox does not reproduce it; `recorder`
        (a ProgressRecorder) records this one as it runs; `seed` goes to the env's reset
        (agentrl/policy/seeding.py)."""
        from agentrl.agent.episode import run_episode
        from agentrl.agent.resume import ResumeDiverged

        t0 = time.time()
        def play(snapshot: Any):
            return run_episode(self.make_env(), self.generator, self.tokenizer, task_id, self.cfg.agent,
                               self.sampling, episode_id, group_id, partial=self.cfg.rollout.partial,
                               recorder=recorder, resume=snapshot, seed=seed)

        try:
            traj = await play(resume)
        except ResumeDiverged as why:
            traj = await play(None)
            traj.info["resume_diverged"] = str(why)
        summary = EpisodeSummary(episode_id, task_id, group_id, traj.outcome, traj.reward, len(traj.token_ids),
                                 traj.num_generated, traj.num_turns, traj.oldest_version, evaluate, time.time() - t0,
                                 error=traj.info.get("error"))
        if self._transcripts is not None:
            self._write_transcript(traj, summary)
        return traj, summary

    def decode_reply(self, traj: Trajectory) -> str:
        return self.tokenizer.decode(traj.token_ids[traj.prompt_len:])

    def _write_transcript(self, traj: Trajectory, summary: EpisodeSummary) -> None:
        from agentrl.view import turn_versions

        self._transcripts.write(json.dumps({
            **summary.to_dict(), "time": time.time(), "timings": traj.timings, "info": traj.info,
            "turn_versions": turn_versions(traj.loss_mask, traj.weight_versions),
            "text": self.decode_reply(traj), "versions": sorted({v for v in traj.weight_versions if v >= 0}),
        }) + "\n")
        self._transcripts.flush()

    def close(self) -> None:
        if self._transcripts is not None:
            self._transcripts.close()
            self._transcripts = None
