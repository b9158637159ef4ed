"""Bridges to OpenEnv (`openenv` 0.10.0), in both directions.

- `create_openenv_app` / `serve_openenv`: serve any agentrl `Env` through OpenEnv's `create_app`,
  so OpenEnv clients (and `OpenEnvRemote`) can play it over the WebSocket.
- `OpenEnvRemote`: use any running OpenEnv environment server as an agentrl `Env`.

openenv is imported only inside functions: importing it pulls in gradio (~2 s), which no episode
worker should pay unless it talks to OpenEnv.

Wire protocol of a served agentrl env: the action is `AgentrlAction` (agentrl's Action fields plus
`op`: "step", or "score" to end the episode with a verdict, since OpenEnv has no score call);
the observation is `AgentrlObservation` (text, status, plus OpenEnv's done/reward/metadata). An
infrastructure failure inside the served env travels as status `infra_error:<kind>` and is raised
again on the client as `SandboxError(kind)`, so it stays an infra error and never becomes a reward.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from agentrl.envs.base import Action, Env, Observation, State
from agentrl.sandbox.base import SandboxError

if TYPE_CHECKING:
    from fastapi import FastAPI

WIRE_ACTION_TITLE = "AgentrlAction"
# The single split a served agentrl env publishes through OpenEnv's Task API.
TASK_SPLIT = "all"
_INFRA_PREFIX = "infra_error:"
_log = logging.getLogger(__name__)


# -- serving an agentrl Env through OpenEnv ----------------------------------------------------


def create_openenv_app(
    env_factory: Callable[[], Env], *, env_name: str = "agentrl", max_concurrent_envs: int = 1
) -> FastAPI:
    """An OpenEnv FastAPI app (HTTP + WebSocket `/ws`) serving the env that `env_factory` builds.

    Every WebSocket session gets its own env from the factory, so sessions never share state.
    """
    if not callable(env_factory):
        raise TypeError(
            f"env_factory must build an Env (a class or function), got {type(env_factory).__name__}"
        )
    from openenv.core.env_server.http_server import create_app

    action_cls, observation_cls, state_cls, served_cls = _wire_types()
    return create_app(
        functools.partial(served_cls, env_factory),
        action_cls,
        observation_cls,
        env_name=env_name,
        max_concurrent_envs=max_concurrent_envs,
        state_cls=state_cls,
    )


def serve_openenv(
    env_factory: Callable[[], Env],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    env_name: str = "agentrl",
    max_concurrent_envs: int = 1,
    log_level: str = "warning",
) -> None:
    """Serve the env through OpenEnv on host:port until interrupted (blocks)."""
    import uvicorn

    app = create_openenv_app(env_factory, env_name=env_name, max_concurrent_envs=max_concurrent_envs)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def _wire_types() -> tuple[type, type, type, type]:
    """OpenEnv pydantic types for agentrl's Action/Observation/State, and the served Environment.

    Built on demand because they subclass openenv's classes (see the module docstring).
    """
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action as OEAction
    from openenv.core.env_server.types import Observation as OEObservation
    from openenv.core.env_server.types import State as OEState
    from pydantic import Field

    class AgentrlAction(OEAction):
        op: Literal["step", "score"] = Field("step", description="'score' ends the episode with a verdict")
        command: str | None = None
        keystrokes: str | None = None
        duration_s: float | None = None
        text: str | None = None

    class AgentrlObservation(OEObservation):
        text: str = ""
        status: str | None = Field(None, description="'scored' or 'infra_error:<kind>' (never a reward)")

    class AgentrlState(OEState):
        task_id: str | None = None

    class ServedAgentrlEnv(Environment):
        """One agentrl Env behind OpenEnv's Environment interface (one per session)."""

        # Each session builds its own agentrl env from the factory: nothing is shared.
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self, env_factory: Callable[[], Env]):
            super().__init__()
            self._env = env_factory()
            self._loop: asyncio.AbstractEventLoop | None = None
            self._pending_close: asyncio.Task | None = None

        async def reset_async(
            self, seed: int | None = None, episode_id: str | None = None, task_id: str | None = None, **_: Any
        ) -> AgentrlObservation:
            self._loop = asyncio.get_running_loop()
            if task_id is None:
                # Plain OpenEnv clients know no task ids: let the seed pick one, deterministically.
                ids = self._env.task_ids()
                if not ids:
                    raise ValueError("reset without task_id, and the env lists no tasks; pass task_id")
                task_id = ids[(seed or 0) % len(ids)]
            return await self._call(self._env.reset(task_id, episode_id=episode_id, seed=seed))

        async def step_async(
            self, action: AgentrlAction, timeout_s: float | None = None, **_: Any
        ) -> AgentrlObservation:
            self._loop = asyncio.get_running_loop()
            if action.op == "score":
                return await self._call(self._env.score())
            fields = action.model_dump(exclude={"op"})
            return await self._call(self._env.step(Action(**fields)))

        async def _call(self, pending) -> AgentrlObservation:
            try:
                obs = await pending
            except SandboxError as err:
                return AgentrlObservation(text=str(err), done=True, status=f"{_INFRA_PREFIX}{err.kind}")
            return AgentrlObservation(
                text=obs.text, done=obs.done, reward=obs.reward, status=obs.status, metadata=obs.metadata
            )

        # OpenEnv's sync entry points; used only when the caller has no event loop of its own.
        def reset(
            self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
        ) -> AgentrlObservation:
            return _run_blocking(self.reset_async(seed=seed, episode_id=episode_id, **kwargs))

        def step(
            self, action: AgentrlAction, timeout_s: float | None = None, **kwargs: Any
        ) -> AgentrlObservation:
            return _run_blocking(self.step_async(action, timeout_s=timeout_s))

        @property
        def state(self) -> AgentrlState:
            return AgentrlState.model_validate(self._env.state.model_dump())

        # OpenEnv Task API (GET /{env_name}/splits, POST /{env_name}/tasks, ...).
        def list_splits(self) -> list[str]:
            return [TASK_SPLIT]

        def list_tasks(self, split: str) -> list[dict[str, Any]]:
            return [{"id": t, "index": i} for i, t in enumerate(self._task_ids(split))]

        def num_tasks(self, split: str) -> int:
            return len(self._task_ids(split))

        def get_task(self, split: str, index: int) -> dict[str, Any]:
            return {"id": self._task_ids(split)[index], "index": index}

        def _task_ids(self, split: str) -> list[str]:
            if split != TASK_SPLIT:
                raise IndexError(f"unknown split {split!r}; this env has one split, {TASK_SPLIT!r}")
            return self._env.task_ids()

        def close(self) -> None:
            """OpenEnv calls this synchronously, from a worker thread or from the server's loop."""
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not None:
                # On a loop thread we must not block: finish the close as a task on this loop.
                self._pending_close = running.create_task(self._env.close())
                self._pending_close.add_done_callback(_log_close_failure)
            elif self._loop is not None and self._loop.is_running():
                # The env's resources belong to the server's loop; close them there.
                asyncio.run_coroutine_threadsafe(self._env.close(), self._loop).result(timeout=120)
            else:
                asyncio.run(self._env.close())

    return AgentrlAction, AgentrlObservation, AgentrlState, ServedAgentrlEnv


