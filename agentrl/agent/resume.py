"""In-flight episodes that survive a restart (buffer.resume_in_flight): what is recorded, and what
"continue" means once the sandbox is gone.

Recorded (ProgressRecorder -> the replay buffer's sidecar, fsynced before the call returns): at
every turn boundary (the observation appended, before the next generation) and at every
interruption of a generation (partial rollout), the part of the episode's token stream not yet
recorded (ids, loss mask, logprobs, weight versions), the env steps run since the last record
(each action and the observation text it returned), and the episode's counters. The stream is
append-only, so a record is a delta; a record starting at token 0 starts the chain again.

The rule for continuing after a restart (resume_into):
1. A fresh sandbox: `env.reset(task)` as for a new episode. Its first observation must give the
   same prompt tokens as recorded.
2. Replay: every recorded action runs again, in order, and must return exactly the recorded
   observation text (and not end the episode). The sandbox then holds what the agent's commands
   made of a fresh task, as far as the observations can tell.
3. The episode goes on from the recorded tokens: the same transcript, every token with the
   version (and logprob) that produced it; a turn cut by an interruption continues for the rest of
   its token budget; the agent's wall clock goes on from the recorded time (replay is not counted).
Limits, honestly: replay re-executes commands; it reproduces the sandbox only when the commands
are deterministic given the task. Output that differs (timestamps, random names, network, timing
in a terminal's scrollback) is a divergence: the episode is then played again from the start in
another fresh sandbox, counted (`resume_diverged`). Effects the observations do not show (a
background process, a file written by a timed-out command) cannot be compared. Tokens generated
after the last record (at most one turn's) are lost and generated again. Episodes whose tokens
carry versions of steps that the crash rolled back (after the last checkpoint) keep those
versions: the staleness bound and TIS treat them as the replay log's own trajectories are treated.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from agentrl.envs.base import Action

COUNTERS = ("parse_errors", "actions", "interruptions", "carried_tokens")  # info counters carried over


class ResumeDiverged(Exception):
    """The fresh sandbox did not reproduce the recorded episode; it is played again from the start."""


@dataclass
class EpisodeSnapshot:
    """An in-flight episode as far as it was recorded (one record, or a chain merged)."""

    episode_id: str
    group_id: str
    task_id: str
    group_size: int
    start: int = 0  # position of token_ids[0] in the episode's stream (0 for a whole snapshot)
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)  # {"action": {...}, "text": "..."}
    prompt_len: int = 0
    turns: int = 0
    generated: int = 0  # tokens of finished turns
    open_turn: int = 0  # the stream's last `open_turn` tokens: the reply of a turn in progress
    open_turn_budget: int = 0  # that turn's max_new_tokens
    agent_s: float = 0.0  # the agent's wall clock used so far
    counters: dict[str, int] = field(default_factory=dict)
    finish_reasons: list[str] = field(default_factory=list)
    records: int = 1

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> EpisodeSnapshot:
        known = {k: rec[k] for k in cls.__dataclass_fields__ if k in rec}
        snap = cls(**known)
        n = len(snap.token_ids)
        if not (len(snap.loss_mask) == len(snap.logprobs) == len(snap.versions) == n):
            raise ValueError(f"progress record of {snap.episode_id}: token lists of different lengths")
        return snap

    def extend(self, delta: EpisodeSnapshot) -> bool:
        """Append the next record of the chain; False (nothing changed) when it does not follow on."""
        if delta.start != self.start + len(self.token_ids):
            return False
        self.token_ids += delta.token_ids
        self.loss_mask += delta.loss_mask
        self.logprobs += delta.logprobs
        self.versions += delta.versions
        self.steps += delta.steps
        self.finish_reasons += delta.finish_reasons
        for name in ("prompt_len", "turns", "generated", "open_turn", "open_turn_budget", "agent_s", "counters"):
            setattr(self, name, getattr(delta, name))
        self.records += 1
        return True


Sink = Callable[[dict[str, Any]], Awaitable[Any]]


class ProgressRecorder:
    """Sends an episode's deltas to `sink` (the buffer's record_partial). Recording never fails an
    episode: a sink error is counted and the next record starts the chain again from token 0."""

    def __init__(self, sink: Sink, episode_id: str, group_id: str, task_id: str, group_size: int):
        self.sink, self.ids = sink, (episode_id, group_id, task_id, group_size)
        self.sent_tokens = self.sent_steps = self.sent_reasons = 0
        self.errors = 0

    def follow(self, snapshot: EpisodeSnapshot) -> None:
        """A resumed episode continues the chain of `snapshot`."""
        self.sent_tokens, self.sent_steps = len(snapshot.token_ids), len(snapshot.steps)
        self.sent_reasons = len(snapshot.finish_reasons)

    async def record(self, ep: Any) -> None:
        """Record `ep` (an agentrl.agent.episode._Episode) from where the last record ended."""
        stream = ep.stream()
        a = self.sent_tokens
        delta = EpisodeSnapshot(
            *self.ids, start=a, token_ids=stream[0][a:], loss_mask=stream[1][a:], logprobs=stream[2][a:],
            versions=stream[3][a:], steps=ep.steps[self.sent_steps:], prompt_len=ep.prompt_len, turns=ep.turns,
            generated=ep.generated, open_turn=ep.open_turn_len(), open_turn_budget=ep.open_turn_budget(),
            agent_s=ep.agent_seconds(), counters={k: int(ep.info.get(k, 0)) for k in COUNTERS},
            finish_reasons=ep.info["finish_reasons"][self.sent_reasons:])
        try:
            await self.sink(delta.to_record())
        except Exception:  # noqa: BLE001 - a lost record costs only resumability, never the episode
            self.errors += 1
            self.sent_tokens = self.sent_steps = self.sent_reasons = 0  # the next record is whole
            return
        self.sent_tokens, self.sent_steps = len(stream[0]), len(ep.steps)
        self.sent_reasons = len(ep.info["finish_reasons"])


async def resume_into(ep: Any, snapshot: EpisodeSnapshot, prompt: list[int]) -> None:
    """Bring `ep` (just reset in a fresh sandbox, `prompt` its first prompt ids) to the recorded
    state by the module's rule; raises ResumeDiverged when the sandbox does not reproduce it."""
    if snapshot.start != 0 or snapshot.token_ids[: snapshot.prompt_len] != prompt:
        raise ResumeDiverged("the fresh sandbox's first prompt differs from the recorded one")
    started = time.perf_counter()
    for i, step in enumerate(snapshot.steps):
        obs = await ep.env_call("replay step", ep.env.step(Action.model_validate(step["action"])))
        if obs.done or obs.text != step["text"]:
            raise ResumeDiverged(f"replayed step {i + 1} of {len(snapshot.steps)} returned other output"
                                 + (" and ended the episode" if obs.done else ""))
    ep.restore(snapshot)
    ep.info["resumed"] = {"tokens": len(snapshot.token_ids), "steps": len(snapshot.steps),
                          "agent_s": snapshot.agent_s, "replay_s": time.perf_counter() - started}
