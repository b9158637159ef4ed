"""Sandbox faults: Daytona create storms and slow creates (the SDK against the local stand-in),
sandboxes dying mid-exec and mid-episode, a hanging command, 1 GB of output, and the adversarial
terminal-bench-2 fixtures (a test.sh that hangs, a missing or garbage reward file)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import time
import uuid
from pathlib import Path

from bench.faults_base import Checks, Outcome, Scenario, lost_trajectories

PLANTED_KEY = "sk-dtn-FAULTS-0c5e8a1f3b7d9e2a4c6b"  # must never show up anywhere


@contextlib.contextmanager
def planted_env(**values: str):
    """Set environment variables for the duration (the providers read the key from there)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.asynccontextmanager
async def daytona(**faults):
    """A stand-in Daytona server with `faults` and a provider on it (fast backoff)."""
    from agentrl.config.schema import SandboxConfig
    from agentrl.sandbox.daytona import DaytonaSandboxProvider
    from bench.doubles import start_daytona_standin

    cfg = faults.pop("provider", {})
    with planted_env(DAYTONA_API_KEY=PLANTED_KEY, DAYTONA_USE_DEPRECATED_POLLING="true"):
        url, handle = start_daytona_standin(api_key=PLANTED_KEY, **faults)
        p = DaytonaSandboxProvider(SandboxConfig(backend="daytona", daytona_api_url=url, retry_backoff_min_s=0.01,
                                                 retry_backoff_max_s=0.05, **cfg), f"faults-{uuid.uuid4().hex[:6]}",
                                   orphan_recheck_s=(0.3, 1.0))
        try:
            yield p, handle
        finally:
            await p.aclose()
            handle.stop()


def _spec():
    from agentrl.sandbox.base import SandboxSpec

    return SandboxSpec(image="ubuntu:22.04", workdir=".", labels={"task": "faults"})


async def create_storm(tmp: Path) -> Outcome:
    c = Checks()
    async with daytona(throttle_creates=12, retry_after_s=0.02, provider={"max_create_attempts": 20}) as (p, h):
        boxes = await asyncio.gather(*(p.create(_spec()) for _ in range(4)))
        c(len(boxes) == 4, f"4 of 4 creates succeeded through {h.throttled_sent} answers of 429")
        c(p.counters["create_throttled"] == 12, f"{p.counters['create_throttled']} throttled attempts counted")
        outs = [await b.exec("echo ok") for b in boxes]
        c(all(o.output == "ok\n" for o in outs), "every sandbox runs commands")
        await asyncio.gather(*(b.close() for b in boxes))
        c(h.live() == [], "every sandbox deleted on close")
    return c.outcome()


async def create_storm_exhausted(tmp: Path) -> Outcome:
    from agentrl.sandbox.base import SandboxError

    c = Checks()
    async with daytona(throttle_creates=1000, provider={"max_create_attempts": 3}) as (p, h):
        try:
            await p.create(_spec())
            c(False, "create gave up")
        except SandboxError as e:
            c(e.kind == "throttled" and e.retryable, f"create gave up after 3 attempts: SandboxError({e.kind}) {e}")
        c(h.creates_received == 3 and h.live() == [], "no sandbox left behind")
    return c.outcome()


async def slow_creates(tmp: Path) -> Outcome:
    from agentrl.sandbox.base import SandboxError

    c = Checks()
    async with daytona(start_delay_s=0.6, provider={"create_timeout_s": 10}) as (p, h):
        t0 = time.monotonic()
        boxes = await asyncio.gather(*(p.create(_spec()) for _ in range(3)))
        c(len(boxes) == 3, f"3 slow creates (0.6 s to start) waited for and usable in {time.monotonic() - t0:.1f} s")
        await asyncio.gather(*(b.close() for b in boxes))
    async with daytona(create_delay_s=1.5, provider={"create_timeout_s": 1}) as (p, h):
        try:
            await p.create(_spec())
            c(False, "a create slower than create_timeout_s fails")
        except SandboxError as e:
            c(e.kind == "create" and "timed out" in str(e), f"a create past its timeout: SandboxError({e.kind}) {e}")
        await p.aclose()  # waits for the orphan reaper
        c(len(h.created) == 1 and h.live() == [], "the late sandbox was found by label and deleted (no orphan)")
    return c.outcome()


async def dies_mid_exec(tmp: Path) -> Outcome:
    from agentrl.sandbox.base import SandboxError

    c = Checks()
    async with daytona(die_on_exec=2, die_delay_s=0.2) as (p, h):
        sb = await p.create(_spec())
        c((await sb.exec("echo fine")).exit_code == 0, "first command ran")
        try:
            await sb.exec("sleep 5", timeout_s=10)
            c(False, "the dying sandbox is reported")
        except SandboxError as e:
            c(e.kind == "lost", f"the command in the dying sandbox raised SandboxError({e.kind})")
        await sb.close()
        c(h.live() == [], "close still deleted what was left")
    return c.outcome()