def _log_close_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log.warning("closing a served env failed: %r", task.exception())


def _run_blocking(coro):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(
        "called the sync OpenEnv method inside an event loop; await reset_async/step_async instead"
    )


# -- using a remote OpenEnv environment as an agentrl Env --------------------------------------


class OpenEnvRemote:
    """A running OpenEnv environment server, used as an agentrl `Env` over its WebSocket.

    Two kinds of server are understood (`protocol="auto"` tells them apart by the action schema):
    - an agentrl env served by `serve_openenv`: actions map field by field and `score()` asks
      the server for its verdict;
    - any other OpenEnv env: the action's payload (`text`, else `command`, else `keystrokes`)
      goes into the remote action field `action_field` (or `action_builder` builds the whole
      dict), observations are rendered as JSON unless they carry a `text` field, and `score()`
      returns the last reward the server reported.

    `message_timeout_s` bounds one reply of the server; a served env's `score` runs the task's
    verifier, so it is an hour by default.
    """

    def __init__(
        self,
        base_url: str,
        *,
        task_ids: list[str] | None = None,
        protocol: Literal["auto", "agentrl", "generic"] = "auto",
        action_field: str = "message",
        action_builder: Callable[[Action], dict[str, Any]] | None = None,
        message_timeout_s: float = 3600.0,
        connect_timeout_s: float = 30.0,
    ):
        if protocol not in ("auto", "agentrl", "generic"):
            raise ValueError(f"OpenEnvRemote: protocol must be auto, agentrl or generic, got {protocol!r}")
        self.base_url = base_url.rstrip("/")
        self._task_ids = list(task_ids) if task_ids is not None else None
        self._protocol = protocol
        self._action_field = action_field
        self._action_builder = action_builder
        self._message_timeout_s = message_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._client: Any = None
        self._state = State()
        self._last_reward: float | None = None

    def __repr__(self) -> str:
        return f"OpenEnvRemote({self.base_url!r}, protocol={self._protocol!r})"

    def task_ids(self) -> list[str]:
        """The ids given to the constructor, else the server's Task API (split 'all')."""
        if self._task_ids is not None:
            return list(self._task_ids)
        import httpx

        try:
            with httpx.Client(base_url=self._http_url, timeout=self._connect_timeout_s) as http:
                names = http.get("/list_environments").raise_for_status().json()
                resp = http.post(f"/{names[0]}/tasks", json={"split": TASK_SPLIT})
                status = resp.status_code
                tasks = None if status in (400, 404, 501) else resp.raise_for_status().json()["tasks"]
        except (httpx.HTTPError, ValueError, LookupError, TypeError) as err:  # unreachable, refused, or not OpenEnv
            raise ValueError(f"OpenEnv server {self.base_url}: cannot list its tasks ({type(err).__name__}: {err}); "
                             "is it running at env.kwargs.base_url?") from None
        if tasks is None:
            raise ValueError(f"OpenEnv server {self.base_url} publishes no task list (HTTP {status}); "
                             "pass task_ids=[...] to OpenEnvRemote (env.kwargs.task_ids)")
        return [t["id"] if isinstance(t, dict) else str(t) for t in tasks]

    async def reset(
        self, task_id: str, *, episode_id: str | None = None, seed: int | None = None
    ) -> Observation:
        if self._protocol == "auto":
            self._protocol = await self._detect_protocol()
        if self._client is None:
            from openenv.core.generic_client import GenericEnvClient

            self._client = GenericEnvClient(
                base_url=self.base_url,
                connect_timeout_s=self._connect_timeout_s,
                message_timeout_s=self._message_timeout_s,
            )
        kwargs: dict[str, Any] = {"task_id": task_id}
        if episode_id is not None:
            kwargs["episode_id"] = episode_id
        if seed is not None:
            kwargs["seed"] = seed
        self._state = State(episode_id=episode_id, step_count=0, task_id=task_id)
        self._last_reward = None
        return await self._exchange("reset", lambda: self._client.reset(**kwargs))

    async def step(self, action: Action) -> Observation:
        if self._client is None:
            raise RuntimeError("OpenEnvRemote.step called before reset()")
        self._state.step_count += 1
        payload = self._payload(action)
        return await self._exchange("step", lambda: self._client.step(payload))

    async def score(self) -> Observation:
        if self._client is None:
            raise RuntimeError("OpenEnvRemote.score called before reset()")
        if self._protocol == "agentrl":
            return await self._exchange("score", lambda: self._client.step({"op": "score"}))
        if self._last_reward is None:
            return Observation(
                text="the remote env reported no reward", done=True, status=f"{_INFRA_PREFIX}verifier"
            )
        return Observation(
            text=f"reward {self._last_reward}", done=True, reward=self._last_reward, status="scored"
        )

    @property
    def state(self) -> State:
        return self._state.model_copy()

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    # -- internals ------------------------------------------------------------------------------

    @property
    def _http_url(self) -> str:
        url = self.base_url
        for ws, http in (("wss://", "https://"), ("ws://", "http://")):
            if url.startswith(ws):
                url = http + url[len(ws) :]
        return url

    async def _detect_protocol(self) -> Literal["agentrl", "generic"]:
        import httpx

        async with httpx.AsyncClient(base_url=self._http_url, timeout=self._connect_timeout_s) as http:
            try:
                resp = await http.get("/schema")
            except httpx.HTTPError as err:
                raise SandboxError(
                    "env_connect", f"OpenEnv server {self.base_url} unreachable: {err}"
                ) from err
        if resp.status_code != 200:
            return "generic"
        return "agentrl" if resp.json().get("action", {}).get("title") == WIRE_ACTION_TITLE else "generic"

    def _payload(self, action: Action) -> dict[str, Any]:
        if self._action_builder is not None:
            return self._action_builder(action)
        if self._protocol == "agentrl":
            return {"op": "step", **action.model_dump(exclude_none=True)}
        return {self._action_field: action.text or action.command or action.keystrokes or ""}

    async def _exchange(self, what: str, call: Callable[[], Any]) -> Observation:
        try:
            result = await call()
        except (TimeoutError, ConnectionError, OSError) as err:
            raise SandboxError("env_connect", f"OpenEnv {what} at {self.base_url} failed: {err}") from err
        except RuntimeError as err:  # the server answered with an error frame
            raise SandboxError("env", f"OpenEnv {what} at {self.base_url}: {err}") from err
        fields = dict(result.observation or {})
        status = fields.pop("status", None)
        metadata = fields.pop("metadata", None) or result.metadata or {}
        if self._protocol == "agentrl":
            text = fields.get("text", "")
        else:
            text = fields["text"] if isinstance(fields.get("text"), str) else json.dumps(fields, default=str)
        if isinstance(status, str) and status.startswith(_INFRA_PREFIX):
            raise SandboxError(status[len(_INFRA_PREFIX) :], f"OpenEnv {what} at {self.base_url}: {text}")
        reward = None if result.reward is None else float(result.reward)
        if reward is not None:
            self._last_reward = reward
        return Observation(text=text, done=bool(result.done), reward=reward, status=status, metadata=metadata)
