"""Partial rollout in the episode harness: an abort at a weight update is continued with the tokens
kept (each with its version), other failures stay infra errors; progress records merge into the
episode's state; a recorded episode continues in a fresh env by replaying its steps, or starts again
when the env does not reproduce them."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.agent import run_episode
from agentrl.agent.partial import MAX_RESUMES_PER_TURN
from agentrl.agent.resume import EpisodeSnapshot, ProgressRecorder, ResumeDiverged
from agentrl.agent.trajectory import SCORED
from agentrl.config.schema import AgentConfig
from agentrl.envs.base import Observation, State
from agentrl.rollout.types import GenerateResult, SamplingParams


@pytest.fixture(scope="module")
def tok():
    from agentrl.models.tokenizer import load_tokenizer

    return load_tokenizer("tiny")


def bash(cmd: str) -> str:
    return f"```bash\n{cmd}\n```"


class UpdatingEngine:
    """Answers each turn's reply from a script; an `abort_after` entry cuts that request after k
    tokens (a weight update), after which the version goes up. Logprob of token i: -(i + 1) / 100."""

    def __init__(self, tok, replies, aborts=(), version=5, fail_on_call=None):
        self.tok, self.replies, self.version = tok, list(replies), version
        self.aborts = list(aborts)  # per call: tokens before an abort, or None
        self.calls: list[tuple[list[int], int, str]] = []
        self.fail_on_call = fail_on_call
        self._sent = 0  # tokens of the current reply already sent

    async def generate(self, input_ids, sampling, *, session_id, rid=None):
        self.calls.append((list(input_ids), sampling.max_new_tokens, rid))
        if self.fail_on_call == len(self.calls):
            raise ConnectionError("engine died")
        reply = self.tok.encode(self.replies[0], add_special_tokens=False) + [self.tok.eos_token_id]
        rest = reply[self._sent:][: sampling.max_new_tokens]
        cut = self.aborts.pop(0) if self.aborts else None
        if cut is not None:
            rest = rest[:cut]
        lps = [-(self._sent + i + 1) / 100 for i in range(len(rest))]
        self._sent += len(rest)
        out = GenerateResult(rest, lps, [self.version] * len(rest), "abort" if cut is not None else "stop")
        if cut is not None:
            self.version += 1
        else:
            self.replies.pop(0)
            self._sent = 0
        return out


class Files:
    """An env of files: `echo TEXT > NAME` writes, `cat NAME` prints; reward 1 when answer holds 42.
    `salt` changes what cat prints (an env that does not reproduce)."""

    def __init__(self, salt=""):
        self.files, self.salt, self.steps, self.closed = {}, salt, [], 0
        self._state = State()

    async def reset(self, task_id, *, episode_id=None, seed=None):
        return Observation(text="Put 42 into answer.")

    async def step(self, action):
        self.steps.append(action.command)
        cmd = action.command.strip()
        if cmd.startswith("echo "):
            text, _, name = cmd[5:].partition(" > ")
            self.files[name] = text
            return Observation(text="")
        if cmd.startswith("cat "):
            return Observation(text=self.files.get(cmd[4:], "missing") + self.salt)
        return Observation(text="unknown")

    async def score(self):
        return Observation(done=True, reward=float(self.files.get("answer") == "42"), status="scored")

    @property
    def state(self):
        return self._state

    async def close(self):
        self.closed += 1

    def task_ids(self):
        return ["files"]


CFG = AgentConfig(max_turns=4)


async def play(env, engine, tok, **kw):
    return await run_episode(env, engine, tok, "files", kw.pop("cfg", CFG), SamplingParams(max_new_tokens=64),
                             "g-0", "g", **kw)


async def test_an_abort_is_continued_with_its_tokens_and_versions(tok):
    replies = [bash("echo 42 > answer"), "TASK_COMPLETE"]
    engine = UpdatingEngine(tok, replies, aborts=[3, 2, None])  # turn 1 cut twice: versions 5, 6, then 7
    traj = await play(Files(), engine, tok, partial=True)
    assert (traj.outcome, traj.reward, traj.num_turns) == (SCORED, 1.0, 2)
    assert traj.info["interruptions"] == 2 and traj.info["carried_tokens"] == 5
    reply = tok.encode(replies[0], add_special_tokens=False) + [tok.eos_token_id]
    start = traj.prompt_len
    assert traj.token_ids[start:start + len(reply)] == reply  # the reply is whole, as if never cut
    assert traj.weight_versions[start:start + len(reply)] == [5] * 3 + [6] * 2 + [7] * (len(reply) - 5)
    assert traj.rollout_logprobs[start:start + len(reply)] == [-(i + 1) / 100 for i in range(len(reply))]
    # Each continuation re-sent the prefix with the tokens so far, for the rest of the turn's budget.
    (ids0, n0, rid0), (ids1, n1, rid1), (ids2, n2, rid2) = engine.calls[:3]
    assert ids1 == ids0 + reply[:3] and ids2 == ids0 + reply[:5]
    assert (n0, n1, n2) == (64, 61, 59) and (rid0, rid1, rid2) == ("g-0:0", "g-0:0.1", "g-0:0.2")


async def test_without_partial_an_abort_is_an_engine_error(tok):
    traj = await play(Files(), UpdatingEngine(tok, [bash("echo 42 > answer")], aborts=[3]), tok)
    assert traj.outcome == "infra_error:engine" and "aborted" in traj.info["error"]


async def test_endless_aborts_and_a_dead_engine_stay_engine_errors(tok):
    engine = UpdatingEngine(tok, [bash("echo 42 > answer")], aborts=[0] * (MAX_RESUMES_PER_TURN + 1))
    traj = await play(Files(), engine, tok, partial=True)
    assert traj.outcome == "infra_error:engine" and f"({MAX_RESUMES_PER_TURN})" in traj.info["error"]
    assert len(engine.calls) == MAX_RESUMES_PER_TURN + 1
    dead = await play(Files(), UpdatingEngine(tok, [bash("echo 42 > answer")], aborts=[3], fail_on_call=2), tok,
                      partial=True)
    assert dead.outcome == "infra_error:engine" and "engine died" in dead.info["error"]


async def test_an_interruption_that_uses_up_the_turn_budget_ends_the_turn_at_length(tok):
    engine = UpdatingEngine(tok, ["word " * 80, "TASK_COMPLETE"], aborts=[64])
    traj = await play(Files(), engine, tok, partial=True)
    assert traj.info["finish_reasons"][0] == "length" and traj.info["interruptions"] == 1
    assert len(engine.calls) == 3  # the cut turn is not asked for more; the next turn completes


def merge(records: list[dict]) -> EpisodeSnapshot:
    """What the buffer's sidecar does with a chain of records."""
    snap = None
    for rec in records:
        d = EpisodeSnapshot.from_record(rec)
        if snap is None or d.start == 0:
            snap = d
        else:
            assert snap.extend(d), "a record did not follow on"
    return snap