class OneCommandPolicy:
    """Stands in for the model only (the fault is in the sandbox): answers every turn with the same
    bash block, with the token-level fields a real engine returns."""

    def __init__(self, tokenizer, reply: str):
        self.tok, self.reply = tokenizer, reply

    async def generate(self, input_ids, sampling, *, session_id, rid=None):
        from agentrl.rollout.types import GenerateResult

        ids = self.tok.encode(self.reply, add_special_tokens=False) + [self.tok.eos_token_id]
        return GenerateResult(ids, [-0.1] * len(ids), [0] * len(ids), "stop")


async def dies_mid_episode(tmp: Path) -> Outcome:
    """A real terminal-bench-2 episode in a local sandbox whose init is SIGKILLed mid-command."""
    from agentrl.agent.episode import run_episode
    from agentrl.buffer.replay import ReplayBuffer
    from agentrl.config.schema import AgentConfig, SandboxConfig
    from agentrl.models.tokenizer import load_tokenizer
    from agentrl.policy.retry import RetryPolicy
    from agentrl.rollout.types import SamplingParams
    from agentrl.sandbox.local import LocalSandboxProvider
    from envs.tbench2.env import TB2Env

    c = Checks()
    tok = load_tokenizer("tiny")
    provider = LocalSandboxProvider(SandboxConfig(), run_id=f"flt{uuid.uuid4().hex[:6]}", root_dir=tmp / "boxes")
    buf = ReplayBuffer(tmp / "run", group_size=2, max_staleness=4)
    try:
        trajs = []
        for k, kill in ((0, False), (1, True)):
            env = TB2Env(provider=provider, command_timeout_s=20)
            policy = OneCommandPolicy(tok, "```bash\nsleep 3; echo done\n```")

            async def killer(env=env):
                while env._sandbox is None:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)
                os.kill(env._sandbox._init_pid, 9)

            kt = asyncio.create_task(killer()) if kill else None
            trajs.append(await run_episode(env, policy, tok, "create-greeting", AgentConfig(max_turns=2),
                                           SamplingParams(max_new_tokens=32), f"gdie-{k}", "gdie"))
            if kt:
                await kt
            buf.add(trajs[-1])
        ok, dead = trajs
        c(ok.outcome == "scored" and ok.reward == 0.0, f"the healthy episode scored {ok.reward}")
        c(dead.outcome.startswith("infra_error") and dead.reward is None,
          f"the episode whose sandbox died ended {dead.outcome}, reward {dead.reward} ({dead.info.get('error', '')[:80]})")
        c(buf.take_batch(1, 0) is None and buf.counters["infra_groups_retired"] == 1,
          "its group was retired, never offered for training")
        retired = buf.pop_retired()
        c([(r.task_id, r.reason) for r in retired] == [("create-greeting", "infra_error")],
          f"the buffer reported the retirement: {[(r.task_id, r.reason) for r in retired]}")
        decision = RetryPolicy().decide("gdie", list(retired[0].outcomes)) if retired else None
        c(decision is not None and decision.retry, f"the retry policy runs the group again ({decision})")
        await provider.aclose()
        c(not provider.base_dir.exists() or list(provider.base_dir.iterdir()) == [], "no sandbox folder left")
    finally:
        buf.close()
        await provider.aclose()
    lost, counts = lost_trajectories(tmp / "run")
    c.details["log"] = counts
    return c.outcome(lost)


@contextlib.asynccontextmanager
async def local_box(tmp: Path):
    from agentrl.config.schema import SandboxConfig
    from agentrl.sandbox.base import SandboxSpec
    from agentrl.sandbox.local import LocalSandboxProvider

    p = LocalSandboxProvider(SandboxConfig(), run_id=f"flt{uuid.uuid4().hex[:6]}", root_dir=tmp / "boxes")
    try:
        yield p, await p.create(SandboxSpec())
    finally:
        await p.aclose()


async def hanging_command(tmp: Path) -> Outcome:
    from agentrl.sandbox.local_procs import pids_in_namespace

    c = Checks()
    async with local_box(tmp) as (_p, box):
        before = len(pids_in_namespace(box._ns))
        t0 = time.monotonic()
        r = await box.exec("echo started; sleep 1000 & setsid sleep 1001 & tail -f /dev/null", timeout_s=2)
        took = time.monotonic() - t0
        c(r.timed_out and r.exit_code == -1 and "started" in r.output,
          f"timed out after {took:.1f} s (limit 2 s) with exit_code -1 and the output so far")
        c(took < 10, "the caller got control back promptly")
        left = len(pids_in_namespace(box._ns))
        c(left == before, f"every process it started was killed ({left} processes in the sandbox, as before)")
        c((await box.exec("echo alive")).output == "alive\n", "the sandbox stays usable")
    return c.outcome()


