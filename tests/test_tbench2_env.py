"""TB2Env on the local sandbox: reset / step (commands and tmux keystrokes) / score / close."""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid

import pytest

from agentrl.config.schema import RunConfig, SandboxConfig
from agentrl.envs.base import Action, Env
from agentrl.envs.registry import make_env
from agentrl.sandbox.local import LocalSandboxProvider
from agentrl.sandbox.local_procs import pids_in_namespace
from envs.tbench2.env import TB2Env
from envs.tbench2.loader import DEFAULT_TASKS_DIR
from envs.tbench2.terminal import cap_text

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or shutil.which("tmux") is None, reason="needs bubblewrap and tmux"
)


@pytest.fixture
async def provider(tmp_path):
    p = LocalSandboxProvider(
        SandboxConfig(), run_id=f"env{uuid.uuid4().hex[:6]}", root_dir=tmp_path / "boxes"
    )
    yield p
    await p.aclose()


@pytest.fixture
async def env(provider):
    e = TB2Env(provider=provider, observation_max_chars=2000, verifier_timeout_s=None)
    yield e
    await e.close()


async def test_reset_step_score_with_commands(env):
    assert isinstance(env, Env)
    obs = await env.reset("create-greeting", episode_id="ep1")
    assert obs.text.startswith("Create the file `/app/greeting.txt`")
    assert "Current terminal screen:" in obs.text and "/app" in obs.metadata["screen"]
    assert env.state.task_id == "create-greeting" and env.state.episode_id == "ep1"
    out = await env.step(Action(command="pwd; ls /tests 2>&1; ls /solution 2>&1"))
    assert out.text.startswith("/app\n") and "No such file" in out.text  # tests and oracle are hidden
    out = await env.step(Action(command="exit 4"))
    assert out.text.endswith("[exit code 4]") and out.metadata["exit_code"] == 4
    out = await env.step(Action(command="sleep 5", duration_s=0.5))
    assert "timed out after 0.5 s" in out.text and out.metadata["timed_out"]
    out = await env.step(Action(command="yes 0123456789 | head -c 100000"))
    assert len(out.text) <= 2000 + 60 and "omitted" in out.text
    await env.step(Action(command="printf 'Hello, agentrl!\\n' > /app/greeting.txt"))
    verdict = await env.score()
    assert (verdict.status, verdict.reward, verdict.done) == ("scored", 1.0, True)
    assert env.state.step_count == 5
    with pytest.raises(RuntimeError):
        await env.score()


async def test_keystrokes_drive_tmux(env):
    await env.reset("count-lines")
    out = await env.step(Action(keystrokes="echo first-$((20+1))\n", duration_s=0.5))
    assert "first-21" in out.text and "echo first-$((20+1))" in out.text
    out = await env.step(Action(keystrokes="echo second\n", duration_s=0.5))
    assert "second" in out.text and "first-21" not in out.text  # only what is new
    out = await env.step(Action(keystrokes="sleep 100\n", duration_s=0.3))
    out = await env.step(Action(keystrokes="C-c", duration_s=0.3))
    assert "^C" in out.text
    long_cmd = (
        "echo " + "x" * 5000 + " > /dev/null; wc -l < data/words.txt > count.txt\n"
    )  # paste-buffer path
    await env.step(Action(keystrokes=long_cmd, duration_s=1.0))
    out = await env.step(Action(command="cat /app/count.txt"))
    assert out.text.strip() == "37"
    assert (await env.score()).reward == 1.0


async def test_nul_bytes_in_model_output_are_the_episodes_not_infra_errors(env):
    # Sampled tokens can decode to NUL, which argv cannot carry: typed keystrokes send it as C-@
    # (bash ignores it at the prompt), a command holding one fails with exit 126 and a reason.
    await env.reset("count-lines")
    out = await env.step(Action(keystrokes="echo nul-\x00ok\n", duration_s=0.5))
    assert "nul-ok" in out.text
    out = await env.step(Action(command="echo a\x00b"))
    assert "NUL byte" in out.text


async def test_shell_exit_restarts_terminal(env):
    await env.reset("count-lines")
    await env.step(Action(keystrokes="exit\n", duration_s=0.3))
    out = await env.step(Action(keystrokes="echo back\n", duration_s=0.5))
    assert "new one was started" in out.text and "back" in out.text


