"""The agent loop, with a scripted Generator, against the countdown env and an in-memory terminal."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from agentrl_countdown import CountdownEnv

from agentrl.agent import cap_observation, run_episode
from agentrl.agent.actions import COMPLETION_CONFIRMATION, make_action_format
from agentrl.agent.trajectory import AGENT_TIMEOUT, SCORED, TRUNCATED
from agentrl.config.schema import AgentConfig
from agentrl.envs.base import Action, Observation, State
from agentrl.rollout.types import GenerateResult, SamplingParams
from agentrl.sandbox.base import SandboxError


@pytest.fixture(scope="module")
def tok():
    from agentrl.models.tokenizer import load_tokenizer

    return load_tokenizer("tiny")


class ScriptedGenerator:
    """Answers each call with the next pre-written reply, tokenised, plus eos. Logprobs and
    versions differ per token so misalignment would show. A reply may be an exception to raise,
    or (text, finish_reason)."""

    def __init__(self, tok, replies, first_version=3, delay_s=0.0):
        self.tok, self.replies, self.delay_s = tok, list(replies), delay_s
        self.version = first_version
        self.calls: list[tuple[list[int], SamplingParams, str, str | None]] = []
        self.outputs: list[list[int]] = []

    async def generate(self, input_ids, sampling, *, session_id, rid=None):
        self.calls.append((list(input_ids), sampling, session_id, rid))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        text, finish = reply if isinstance(reply, tuple) else (reply, "stop")
        ids = self.tok.encode(text, add_special_tokens=False)
        if finish == "stop":
            ids.append(self.tok.eos_token_id)
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        n = len(ids)
        # The version steps up mid-reply: a request may straddle a weight update.
        versions = [self.version + (i * 2 >= n) for i in range(n)]
        self.version += 1
        self.outputs.append(ids)
        return GenerateResult(ids, [-0.01 * (i + 1) - len(self.calls) for i in range(n)], versions, finish)


class FakeTerminalEnv:
    """An in-memory 'terminal': `write NAME TEXT` stores a file, `cat NAME` prints it, `spam N`
    prints N characters; score: reward 1.0 if file answer holds 42. Failures are injectable."""

    def __init__(self, fail_at=None, score_obs=None, step_delay_s=0.0, done_after=None, done_metadata=None):
        self.files: dict[str, str] = {}
        self.actions: list[Action] = []
        self.closed = 0
        self.fail_at, self.score_obs, self.step_delay_s = fail_at, score_obs, step_delay_s
        self.done_after, self.done_metadata = done_after, done_metadata or {}
        self._state = State()

    def _maybe_fail(self, where):
        if self.fail_at == where:
            raise SandboxError("exec", f"sandbox lost during {where}")
        if self.fail_at == f"{where}-bug":
            raise RuntimeError(f"env crashed in {where}")

    async def reset(self, task_id, *, episode_id=None, seed=None):
        self._maybe_fail("reset")
        self._state = State(episode_id=episode_id, task_id=task_id)
        return Observation(text="Write 42 into the file answer.")

    async def step(self, action):
        self._maybe_fail("step")
        await asyncio.sleep(self.step_delay_s)
        self.actions.append(action)
        self._state.step_count += 1
        cmd = (action.command or action.keystrokes or "").strip()
        verb, _, rest = cmd.partition(" ")
        if verb == "write":
            name, _, text = rest.partition(" ")
            self.files[name] = text
            out = ""
        elif verb == "cat":
            out = self.files.get(rest, f"cat: {rest}: No such file")
        elif verb == "spam":
            out = "".join(chr(ord("a") + i % 26) for i in range(int(rest)))
        else:
            out = f"{verb}: command not found"
        done = self.done_after is not None and self._state.step_count >= self.done_after
        return Observation(text=out, done=done, metadata=self.done_metadata if done else {})

    async def score(self):
        self._maybe_fail("score")
        if self.score_obs is not None:
            return self.score_obs
        return Observation(
            done=True, reward=1.0 if self.files.get("answer") == "42" else 0.0, status="scored"
        )

    @property
    def state(self):
        return self._state

    async def close(self):
        self.closed += 1

    def task_ids(self):
        return ["write-42"]


def bash(cmd: str) -> str:
    return f"I will run it.\n```bash\n{cmd}\n```"


def terminus(*keystrokes, complete=False, duration=0.1) -> str:
    cmds = [{"keystrokes": k, "duration": duration} for k in keystrokes]
    return json.dumps({"analysis": "a", "plan": "p", "commands": cmds, "task_complete": complete})


async def play(env, gen, tok, cfg=None, sampling=None, task_id=None):
    cfg = cfg or AgentConfig()
    sampling = sampling or SamplingParams(max_new_tokens=200)
    task_id = task_id or env.task_ids()[0]
    return await run_episode(env, gen, tok, task_id, cfg, sampling, episode_id="ep-7", group_id="g-1")


def expected_delta(tok, observation: str, output_ids: list[int]) -> list[int]:
    """What the tiny template renders between a finished assistant turn and the next one."""
    ids = tok.encode(f"<|user|>\n{observation}\n<|assistant|>\n", add_special_tokens=False)
    return ids if output_ids[-1] == tok.eos_token_id else [tok.eos_token_id, *ids]


# -- token-in-token-out -----------------------------------------------------------------------


async def test_countdown_episode_tokens_are_prompt_outputs_and_observation_deltas(tok):
    env = CountdownEnv(num_tasks=3)
    task = env.task_ids()[1]
    numbers, target = env.puzzle(task)
    wrong = next(str(n) for n in numbers if n != target)
    gen = ScriptedGenerator(tok, [bash(wrong), "no block at all", bash(env.solution(task))])
    traj = await play(env, gen, tok, task_id=task)

    assert (traj.outcome, traj.reward, traj.num_turns) == (SCORED, 1.0, 3)
    assert traj.info["parse_errors"] == 1 and traj.info["actions"] == 2 and traj.info["stop"] == "env_done"
    # The first prompt: rendered once with the chat template (system prompt + first observation).
    first_obs = (await CountdownEnv(num_tasks=3).reset(task)).text
    system = make_action_format("bash_block").system_prompt
    prompt = tok.encode(
        tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": first_obs}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )
    assert traj.prompt_len == len(prompt) and traj.token_ids[: len(prompt)] == prompt
    # Then exactly: output, delta, output, delta, output.
    out1, out2, out3 = gen.outputs
    fb1 = f"{wrong} = {wrong}; the target is {target}. Attempts left: 2."
    fb2 = make_action_format("bash_block").parse("no block at all").error
    d1, d2 = expected_delta(tok, fb1, out1), expected_delta(tok, fb2, out2)
    assert traj.token_ids == prompt + out1 + d1 + out2 + d2 + out3
    assert traj.loss_mask == [0] * len(prompt) + [1] * len(out1) + [0] * len(d1) + [1] * len(out2) + [
        0
    ] * len(d2) + [1] * len(out3)
    # Each call saw exactly the trajectory so far: nothing was re-tokenised.
    for (input_ids, *_), upto in zip(
        gen.calls, [len(prompt), len(prompt + out1 + d1), len(prompt + out1 + d1 + out2 + d2)]
    ):
        assert input_ids == traj.token_ids[:upto]
    assert all(sid == "ep-7" for _, _, sid, _ in gen.calls) and [c[3] for c in gen.calls] == [
        "ep-7:0",
        "ep-7:1",
        "ep-7:2",
    ]
    # Logprobs and versions per token, where generated; 0.0 / -1 elsewhere.
    gen_pos = [i for i, m in enumerate(traj.loss_mask) if m]
    assert [traj.weight_versions[i] for i in gen_pos] == [3] * ((len(out1) + 1) // 2) + [4] * (
        len(out1) // 2
    ) + [4] * ((len(out2) + 1) // 2) + [5] * (len(out2) // 2) + [5] * ((len(out3) + 1) // 2) + [6] * (
        len(out3) // 2
    )
    assert all(
        traj.weight_versions[i] == -1 and traj.rollout_logprobs[i] == 0.0
        for i, m in enumerate(traj.loss_mask)
        if not m
    )
    assert traj.rollout_logprobs[gen_pos[0]] == pytest.approx(-1.01) and traj.oldest_version == 3
    assert set(traj.timings) >= {"generate_s", "env_s", "score_s", "total_s"} and all(
        v >= 0 for v in traj.timings.values()
    )


async def test_terminus_json_episode_with_confirmed_completion(tok):
    env = FakeTerminalEnv()
    gen = ScriptedGenerator(
        tok,
        [
            terminus("write answer 41\n", "cat answer\n", duration=600),  # duration clamped
            "{not: json}",  # parse error, fed back
            terminus("write answer 42\n", complete=True),  # asks for confirmation
            terminus(complete=True),  # confirmed
        ],
    )
    traj = await play(env, gen, tok, cfg=AgentConfig(action_format="terminus_json"))
    assert (traj.outcome, traj.reward, traj.num_turns) == (SCORED, 1.0, 4)
    assert traj.info["parse_errors"] == 1 and traj.info["stop"] == "task_complete"
    assert [a.keystrokes for a in env.actions] == ["write answer 41\n", "cat answer\n", "write answer 42\n"]
    assert [a.duration_s for a in env.actions] == [60.0, 60.0, 0.1]
    text = tok.decode(traj.token_ids)
    assert "<|user|>\n41\n<|assistant|>" in text  # output of the two commands, joined
    assert "Your reply could not be used: invalid JSON" in text
    assert COMPLETION_CONFIRMATION in text and env.closed == 1


async def test_unconfirmed_completion_keeps_going(tok):
    fmt = make_action_format("terminus_json")
    assert fmt.parse(terminus(complete=True)).notice == COMPLETION_CONFIRMATION
    assert not fmt.parse(terminus("ls\n")).complete  # a false in between resets the chain
    assert not fmt.parse(terminus(complete=True)).complete
    assert fmt.parse(terminus(complete=True)).complete


# -- limits -----------------------------------------------------------------------------------


async def test_max_turns_ends_and_scores(tok):
    env = FakeTerminalEnv()
    gen = ScriptedGenerator(tok, [bash("write answer 42"), bash("cat answer"), bash("cat answer")])
    traj = await play(env, gen, tok, cfg=AgentConfig(max_turns=2))
    assert (traj.outcome, traj.reward, traj.num_turns, traj.info["stop"]) == (SCORED, 1.0, 2, "max_turns")
    assert len(gen.calls) == 2 and traj.token_ids[-1] == tok.eos_token_id  # ends on the model's turn


async def test_context_limit_truncates(tok):
    env = FakeTerminalEnv()
    gen = ScriptedGenerator(tok, [bash("write answer 42"), bash("spam 3000"), bash("cat answer")] * 3)
    cfg = AgentConfig(max_context_tokens=400, observation_max_chars=100_000)
    traj = await play(env, gen, tok, cfg=cfg)
    assert traj.outcome == TRUNCATED and traj.info["stop"] == "context"
    assert traj.reward == 1.0 and traj.trainable  # truncated episodes are still scored
    assert len(traj.token_ids) <= 400
    assert all(sp.max_new_tokens <= 400 - len(ids) for ids, sp, *_ in gen.calls)


async def test_a_prompt_that_fills_the_context_is_a_task_error_not_a_trained_truncation(tok):
    env = FakeTerminalEnv()
    gen = ScriptedGenerator(tok, [bash("write answer 42")])
    prompt_len = (await play(FakeTerminalEnv(), ScriptedGenerator(tok, ["TASK_COMPLETE"]), tok)).prompt_len
    traj = await play(env, gen, tok, cfg=AgentConfig(max_context_tokens=prompt_len))
    assert traj.outcome == "infra_error:task" and traj.reward is None and not traj.trainable
    assert not gen.calls and env.closed == 1  # nothing generated, the env still closed
    assert f"{prompt_len} tokens" in traj.info["error"] and "agent.max_context_tokens" in traj.info["error"]
    ok = await play(FakeTerminalEnv(), ScriptedGenerator(tok, ["TASK_COMPLETE"]), tok,
                    cfg=AgentConfig(max_context_tokens=prompt_len + 1))
    assert ok.outcome != "infra_error:task"  # one token of room is enough to play


async def test_per_turn_token_limit_cuts_the_reply_and_feeds_back(tok):
    env = FakeTerminalEnv()
    gen = ScriptedGenerator(
        tok, [bash("write answer 42 " + "x" * 400), bash("write answer 42"), "TASK_COMPLETE"]
    )
    traj = await play(env, gen, tok, sampling=SamplingParams(max_new_tokens=30))
    assert traj.info["finish_reasons"] == ["length", "stop", "stop"]
    assert traj.info["parse_errors"] == 1 and "No complete ```bash block" in tok.decode(traj.token_ids)
    assert (traj.outcome, traj.reward) == (SCORED, 1.0)
    assert all(sp.max_new_tokens == 30 for _, sp, *_ in gen.calls)


def reply_len(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False)) + 1  # + eos, as ScriptedGenerator sends


class CountingScoreEnv(FakeTerminalEnv):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.score_calls = 0

    async def score(self):
        self.score_calls += 1
        return await super().score()


async def test_episode_token_budget_cuts_the_reply_and_truncates(tok):
    first = bash("write answer 42")
    budget = reply_len(tok, first) + 10
    env = CountingScoreEnv()
    gen = ScriptedGenerator(tok, [first, bash("cat answer " + "x" * 300), "TASK_COMPLETE"])
    traj = await play(env, gen, tok, cfg=AgentConfig(max_generated_tokens=budget))
    assert (traj.outcome, traj.info["stop"], traj.num_turns) == (TRUNCATED, "token_budget", 2)
    assert [sp.max_new_tokens for _, sp, *_ in gen.calls] == [budget, 10]  # the budget lowers the turn limit
    assert traj.num_generated == budget and traj.trainable
    assert (traj.reward, env.score_calls) == (1.0, 1)  # by default a truncated episode runs its tests


async def test_truncated_reward_zero_scores_nothing_without_running_the_tests(tok):
    first = bash("write answer 42")
    env = CountingScoreEnv()
    gen = ScriptedGenerator(tok, [first, bash("cat answer " + "x" * 300)])
    cfg = AgentConfig(max_generated_tokens=reply_len(tok, first) + 10, truncated_reward="zero")
    traj = await play(env, gen, tok, cfg=cfg)
    assert (traj.outcome, traj.reward, env.score_calls) == (TRUNCATED, 0.0, 0)
    assert traj.info["tests_skipped"] and env.closed == 1
    # Context truncation follows the same rule.
    env = CountingScoreEnv()
    gen = ScriptedGenerator(tok, [bash("write answer 42"), bash("spam 3000"), bash("cat answer")] * 3)
    cfg = AgentConfig(max_context_tokens=400, observation_max_chars=100_000, truncated_reward="zero")
    traj = await play(env, gen, tok, cfg=cfg)
    assert (traj.outcome, traj.info["stop"], traj.reward, env.score_calls) == (TRUNCATED, "context", 0.0, 0)


async def test_a_budget_used_up_by_a_whole_turn_ends_on_the_models_turn(tok):
    first = bash("write answer 42")
    gen = ScriptedGenerator(tok, [first, "TASK_COMPLETE"])
    traj = await play(FakeTerminalEnv(), gen, tok, cfg=AgentConfig(max_generated_tokens=reply_len(tok, first)))
    assert (traj.outcome, traj.info["stop"], traj.reward) == (TRUNCATED, "token_budget", 1.0)
    assert len(gen.calls) == 1 and traj.token_ids[-1] == tok.eos_token_id  # no observation after it


async def test_wall_clock_timeout(tok):
    env = FakeTerminalEnv(step_delay_s=5.0)
    gen = ScriptedGenerator(tok, [bash("write answer 42")])
    traj = await play(env, gen, tok, cfg=AgentConfig(episode_timeout_s=0.3))
    assert traj.outcome == AGENT_TIMEOUT and traj.reward == 0.0 and traj.trainable
    assert traj.timings["env_s"] < 2.0 and env.closed == 1


async def test_env_enforced_time_limit_is_an_agent_timeout(tok):
    env = FakeTerminalEnv(done_after=2, done_metadata={"agent_timeout": True})
    gen = ScriptedGenerator(tok, [bash("write answer 42"), bash("cat answer"), bash("cat answer")])
    traj = await play(env, gen, tok)
    assert (traj.outcome, traj.reward, traj.num_turns) == (AGENT_TIMEOUT, 1.0, 2)
    env = FakeTerminalEnv(done_after=1)
    traj = await play(env, ScriptedGenerator(tok, [bash("write answer 42")]), tok)
    assert (traj.outcome, traj.reward, traj.info["stop"]) == (SCORED, 1.0, "env_done")


async def test_long_observations_keep_head_and_tail(tok):
    assert cap_observation("abcdef", 6) == "abcdef"
    capped = cap_observation("0123456789" * 10, 20)
    assert capped.startswith("0123456789\n[... 80 characters omitted ...]\n") and capped.endswith(
        "0123456789"
    )
    env = FakeTerminalEnv()
    gen = ScriptedGenerator(tok, [bash("spam 5000"), "TASK_COMPLETE"])
    traj = await play(env, gen, tok, cfg=AgentConfig(observation_max_chars=100))
    text = tok.decode(traj.token_ids)
    assert "abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwx\n[... 4900 characters omitted ...]\n" in text
    # Several commands in one turn share one cap.
    env = FakeTerminalEnv()
    gen = ScriptedGenerator(
        tok, [terminus("spam 300\n", "spam 300\n"), terminus(complete=True), terminus(complete=True)]
    )
    traj = await play(
        env, gen, tok, cfg=AgentConfig(action_format="terminus_json", observation_max_chars=100)
    )
    assert "[... 501 characters omitted ...]" in tok.decode(traj.token_ids)


# -- failures are never rewards, and the env is always closed ---------------------------------


@pytest.mark.parametrize(
    ("env_kwargs", "replies", "outcome"),
    [
        ({"fail_at": "reset"}, [], "infra_error:exec"),
        ({"fail_at": "step"}, [bash("cat x")], "infra_error:exec"),
        ({"fail_at": "step-bug"}, [bash("cat x")], "infra_error:env"),
        ({"fail_at": "score"}, ["TASK_COMPLETE"], "infra_error:exec"),
        ({"fail_at": "score-bug"}, ["TASK_COMPLETE"], "infra_error:verifier"),
        (
            {"score_obs": Observation(done=True, status="infra_error:verifier")},
            ["TASK_COMPLETE"],
            "infra_error:verifier",
        ),
        ({"score_obs": Observation(done=True, status="scored")}, ["TASK_COMPLETE"], "infra_error:verifier"),
        (
            {"score_obs": Observation(done=True, reward=float("nan"), status="scored")},
            ["TASK_COMPLETE"],
            "infra_error:verifier",
        ),
        ({}, [ConnectionError("engine gone")], "infra_error:engine"),
        ({}, [("TASK_COMPLETE", "abort")], "infra_error:engine"),
    ],
)
async def test_infra_failures_have_no_reward_and_close_the_env(tok, env_kwargs, replies, outcome):
    env = FakeTerminalEnv(**env_kwargs)
    traj = await play(env, ScriptedGenerator(tok, replies), tok)
    assert traj.outcome == outcome and traj.reward is None and not traj.trainable
    assert env.closed == 1 and traj.info["error"]


async def test_engine_result_with_misaligned_logprobs_is_an_engine_error(tok):
    class Broken(ScriptedGenerator):
        async def generate(self, input_ids, sampling, *, session_id, rid=None):
            result = await super().generate(input_ids, sampling, session_id=session_id, rid=rid)
            return GenerateResult(result.output_ids, result.logprobs[:-1], result.weight_versions, "stop")

    env = FakeTerminalEnv()
    traj = await play(env, Broken(tok, ["TASK_COMPLETE"]), tok)
    assert traj.outcome == "infra_error:engine" and "logprobs" in traj.info["error"] and env.closed == 1


async def test_cancellation_still_closes_the_env(tok):
    env = FakeTerminalEnv()
    task = asyncio.create_task(play(env, ScriptedGenerator(tok, [bash("cat x")], delay_s=10), tok))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert env.closed == 1


async def test_a_failing_close_is_recorded_not_raised(tok):
    class BadClose(FakeTerminalEnv):
        async def close(self):
            raise SandboxError("delete", "could not delete")

    traj = await play(BadClose(), ScriptedGenerator(tok, [bash("write answer 42"), "TASK_COMPLETE"]), tok)
    assert (traj.outcome, traj.reward) == (SCORED, 1.0) and "could not delete" in traj.info["close_error"]


# -- action formats ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "command", "complete", "error"),
    [
        (bash("ls -la"), "ls -la", False, None),
        ("```sh\necho hi\n```", "echo hi", False, None),
        ("```\necho hi\n```", "echo hi", False, None),  # no language tag
        (bash("ls") + "Output:\n```\nfile.txt\n```", "ls", False, None),  # shown output is not a command
        ("```\na\n```\n```\nb\n```", None, False, "Found 2"),
        ("<think>maybe ```bash\nrm -rf /\n``` or TASK_COMPLETE</think>\n" + bash("pwd"), "pwd", False, None),
        ("thinking: maybe ```bash\nrm -rf /\n```</think>\n" + bash("ls"), "ls", False, None),
        ("<think>unclosed ```bash\nrm -rf /\n```", None, False, "No ```bash block"),
        ("All done. TASK_COMPLETE", None, True, None),
        (bash("a") + bash("b"), "a", False, None),  # the first ```bash block runs, the rest is ignored
        (bash("ls") + " When the task is done, reply TASK_COMPLETE.", "ls", False, None),
        ("```\nls\n``` TASK_COMPLETE", None, False, "not both"),  # an unlabeled fence is stricter
        (bash("sudo rm -rf /app/x"), "rm -rf /app/x", False, None),  # the agent is root: sudo dropped
        (bash("cd /app && sudo -E cp a b; sudo\tls | sudo tee c"), "cd /app && cp a b; ls | tee c", False, None),
        (bash("echo pseudo sudoku > f"), "echo pseudo sudoku > f", False, None),  # only in command position
        (bash("sudo"), "sudo", False, None),  # a bare sudo is left for the shell to refuse
        (bash("sudo "), None, False, "empty"),
        ("```bash\nls", None, False, "No complete"),
        ("```bash\n\n```", None, False, "empty"),
        ("I think I should list files.", None, False, "No ```bash block"),
    ],
)
def test_bash_block_format(reply, command, complete, error):
    parsed = make_action_format("bash_block", command_timeout_s=30).parse(reply)
    assert parsed.complete == complete
    assert [a.command for a in parsed.actions] == ([command] if command else [])
    assert all(a.duration_s == 30 for a in parsed.actions)
    assert (parsed.error is None) if error is None else (error in parsed.error)


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        ("no json here", "no JSON object"),
        ('{"analysis": "a"}', 'missing "commands"'),
        ('{"commands": "ls"}', "must be a list"),
        ('{"commands": [{"keystrokes": 3}]}', "keystrokes must be a string"),
        ('{"commands": [{"keystrokes": "ls\\n", "duration": "soon"}]}', "duration must be a number"),
        ('{"commands": [], "task_complete": "yes"}', "true or false"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_terminus_format_errors(reply, error):
    parsed = make_action_format("terminus_json").parse(reply)
    assert parsed.error is not None and error in parsed.error and not parsed.actions


def test_terminus_format_defaults_and_clamps():
    parsed = make_action_format("terminus_json", 60).parse(
        'Sure: {"analysis": "", "plan": "", "commands": [{"keystrokes": "C-c"}, '
        '{"keystrokes": "sleep 1\\n", "duration": -3}, {"keystrokes": "make\\n", "duration": 1e9}]} thanks'
    )
    assert [(a.keystrokes, a.duration_s) for a in parsed.actions] == [
        ("C-c", 1.0),
        ("sleep 1\n", 0.0),
        ("make\n", 60.0),
    ]


def test_unknown_format_is_a_clear_error():
    with pytest.raises(ValueError, match="agent.action_format 'xml'"):
        make_action_format("xml")


# -- observation deltas under other templates -------------------------------------------------

# ChatML-like: an assistant turn closes with eos and a newline, so the delta starts with the
# newline when the model stopped on eos. Like Qwen3 it renders the latest assistant turn
# differently from past ones; the delta is taken from the history rendering.
QWEN_LIKE_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{ '<|assistant|>\\n' }}"
    "{%- if loop.last -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}{{ m.content + '<|endoftext|>\\n' }}"
    "{%- else -%}{{ '<|' + m.role + '|>\\n' + m.content + '<|endoftext|>\\n' }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)


@pytest.fixture
def qwen_like_tok():
    from agentrl.models.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny")
    tok.chat_template = QWEN_LIKE_TEMPLATE
    return tok


async def test_deltas_follow_the_template_and_skip_what_the_model_already_closed(qwen_like_tok):
    tok = qwen_like_tok
    eos = tok.eos_token_id
    env = FakeTerminalEnv()
    gen = ScriptedGenerator(tok, [bash("write answer 42"), (bash("cat answer"), "length"), "TASK_COMPLETE"])
    traj = await play(env, gen, tok)
    out1, out2, out3 = gen.outputs
    assert out1[-1] == eos and out2[-1] != eos
    def delta(obs):
        return tok.encode(f"\n<|user|>\n{obs}<|endoftext|>\n<|assistant|>\n", add_special_tokens=False)
    prompt = traj.token_ids[: traj.prompt_len]
    # Turn 1 ended with eos: the delta continues after it. Turn 2 was cut (no eos): the delta closes it.
    assert traj.token_ids == prompt + out1 + delta("(no output)") + out2 + [eos] + delta("42") + out3
    assert tok.decode(prompt).endswith(
        "<|user|>\nWrite 42 into the file answer.<|endoftext|>\n<|assistant|>\n"
    )


async def test_a_turn_ended_by_the_next_role_token_is_continued_after_it(tok):
    user = tok.convert_tokens_to_ids("<|user|>")

    class StopsOnUser(ScriptedGenerator):
        async def generate(self, input_ids, sampling, *, session_id, rid=None):
            r = await super().generate(input_ids, sampling, session_id=session_id, rid=rid)
            ids = r.output_ids[:-1] + [user]  # GLM-style: the turn ends by opening the user's
            self.outputs[-1] = ids
            return GenerateResult(ids, r.logprobs, r.weight_versions, "stop")

    env = FakeTerminalEnv()
    gen = StopsOnUser(tok, [bash("write answer 42"), "TASK_COMPLETE"])
    traj = await play(env, gen, tok)
    out1, out2 = gen.outputs
    prompt = traj.token_ids[: traj.prompt_len]
    rest = tok.encode("\n(no output)\n<|assistant|>\n", add_special_tokens=False)
    assert traj.token_ids == prompt + out1 + rest + out2 and traj.reward == 1.0


async def test_reasoning_is_not_parsed_even_with_special_think_tokens(tok):
    from agentrl.models.tokenizer import load_tokenizer

    think_tok = load_tokenizer("tiny")
    think_tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    env = FakeTerminalEnv()
    reasoning = "Maybe ```bash\nwrite answer 41\n``` first?</think>\n"  # template opened <think>
    gen = ScriptedGenerator(
        think_tok, [reasoning + bash("write answer 42"), "<think>hmm</think>TASK_COMPLETE"]
    )
    traj = await play(env, gen, think_tok)
    assert [a.command for a in env.actions] == ["write answer 42"]
    assert (traj.outcome, traj.reward, traj.info["parse_errors"]) == (SCORED, 1.0, 0)


def test_a_tokenizer_without_chat_template_is_a_clear_error(tok):
    from agentrl.agent.chat import ChatTokens

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        ChatTokens(NoTemplate(), "system")


# -- with the real terminal-bench-2 env and the local sandbox -------------------------------------


@pytest.mark.skipif(
    not (shutil.which("bwrap") and shutil.which("tmux")), reason="local sandbox needs bwrap and tmux"
)
@pytest.mark.parametrize("action_format", ["bash_block", "terminus_json"])
async def test_solves_a_tbench2_fixture_task_in_a_local_sandbox(tok, action_format):
    from agentrl.envs.registry import make_env

    solve = "printf 'Hello, agentrl!\\n' > /app/greeting.txt"
    replies = {
        "bash_block": [bash("cat /app/greeting.txt"), bash(solve), "TASK_COMPLETE"],
        "terminus_json": [
            terminus(solve + "\n", "cat /app/greeting.txt\n", complete=True),
            terminus(complete=True),
        ],
    }[action_format]
    env = make_env("tbench2")
    traj = await play(
        env,
        ScriptedGenerator(tok, replies),
        tok,
        cfg=AgentConfig(action_format=action_format),
        task_id="create-greeting",
    )
    assert traj.info.get("error") is None
    assert (traj.outcome, traj.reward, traj.info["stop"]) == (SCORED, 1.0, "task_complete")
    assert "Hello, agentrl!" in tok.decode(traj.token_ids[traj.prompt_len :])


class ReactiveGenerator(ScriptedGenerator):
    """A reply may be a function of the conversation so far (decoded), as a model reads it."""

    async def generate(self, input_ids, sampling, *, session_id, rid=None):
        if callable(self.replies[0]):
            self.replies[0] = self.replies[0](self.tok.decode(input_ids))
        return await super().generate(input_ids, sampling, session_id=session_id, rid=rid)


@pytest.mark.skipif(
    not (shutil.which("bwrap") and shutil.which("tmux")), reason="local sandbox needs bwrap and tmux"
)
@pytest.mark.parametrize("max_turns", [3, 2])
async def test_look_then_act_on_a_generated_task_sees_each_output(tok, tmp_path, max_turns):
    """bash_block over several turns: the model reads a file, and the name it acts on comes from
    that command's output in the conversation (it is in no instruction)."""
    import re

    from agentrl.envs.registry import make_env
    from envs.tbench2.generate.build import draw_instances, write_set
    from envs.tbench2.generate.registry import families_named

    inst = next(i for seed in range(20) for i in draw_instances(families_named(["follow-pointer"]), 1, seed)
                if i.task.solution[-1].startswith("rm "))
    write_set(tmp_path / "set", [inst], {"test": "look-then-act"})
    pointer = next(p for p in inst.task.app if "/" not in p)
    folder = next(p.split("/")[0] for p in inst.task.app if "/" in p)
    named = inst.task.app[pointer].content.decode().strip()
    assert named not in inst.task.instruction

    def act(conversation: str) -> str:
        seen = conversation.split(f"cat /app/{pointer}")[-1]
        return bash(f"rm /app/{folder}/{re.findall(r'[a-z]+_[a-z]+[.]txt', seen)[0]}")

    gen = ReactiveGenerator(tok, [bash(f"cat /app/{pointer}"), act, "TASK_COMPLETE"])
    env = make_env("tbench2", tasks_dir=tmp_path / "set")
    traj = await play(env, gen, tok, cfg=AgentConfig(max_turns=max_turns, command_timeout_s=10),
                      task_id=inst.task_id)
    assert traj.info.get("error") is None and traj.info["actions"] == 2
    assert (traj.outcome, traj.reward) == (SCORED, 1.0)
    assert (traj.num_turns, traj.info["stop"]) == ((3, "task_complete") if max_turns == 3 else (2, "max_turns"))
    # The first command's output came back as context (loss mask 0) before the second turn.
    second_prompt = gen.calls[1][0]
    observed = tok.decode(second_prompt[len(gen.calls[0][0]) + len(gen.outputs[0]):])
    assert named in observed
    assert named in tok.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if m == 0])