async def gigabyte_of_output(tmp: Path) -> Outcome:
    c = Checks()
    async with local_box(tmp) as (_p, box):
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.monotonic()
        r = await box.exec("head -c 1G /dev/zero | tr '\\0' x; echo; echo tail-marker",
                           max_output_bytes=64 << 10, timeout_s=120)
        took = time.monotonic() - t0
        grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        c(r.exit_code == 0 and r.truncated and not r.timed_out, f"1 GiB of output read in {took:.1f} s, truncated")
        c(len(r.output.encode()) < (64 << 10) + 200 and r.output.endswith("tail-marker\n"),
          f"{len(r.output.encode())} bytes kept (cap 64 KiB: head and tail, with a marker)")
        c("bytes of output omitted" in r.output, "the omission is stated in the output")
        c(grew_mb < 64, f"peak memory of the reader grew {grew_mb:.0f} MB (not 1 GB)")
    return c.outcome()


def _check_fixture(name: str, edit=None):
    async def scenario(tmp: Path) -> Outcome:
        return await _fixture(tmp, name, edit)

    return scenario


async def _fixture(tmp: Path, name: str, edit) -> Outcome:
    from agentrl.config.schema import SandboxConfig
    from agentrl.sandbox.local import LocalSandboxProvider
    from envs.tbench2.check import check_task
    from envs.tbench2.loader import DEFAULT_TASKS_DIR

    c = Checks()
    task_dir = tmp / "tasks" / name
    shutil.copytree(DEFAULT_TASKS_DIR / name, task_dir)
    if edit:
        edit(task_dir)
    p = LocalSandboxProvider(SandboxConfig(), run_id=f"flt{uuid.uuid4().hex[:6]}", root_dir=tmp / "boxes")
    try:
        r = await check_task(p, task_dir)
    finally:
        await p.aclose()
    want = {"verifier-hangs": ("infra_error:verifier_timeout", None), "hanging-command": ("scored", 1.0),
            "runaway-output": ("scored", 1.0)}.get(name, ("infra_error:verifier", None))
    c((r.status, r.reward) == want, f"oracle attempt ended {r.status} with reward {r.reward} (task check ok={r.ok})")
    if name == "verifier-hangs":
        c(r.empty_status == want[0], f"the empty attempt too: {r.empty_status}")
    else:
        c(r.empty_reward in (None, 0.0), f"the empty attempt got reward {r.empty_reward}")
    c(r.elapsed_s < 60, f"both attempts finished in {r.elapsed_s:.1f} s")
    c(not p.base_dir.exists() or list(p.base_dir.iterdir()) == [], "no sandbox left")
    return c.outcome()


def _garbage_reward(task_dir: Path) -> None:
    (task_dir / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\nprintf 'reward: yes\\n\\x00\\xff\\xfe 1e999\\n' > /logs/verifier/reward.txt\n")


SCENARIOS = (
    Scenario("sandbox_create_429_storm", "sandbox",
             "12 answers of 429 to 4 concurrent creates are retried with backoff and counted; all 4 sandboxes "
             "work and are deleted on close", create_storm),
    Scenario("sandbox_create_429_exhausted", "sandbox",
             "an endless 429 storm ends the create with SandboxError(throttled) after max_create_attempts, "
             "leaving no sandbox", create_storm_exhausted),
    Scenario("sandbox_slow_creates", "sandbox",
             "slow-starting sandboxes are waited for; a create slower than create_timeout_s fails as "
             "SandboxError(create) and the late sandbox is deleted by label", slow_creates),
    Scenario("sandbox_dies_mid_exec", "sandbox",
             "a Daytona sandbox that dies during a command raises SandboxError(lost); close still deletes it",
             dies_mid_exec),
    Scenario("sandbox_dies_mid_episode", "sandbox",
             "a local sandbox killed mid-episode ends that episode as infra_error with no reward; its group is "
             "retired and regenerated, never trained; nothing accepted is lost", dies_mid_episode),
    Scenario("sandbox_hanging_command", "sandbox",
             "a command that never returns (plus background and setsid children) times out, returns exit -1 with "
             "its output so far, and every process it started is killed", hanging_command),
    Scenario("sandbox_gigabyte_of_output", "sandbox",
             "1 GiB of output is read to the end but only a 64 KiB head+tail is kept, memory stays flat",
             gigabyte_of_output),
    Scenario("task_solution_hangs", "sandbox",
             "tbench2 fixture hanging-command: the agent step that never returns is killed at the agent "
             "timeout and the task still scores", _check_fixture("hanging-command")),
    Scenario("task_runaway_output", "sandbox",
             "tbench2 fixture runaway-output: endless output is capped and killed, the task still scores",
             _check_fixture("runaway-output")),
    Scenario("task_test_sh_hangs", "sandbox",
             "tbench2 fixture verifier-hangs: a test.sh that never returns is infra_error:verifier_timeout, "
             "never reward 0", _check_fixture("verifier-hangs")),
    Scenario("task_reward_file_missing", "sandbox",
             "a test.sh that writes no reward file is infra_error:verifier, never reward 0",
             _check_fixture("missing-reward")),
    Scenario("task_reward_file_nan", "sandbox", "a reward file holding 'nan' is infra_error:verifier",
             _check_fixture("nan-reward")),
    Scenario("task_reward_file_garbage", "sandbox",
             "a reward file of text and binary garbage is infra_error:verifier",
             _check_fixture("nan-reward", _garbage_reward)),
)