def recorder(records, hang_after=None):
    async def sink(rec):
        records.append(rec)
        if len(records) == hang_after:
            await asyncio.sleep(3600)  # the process dies here
    return ProgressRecorder(sink, "g-0", "g", "files", 2)


async def test_records_merge_into_the_stream_at_every_turn_and_interruption(tok):
    records: list[dict] = []
    replies = [bash("echo 41 > answer"), bash("cat answer"), "TASK_COMPLETE"]
    traj = await play(Files(), UpdatingEngine(tok, replies, aborts=[None, 4]), tok, partial=True,
                      recorder=recorder(records))
    # turn 1 ends (record), turn 2 is interrupted (record), turn 2 ends (record), turn 3 completes
    assert [r["open_turn"] for r in records] == [0, 4, 0] and records[0]["start"] == 0
    snap = merge(records)
    n = len(snap.token_ids)
    assert snap.token_ids == traj.token_ids[:n] and snap.versions == traj.weight_versions[:n]
    assert snap.loss_mask == traj.loss_mask[:n] and snap.logprobs == traj.rollout_logprobs[:n]
    assert [s["action"]["command"] for s in snap.steps] == ["echo 41 > answer", "cat answer"]
    assert snap.steps[1]["text"] == "41" and snap.turns == 2 and snap.counters["interruptions"] == 1
    assert snap.records == 3 and snap.prompt_len == traj.prompt_len


async def crash_after(records_wanted: int, tok, replies, aborts=()):
    """Run an episode and cancel it once `records_wanted` records are in (a crash)."""
    records: list[dict] = []
    env = Files()
    task = asyncio.ensure_future(play(env, UpdatingEngine(tok, replies, aborts=list(aborts)), tok, partial=True,
                                      recorder=recorder(records, hang_after=records_wanted)))
    while len(records) < records_wanted:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert env.closed == 1
    return merge(records)


async def test_a_recorded_episode_continues_in_a_fresh_env_by_replaying_its_steps(tok):
    first = [bash("echo 42 > answer"), bash("cat answer")]
    snap = await crash_after(2, tok, first + ["unused"], aborts=[None, 3])  # cut in turn 2, after 3 tokens
    assert snap.open_turn == 3 and [s["action"]["command"] for s in snap.steps] == ["echo 42 > answer"]
    fresh, records = Files(), []
    rec = recorder(records)
    engine = UpdatingEngine(tok, [bash("cat answer"), "TASK_COMPLETE"], version=9)
    engine._sent = 3  # the engine script goes on where the cut reply stopped
    traj = await play(fresh, engine, tok, partial=True, resume=snap, recorder=rec)
    assert (traj.outcome, traj.reward) == (SCORED, 1.0)  # the replayed write counts at scoring
    assert fresh.steps == ["echo 42 > answer", "cat answer"]  # one replayed, one new
    assert traj.token_ids[:len(snap.token_ids)] == snap.token_ids  # the recorded prefix, unchanged
    assert traj.weight_versions[:len(snap.versions)] == snap.versions
    assert engine.calls[0][0] == snap.token_ids and engine.calls[0][1] == 64 - 3  # the rest of the cut turn
    assert traj.info["resumed"]["steps"] == 1 and traj.num_turns == 3
    assert records[0]["start"] == len(snap.token_ids)  # the chain goes on


async def test_a_fresh_env_that_does_not_reproduce_the_steps_is_refused(tok):
    snap = await crash_after(2, tok, [bash("echo 42 > answer"), bash("cat answer"), "TASK_COMPLETE"])
    env = Files(salt=" (other)")
    with pytest.raises(ResumeDiverged, match="step 2 of 2"):
        await play(env, UpdatingEngine(tok, ["TASK_COMPLETE"]), tok, partial=True, resume=snap)
    assert env.closed == 1


async def test_a_resumed_episode_out_of_agent_time_is_scored_as_timed_out(tok):
    snap = await crash_after(1, tok, [bash("echo 42 > answer"), "x"])
    snap.agent_s = CFG.episode_timeout_s
    traj = await play(Files(), UpdatingEngine(tok, ["TASK_COMPLETE"]), tok, resume=snap)
    assert traj.outcome == "agent_timeout" and traj.reward == 1.0
