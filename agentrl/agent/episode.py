"""One multi-turn episode, token-in-token-out: env + generator + tokenizer -> Trajectory.

Flow: `env.reset` -> first prompt (chat template, once) -> loop { generate (ids in, ids +
logprobs + versions out) -> parse the action -> `env.step` -> observation delta (loss mask 0) }
-> `env.score()` -> `env.close()` (always, in `finally`).

How an episode ends (the Trajectory's outcome):
- `scored`: the model finished (TASK_COMPLETE / confirmed task_complete), the env said done, or
  the turns ran out; the env's verdict is the reward.
- `truncated`: the conversation reached agent.max_context_tokens, or the model used up the
  episode's generation budget (agent.max_generated_tokens, over all turns); `agent_timeout`: the
  wall clock (agent.episode_timeout_s, counted from after reset) ran out, or the env ended the
  episode with metadata `agent_timeout: true` (its own task time limit). Both are still scored,
  since the env's state may already solve the task, and both stay trainable; with
  agent.truncated_reward = "zero" a truncated episode gets 0 without running the tests.
Token limits: each turn generates at most rollout.max_new_tokens (the sampling parameter), lowered
to what the context and the episode budget have left. A reply cut by the per-turn limit is
parsed as it is (a complete command block still runs); one cut by the context or the budget ends
the episode as truncated.
- `infra_error:<kind>`: the env, sandbox, engine or verifier failed (a SandboxError keeps its
  kind; other env failures are `env`, engine failures and aborts `engine`, scoring failures
  `verifier`). The reward is then None, never 0. A first prompt that fills agent.max_context_tokens
  by itself is `infra_error:task` (the task cannot be played at that limit; not retried).
Partial rollout (`partial`, agentrl/agent/partial.py): an aborted generation is a weight update's
interruption, not a failure: the turn keeps its tokens and goes on for the rest of its budget
(counted in info: interruptions, carried_tokens). A `recorder` (agentrl/agent/resume.py) records
the episode at every turn boundary and interruption; `resume` continues a recorded episode in a
fresh sandbox (ResumeDiverged, raised after the env is closed, when the sandbox does not reproduce it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Any

from agentrl.agent.actions import ParsedTurn, make_action_format, strip_reasoning
from agentrl.agent.chat import ChatTokens
from agentrl.agent.partial import MAX_RESUMES_PER_TURN, OpenTurn
from agentrl.agent.resume import EpisodeSnapshot, ProgressRecorder, resume_into
from agentrl.agent.trajectory import (
    AGENT_TIMEOUT,
    INFRA_ERROR_PREFIX,
    SCORED,
    TRUNCATED,
    Trajectory,
    infra_error,
)
from agentrl.config.schema import AgentConfig
from agentrl.envs.base import Env, Observation
from agentrl.rollout.types import GenerateResult, Generator, SamplingParams
from agentrl.sandbox.base import SandboxError

_MAX_ERROR_CHARS = 500


class _InfraFailure(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def cap_observation(text: str, max_chars: int) -> str:
    """Keep the first and last max_chars/2 characters of a long observation (errors tend to be
    at the end, the command's context at the start), saying how much was left out."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    return f"{text[:head]}\n[... {len(text) - max_chars} characters omitted ...]\n{text[len(text) - tail :]}"


class _Episode:
    """The state of one episode while it runs (kept off run_episode's signature)."""

    def __init__(
        self,
        env: Env,
        generator: Generator,
        tokenizer: Any,
        cfg: AgentConfig,
        sampling: SamplingParams,
        episode_id: str,
        partial: bool = False,
        recorder: ProgressRecorder | None = None,
    ):
        self.env, self.generator, self.tokenizer = env, generator, tokenizer
        self.cfg, self.sampling, self.episode_id = cfg, sampling, episode_id
        self.partial, self.recorder = partial, recorder
        self.format = make_action_format(cfg.action_format, cfg.command_timeout_s)
        self.chat = ChatTokens(tokenizer, self.format.system_prompt)
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turns = 0
        self.generated = 0  # tokens the model produced so far, all finished turns
        self.prompt_len = 0
        self.open: OpenTurn | None = None  # the turn being generated
        self.steps: list[dict[str, Any]] = []  # every env step: the action and its observation text
        self.agent_started: float | None = None  # perf_counter when the agent's clock (re)started
        self.agent_s_before = 0.0  # agent seconds of a recorded run this one continues
        self.timings = {"generate_s": 0.0, "env_s": 0.0, "score_s": 0.0}
        self.info: dict[str, Any] = {"parse_errors": 0, "actions": 0, "finish_reasons": [], "stop": None,
                                     "interruptions": 0, "carried_tokens": 0}

    # -- token bookkeeping -------------------------------------------------------------------

    def append_context(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def append_generated(self, result: GenerateResult) -> None:
        self.token_ids += result.output_ids
        self.generated += len(result.output_ids)
        self.loss_mask += [1] * len(result.output_ids)
        self.logprobs += [float(x) for x in result.logprobs]
        self.versions += [int(v) for v in result.weight_versions]

    def stream(self) -> tuple[list[int], list[int], list[float], list[int]]:
        """The token stream so far, the open turn's tokens included (what a record holds)."""
        t = self.open or OpenTurn(0)
        return (self.token_ids + t.ids, self.loss_mask + [1] * len(t.ids), self.logprobs + t.logprobs,
                self.versions + t.versions)

    def open_turn_len(self) -> int:
        return len(self.open.ids) if self.open else 0

    def open_turn_budget(self) -> int:
        return self.open.budget if self.open else 0

    def agent_seconds(self) -> float:
        running = time.perf_counter() - self.agent_started if self.agent_started is not None else 0.0
        return self.agent_s_before + running

    def restore(self, snap: EpisodeSnapshot) -> None:
        """Take over a recorded episode's state (agentrl/agent/resume.py)."""
        k = len(snap.token_ids) - snap.open_turn
        self.token_ids, self.loss_mask = snap.token_ids[:k], snap.loss_mask[:k]
        self.logprobs, self.versions = snap.logprobs[:k], snap.versions[:k]
        if snap.open_turn:
            self.open = OpenTurn(snap.open_turn_budget, snap.token_ids[k:], snap.logprobs[k:], snap.versions[k:])
        self.steps = list(snap.steps)
        self.prompt_len, self.turns, self.generated = snap.prompt_len, snap.turns, snap.generated
        self.agent_s_before = snap.agent_s
        self.info.update(snap.counters)
        self.info["finish_reasons"] = list(snap.finish_reasons)
        if self.recorder is not None:
            self.recorder.follow(snap)

    async def record(self) -> None:
        if self.recorder is not None:
            await self.recorder.record(self)

    # -- calls that can fail for infrastructure reasons ------------------------------------

    async def env_call(self, what: str, pending, timing: str = "env_s", kind: str = "env") -> Observation:
        start = time.perf_counter()
        try:
            obs = await pending
        except SandboxError as err:
            raise _InfraFailure(err.kind, f"{what}: {err}") from err
        except Exception as err:  # any env failure is infrastructure, never the model's fault
            raise _InfraFailure(kind, f"{what}: {type(err).__name__}: {err}") from err
        finally:
            self.timings[timing] += time.perf_counter() - start
        if obs.status is not None and obs.status.startswith(INFRA_ERROR_PREFIX):
            raise _InfraFailure(obs.status[len(INFRA_ERROR_PREFIX) :], f"{what}: {obs.text}")
        return obs

    async def generate(self, turn: OpenTurn) -> GenerateResult:
        """The next piece of `turn`: the rest of its budget, after the conversation and its tokens so far."""
        sampling = dataclasses.replace(self.sampling, max_new_tokens=turn.left)
        rid = f"{self.episode_id}:{self.turns}" + (f".{turn.resumes}" if turn.resumes else "")  # one rid per request
        start = time.perf_counter()
        try:
            result = await self.generator.generate(
                self.token_ids + turn.ids,
                sampling,
                session_id=self.episode_id,
                rid=rid,
            )
        except Exception as err:
            raise _InfraFailure("engine", f"generate: {type(err).__name__}: {err}") from err
        finally:
            self.timings["generate_s"] += time.perf_counter() - start
        n = len(result.output_ids)
        if result.finish_reason == "abort" and not self.partial:
            raise _InfraFailure("engine", "generate: the engine aborted the request")
        if len(result.logprobs) != n or len(result.weight_versions) != n:
            raise _InfraFailure(
                "engine",
                f"generate: {n} output ids but {len(result.logprobs)} logprobs and "
                f"{len(result.weight_versions)} weight versions",
            )
        return result

    async def generate_turn(self, turn: OpenTurn) -> GenerateResult:
        """The turn's reply; with partial rollout an abort (a weight update) keeps the tokens,
        is recorded, and the turn goes on for the rest of its budget."""
        while True:
            if turn.left <= 0:
                return turn.result("length")
            piece = await self.generate(turn)
            turn.add(piece)
            if piece.finish_reason != "abort":
                return turn.result(piece.finish_reason)
            turn.resumes += 1
            if turn.resumes > MAX_RESUMES_PER_TURN:
                raise _InfraFailure("engine", f"generate: aborted {turn.resumes} times in one turn; more than "
                                    f"weight updates account for ({MAX_RESUMES_PER_TURN})")
            self.info["interruptions"] += 1
            self.info["carried_tokens"] += len(piece.output_ids)
            await self.record()

    # -- the loop ------------------------------------------------------------------------------

    async def interact(self) -> str:
        """Turns until the model or env finishes, or a limit; returns why it stopped."""
        cfg, per_turn = self.cfg, self.sampling.max_new_tokens
        while self.turns < cfg.max_turns:
            room = cfg.max_context_tokens - len(self.token_ids)
            if room <= 0:
                return "context"
            budget = self.budget_left()
            if budget <= 0:
                return "token_budget"
            if self.open is None:
                self.open = OpenTurn(min(per_turn, room, budget))
            max_new = self.open.budget  # a resumed turn keeps the budget it started with
            result = await self.generate_turn(self.open)
            self.open = None
            self.append_generated(result)
            self.turns += 1
            self.info["finish_reasons"].append(result.finish_reason)
            if result.finish_reason == "length" and max_new < per_turn:
                # cut by an episode limit, not by the per-turn limit
                return "context" if room <= budget else "token_budget"
            parsed = self.format.parse(self.reply_text(result.output_ids))
            observation, finished = await self.act(parsed)
            if finished:
                return finished
            if self.turns >= cfg.max_turns:
                break
            if self.budget_left() <= 0:
                return "token_budget"  # no tokens left for another turn
            delta = self.chat.observation_ids(result.output_ids, observation)
            if len(self.token_ids) + len(delta) >= cfg.max_context_tokens:
                return "context"  # no room left for another turn after this observation
            self.append_context(delta)
            await self.record()
        return "max_turns"

    def budget_left(self) -> int:
        """Tokens the model may still generate in this episode (agent.max_generated_tokens)."""
        if self.cfg.max_generated_tokens is None:
            return self.sampling.max_new_tokens
        return self.cfg.max_generated_tokens - self.generated

    def reply_text(self, output_ids: list[int]) -> str:
        """The model's reply as text for parsing. Decoded with special tokens kept, so that
        reasoning is cut at <think> / </think> even where those are special tokens; the other
        special tokens (end of turn, role tokens) are removed afterwards."""
        text = strip_reasoning(self.tokenizer.decode(output_ids, skip_special_tokens=False))
        for special in self.tokenizer.all_special_tokens:
            text = text.replace(special, "")
        return text

    async def act(self, parsed: ParsedTurn) -> tuple[str, str | None]:
        """Runs a parsed turn; returns (observation text for the model, stop reason or None)."""
        if parsed.error is not None:
            self.info["parse_errors"] += 1
            return parsed.error, None
        outputs = []
        for action in parsed.actions:
            obs = await self.env_call("step", self.env.step(action))
            self.info["actions"] += 1
            self.steps.append({"action": action.model_dump(mode="json"), "text": obs.text})
            outputs.append(obs.text)
            if obs.done:
                # An env that enforces its own time limit (TB2's task timeout) says so in metadata.
                return "", "timeout" if obs.metadata.get("agent_timeout") else "env_done"
        if parsed.complete:
            return "", "task_complete"
        joined = "\n".join(o for o in outputs if o)
        observation = cap_observation(joined, self.cfg.observation_max_chars) or (
            "(no output)" if parsed.actions else "(no commands sent)"
        )
        if parsed.notice:
            observation = f"{observation}\n\n{parsed.notice}"
        return observation, None

    async def score(self) -> float:
        verdict = await self.env_call("score", self.env.score(), timing="score_s", kind="verifier")
        reward = verdict.reward
        if verdict.status not in (None, SCORED) or reward is None or not math.isfinite(reward):
            raise _InfraFailure(
                "verifier", f"score: no valid reward (status {verdict.status!r}, reward {reward!r})"
            )
        return float(reward)


async def run_episode(
    env: Env,
    generator: Generator,
    tokenizer: Any,
    task_id: str,
    cfg: AgentConfig,
    sampling: SamplingParams,
    episode_id: str,
    group_id: str,
    *,
    partial: bool = False,
    recorder: ProgressRecorder | None = None,
    resume: EpisodeSnapshot | None = None,
    seed: int | None = None,
) -> Trajectory:
    """Play one episode of `task_id` and return its Trajectory; closes `env` whatever happens.

    `tokenizer` is a transformers tokenizer with a chat template. `sampling.max_new_tokens` is
    the per-turn limit (lowered near the context limit). Infrastructure failures become the
    outcome `infra_error:<kind>`; programming errors (e.g. a tokenizer without a chat template),
    ResumeDiverged and cancellation propagate, after the env is closed. `seed` is the env's reset
    seed (the run loop's per-episode seed, agentrl/policy/seeding.py; None: the env's own choice).
    """
    ep = _Episode(env, generator, tokenizer, cfg, sampling, episode_id, partial, recorder)
    started = time.perf_counter()
    outcome, reward = SCORED, None
    try:
        try:
            first = await ep.env_call("reset", env.reset(task_id, episode_id=episode_id, seed=seed))
            prompt = ep.chat.prompt_ids(first.text)
            ep.prompt_len = len(prompt)
            if not first.done and len(prompt) >= cfg.max_context_tokens:
                # Not a truncation: the model would train on a prompt it never answered. The task
                # cannot be played at this limit (a data error, not retried, its reason noted once).
                raise _InfraFailure("task", f"the first prompt is {len(prompt)} tokens, which leaves no room "
                                    f"under agent.max_context_tokens={cfg.max_context_tokens}: raise "
                                    "agent.max_context_tokens or shorten the task's instruction")
            ep.append_context(prompt)
            if resume is not None and not first.done:
                await resume_into(ep, resume, prompt)
            if first.done:
                stop = "env_done"
            elif ep.agent_s_before >= cfg.episode_timeout_s:
                stop = "timeout"  # the recorded run had used up the agent's time
            else:
                # The wall clock starts after reset: sandbox start-up is not the agent's time.
                ep.agent_started = time.perf_counter()
                deadline = asyncio.get_running_loop().time() + cfg.episode_timeout_s - ep.agent_s_before
                timeout = asyncio.timeout_at(deadline)
                try:
                    async with timeout:
                        stop = await ep.interact()
                except TimeoutError:
                    if not timeout.expired():
                        raise
                    stop = "timeout"
            ep.info["stop"] = stop
            outcome = {"context": TRUNCATED, "token_budget": TRUNCATED, "timeout": AGENT_TIMEOUT}.get(stop, SCORED)
            if outcome == TRUNCATED and cfg.truncated_reward == "zero":
                reward = 0.0  # by config: a truncated episode earns nothing, its tests are not run
                ep.info["tests_skipped"] = True
            else:
                reward = await ep.score()
        except _InfraFailure as failure:
            outcome, reward = infra_error(failure.kind), None
            ep.info["error"] = str(failure)[:_MAX_ERROR_CHARS]
    finally:
        close_start = time.perf_counter()
        try:
            await env.close()
        except Exception as err:  # noqa: BLE001 - a failed close must not hide the episode's result; record it
            ep.info["close_error"] = f"{type(err).__name__}: {err}"[:_MAX_ERROR_CHARS]
        ep.timings["close_s"] = time.perf_counter() - close_start
    ep.timings["total_s"] = time.perf_counter() - started
    return Trajectory(
        episode_id=episode_id,
        task_id=task_id,
        group_id=group_id,
        prompt_len=ep.prompt_len,
        token_ids=ep.token_ids,
        loss_mask=ep.loss_mask,
        rollout_logprobs=ep.logprobs,
        weight_versions=ep.versions,
        outcome=outcome,
        reward=reward,
        num_turns=ep.turns,
        timings=ep.timings,
        info=ep.info,
    )