async def test_empty_attempt_and_planted_reward_score_zero(env):
    await env.reset("create-greeting")
    assert (await env.score()).reward == 0.0
    await env.reset("planted-reward")  # reset replaces the sandbox
    await env.step(
        Action(command="mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && echo 0 > sum.txt")
    )
    verdict = await env.score()
    assert verdict.status == "scored" and verdict.reward == 0.0


async def test_verifier_failures_are_not_rewards(env):
    await env.reset("missing-reward")
    await env.step(Action(command="echo hello > /app/hello.txt"))
    verdict = await env.score()
    assert verdict.status == "infra_error:verifier" and verdict.reward is None
    assert "exit 0) wrote no /logs/verifier/reward.json" in verdict.text
    # a test.sh that never started says so (here the sandbox cannot enter the workdir the verifier asks for); in
    # a fresh sandbox of the task the tests run, so what differs is the agent's sandbox: scored 0
    await env.reset("write-name")
    _exec_in_a_missing_workdir(env._sandbox)
    verdict = await env.score()
    assert (verdict.status, verdict.reward) == ("scored", 0.0), verdict.text
    assert "tests/test.sh never started" in verdict.text and "in a fresh sandbox of the task it runs" in verdict.text
    await env.reset("verifier-hangs")
    start = time.monotonic()
    verdict = await env.score()
    assert verdict.status == "infra_error:verifier_timeout" and verdict.reward is None
    assert time.monotonic() - start < 10


async def test_a_workdir_the_agent_locked_is_scored_not_an_infra_error(env):
    # A folder without its owner's x bit once stopped test.sh from starting (`env -C /app`, exit 125) and the
    # episode was an infra error, its group untrained. The local sandbox's root now enters it as root on Docker
    # does (local_isolation.ROOT_CAPS), so the mode the agent left stays (sandbox/workdir.py's fix-up is for a
    # sandbox whose root cannot).
    await env.reset("write-name")  # the tests run in the agent's own sandbox
    await env.step(Action(command="echo 'Ada Lovelace' > name.txt && chmod 444 ."))
    verdict = await env.score()
    assert (verdict.status, verdict.reward) == ("scored", 1.0), verdict.text  # as root on Docker scores it
    out = await env.step(Action(command="stat -c %a /app"))
    assert out.text.strip() == "444"
    await env.reset("write-name")
    await env.step(Action(command="chmod 000 /app"))
    verdict = await env.score()
    assert (verdict.status, verdict.reward) == ("scored", 0.0), verdict.text
    await env.reset("write-name")
    await env.step(Action(command="cd / && rm -rf /app && echo x > /app"))  # a file where the workdir goes
    verdict = await env.score()
    assert (verdict.status, verdict.reward) == ("scored", 0.0), verdict.text


def _count_creates(provider) -> list:
    """The `purpose` label of every sandbox `provider` creates from now on, in order."""
    created, real_create = [], provider.create

    async def counting_create(spec):
        created.append(spec.labels.get("purpose"))
        return await real_create(spec)

    provider.create = counting_create
    return created


def _exec_in_a_missing_workdir(box):
    """box whose test.sh never starts (its exec cannot enter the workdir), as when the agent deleted bash."""
    real_exec = box.exec

    async def exec_in_a_missing_workdir(cmd, **kw):
        return await real_exec(cmd, **(kw | {"cwd": "/no-such-dir"} if "exec /bin/bash" in cmd else kw))

    box.exec = exec_in_a_missing_workdir
    return box


async def test_an_agent_that_breaks_its_sandbox_scores_zero_not_an_infra_error(env, provider):
    # As an infra error the group was retried, then dropped, and breaking the machine never cost the policy
    # anything. Where a fresh sandbox of the task runs the tests, the agent is to blame: scored 0.
    real_create = provider.create
    created = _count_creates(provider)
    await env.reset("write-name")
    await env.step(Action(command="echo 'Ada Lovelace' > name.txt"))
    _exec_in_a_missing_workdir(env._sandbox)
    created.clear()
    verdict = await env.score()
    assert (verdict.status, verdict.reward) == ("scored", 0.0), verdict.text
    assert verdict.text.startswith("scored: the agent's changes broke the verifier: tests/test.sh never started")
    assert created == ["verifier-control"]
    # where the tests cannot start in a fresh sandbox either (the task or the machinery, not the agent), the
    # infra error stands
    await env.reset("write-name")
    _exec_in_a_missing_workdir(env._sandbox)

    async def broken_create(spec):
        return _exec_in_a_missing_workdir(await real_create(spec))

    provider.create = broken_create
    verdict = await env.score()
    assert (verdict.status, verdict.reward) == ("infra_error:verifier", None), verdict.text
    assert "[a fresh sandbox of the task fails too: tests/test.sh never started" in verdict.text, verdict.text


