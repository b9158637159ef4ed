"""OpenEnv in both directions, over a real server on 127.0.0.1 (uvicorn in a thread)."""

from __future__ import annotations

import importlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("openenv")
uvicorn = pytest.importorskip("uvicorn")

from agentrl_countdown import CountdownEnv  # noqa: E402 - after the importorskip lines

from agentrl.envs.base import Action, Observation  # noqa: E402 - after the importorskip lines
from agentrl.envs.openenv_adapter import OpenEnvRemote, create_openenv_app  # noqa: E402 - after the importorskip lines
from agentrl.sandbox.base import SandboxError  # noqa: E402 - after the importorskip lines


@contextmanager
def running(app) -> Iterator[str]:
    """Serve `app` on a free 127.0.0.1 port; yields its base URL; stops the server after."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()


@pytest.fixture(scope="module")
def countdown_url() -> Iterator[str]:
    with running(
        create_openenv_app(lambda: CountdownEnv(num_tasks=5), env_name="countdown", max_concurrent_envs=4)
    ) as url:
        yield url


async def test_served_countdown_episode_over_websocket(countdown_url):
    local = CountdownEnv(num_tasks=5)
    remote = OpenEnvRemote(countdown_url)
    assert remote.task_ids() == local.task_ids()  # through OpenEnv's Task API
    task = local.task_ids()[3]
    numbers, target = local.puzzle(task)
    try:
        first = await remote.reset(task, episode_id="ep-1")
        assert f"Target: {target}" in first.text and first.metadata["numbers"] == numbers
        wrong = await remote.step(Action(text=f"{numbers[0]} + {numbers[0]} + {numbers[0]}"))
        assert not wrong.done and "Invalid answer" in wrong.text
        right = await remote.step(Action(command=local.solution(task)))
        assert right.done and right.text.startswith("Correct")
        verdict = await remote.score()
        assert verdict.status == "scored" and verdict.reward == 1.0
        assert remote.state.step_count == 2 and remote.state.task_id == task
    finally:
        await remote.close()


async def test_served_countdown_unsolved_scores_zero_and_sessions_are_separate(countdown_url):
    local = CountdownEnv(num_tasks=5)
    a, b = OpenEnvRemote(countdown_url), OpenEnvRemote(countdown_url)
    try:
        await a.reset(local.task_ids()[0])
        await b.reset(local.task_ids()[1])
        await b.step(Action(text=local.solution(local.task_ids()[1])))
        assert (await a.score()).reward == 0.0
        assert (await b.score()).reward == 1.0
    finally:
        await a.close()
        await b.close()


class _BrokenSandboxEnv(CountdownEnv):
    async def step(self, action: Action) -> Observation:
        raise SandboxError("exec", "sandbox vanished")


async def test_infra_error_of_served_env_stays_an_infra_error():
    with running(create_openenv_app(_BrokenSandboxEnv)) as url:
        remote = OpenEnvRemote(url, task_ids=["countdown-0-0"])
        try:
            await remote.reset("countdown-0-0")
            with pytest.raises(SandboxError) as info:
                await remote.step(Action(text="1 + 1"))
            assert info.value.kind == "exec" and "sandbox vanished" in str(info.value)
        finally:
            await remote.close()


async def test_unreachable_server_is_an_infra_error():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    remote = OpenEnvRemote(f"http://127.0.0.1:{port}", connect_timeout_s=2)
    with pytest.raises(SandboxError) as info:
        await remote.reset("countdown-0-0")
    assert info.value.kind == "env_connect"
    await remote.close()


def _openenv_echo_env(tmp_path, monkeypatch):
    """The echo environment that ships inside openenv (its `openenv init` template), generated
    into tmp_path and imported as a package."""
    from openenv.cli.commands.init import init

    monkeypatch.chdir(tmp_path)
    init("agentrl_echo_env", output_dir=str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module("agentrl_echo_env.server.app")


async def test_openenv_echo_env_plugs_in_through_the_adapter(tmp_path, monkeypatch):
    echo = _openenv_echo_env(tmp_path, monkeypatch)
    with running(echo.app) as url:
        remote = OpenEnvRemote(url, task_ids=["echo"], action_field="message")
        assert remote.task_ids() == ["echo"]
        try:
            first = await remote.reset("echo", episode_id="ep-echo")
            assert "ready" in json.loads(first.text)["echoed_message"]
            obs = await remote.step(Action(text="hello"))
            assert json.loads(obs.text) == {"echoed_message": "hello", "message_length": 5}
            assert obs.reward == pytest.approx(0.5)
            verdict = await remote.score()  # a plain OpenEnv env: its last reward
            assert verdict.status == "scored" and verdict.reward == pytest.approx(0.5)
        finally:
            await remote.close()
    for name in [m for m in sys.modules if m.startswith("agentrl_echo_env")]:
        del sys.modules[name]


def test_importing_the_adapter_does_not_import_openenv():
    code = "import sys, agentrl.envs.openenv_adapter, agentrl.envs.registry; print('openenv' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_stateless_http_routes_and_seed_picked_tasks(countdown_url):
    import httpx

    local = CountdownEnv(num_tasks=5)
    async with httpx.AsyncClient(base_url=countdown_url, timeout=30) as http:
        # A plain OpenEnv client sends no task id: the seed picks one (seed 7 -> task 7 % 5 = 2).
        reset = (await http.post("/reset", json={"seed": 7})).raise_for_status().json()
        assert f"Target: {local.puzzle(local.task_ids()[2])[1]}" in reset["observation"]["text"]
        reset = (await http.post("/reset", json={"task_id": local.task_ids()[4]})).raise_for_status().json()
        assert f"Target: {local.puzzle(local.task_ids()[4])[1]}" in reset["observation"]["text"]
        task = (
            (await http.post("/countdown/task", json={"split": "all", "index": 1})).raise_for_status().json()
        )
        assert task["task"] == {"id": local.task_ids()[1], "index": 1}
        schema = (await http.get("/schema")).raise_for_status().json()
        assert schema["action"]["title"] == "AgentrlAction" and "op" in schema["action"]["properties"]


@pytest.mark.slow
def test_serve_openenv_runs_a_server_process():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    code = (
        "from agentrl.envs.openenv_adapter import serve_openenv\n"
        "from agentrl_countdown import CountdownEnv\n"
        f"serve_openenv(lambda: CountdownEnv(num_tasks=2), port={port}, env_name='countdown')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                names = httpx.get(f"http://127.0.0.1:{port}/list_environments", timeout=2).json()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.5)
        assert names == ["countdown"]
        assert OpenEnvRemote(f"http://127.0.0.1:{port}").task_ids() == ["countdown-0-0", "countdown-0-1"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_server_that_is_not_there_is_one_line_naming_base_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(ValueError, match=rf"http://127.0.0.1:{port}: cannot list its tasks \(ConnectError.*env.kwargs.base_url"):
        OpenEnvRemote(f"http://127.0.0.1:{port}", connect_timeout_s=5).task_ids()