async def test_the_tests_run_after_the_agent_locks_the_root_folder(env, provider):
    # After `chmod 644 /` (or 0, or 500) the tests run as they would on Docker, in the agent's own sandbox (no
    # control sandbox needed): root keeps CAP_DAC_OVERRIDE (local_isolation.ROOT_CAPS). Without it no program
    # loaded, not even the verifier's first command.
    created = _count_creates(provider)
    for mode in ("644", "0", "500"):
        await env.reset("write-name")
        out = await env.step(Action(command=f"echo 'Ada Lovelace' > name.txt && chmod {mode} / && echo locked"))
        assert "locked" in out.text
        created.clear()  # reset's own sandbox
        verdict = await env.score()
        assert (verdict.status, verdict.reward, created) == ("scored", 1.0, []), (mode, verdict.text)


async def test_agent_timeout_ends_the_episode(env):
    await env.reset("hanging-command")  # [agent] timeout_sec = 3
    start = time.monotonic()
    out = await env.step(Action(command="echo ready > state.txt; sleep 60", duration_s=60))
    assert out.metadata["timed_out"] and time.monotonic() - start < 6  # clamped to the time left
    out = await env.step(Action(command="echo late"))
    assert out.done and out.metadata["agent_timeout"]
    assert (await env.score()).reward == 1.0  # scored after the agent ran out of time


async def test_close_deletes_sandbox_and_processes(env, provider):
    await env.reset("create-greeting")
    box = env._sandbox
    await env.step(Action(command="(setsid sleep 1000 &); tmux new -d 'sleep 1001'"))
    ns = box._ns
    assert pids_in_namespace(ns)
    await env.close()
    assert pids_in_namespace(ns) == [] and not box.host_dir.exists()
    assert provider._live == {}
    await env.close()  # idempotent


async def test_task_ids_skip_invalid_and_unknown_task_errors(env):
    ids = env.task_ids()
    assert "create-greeting" in ids and "malformed-toml" not in ids
    assert "[verifier].timeout_sec" in env.invalid_tasks["malformed-toml"]
    with pytest.raises(KeyError, match="unknown task"):
        await env.reset("../etc")


async def test_registry_and_config_construction(tmp_path):
    env = make_env("tbench2", tasks_dir=str(DEFAULT_TASKS_DIR), sandbox={"backend": "local"})
    assert isinstance(env, TB2Env) and "sort-names" in env.task_ids()
    assert set(env.splits()["eval"]) <= set(env.task_ids())
    cfg = RunConfig()
    cfg.agent.observation_max_chars = 123
    env2 = TB2Env.from_config(cfg)
    assert env2.observation_max_chars == 123 and env2.tasks_dir == DEFAULT_TASKS_DIR
    obs = await env.reset("sort-names")  # the env's own provider, closed by close()
    assert "names.txt" in obs.text
    provider = env._provider
    await env.close()
    assert env._provider is None and not provider.base_dir.exists()


def test_cap_text_keeps_both_ends():
    text = "A" * 100 + "B" * 100
    capped = cap_text(text, 50)
    assert capped.startswith("A" * 25) and capped.endswith("B" * 25) and "150 bytes" in capped
    assert cap_text("short", 50) == "short"


async def test_concurrent_episodes(provider):
    envs = [TB2Env(provider=provider) for _ in range(3)]
    try:
        await asyncio.gather(*(e.reset("fix-sum-script") for e in envs))
        await envs[0].step(Action(command="sed -i 's/- \\$2/+ $2/' sum.sh"))
        rewards = [(await e.score()).reward for e in envs]
        assert rewards == [1.0, 0.0, 0.0]
    finally:
        await asyncio.gather(*(e.close() for e in envs))
