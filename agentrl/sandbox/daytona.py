"""Daytona backend: one cloud sandbox per episode, on the SDK's `AsyncDaytona`.

What it guarantees beyond the SDK:
- creates pass a process-wide limiter (concurrency, per-minute, shared throttling pause) and only
  throttling (429 / "rate limit") and capacity errors are retried, with jittered backoff;
- nothing is left behind: every create carries a one-off `agentrl_create` label, so a create
  that timed out, was cancelled or ended in an error state is found and deleted (the SDK's
  `DaytonaTimeoutError.sandbox_id` is used when it has one); sandboxes auto-stop without
  keepalive, are deleted when stopped, and have a hard TTL; `sweep()` removes a run's leftovers;
- commands run as async session commands polled in short calls (field reports: idle exec
  connections dropped after ~240 s), with output capped inside the sandbox and a kill on timeout;
- every failure leaves as `SandboxError(kind=...)`: create, throttled, capacity, image_build,
  auth, exec, io, lost.
The API key comes from $DAYTONA_API_KEY in this process only; it never enters config, reprs,
logs, pickles or error text.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import shlex
import time
import uuid
from typing import TYPE_CHECKING

from agentrl.sandbox.base import ExecResult, SandboxError, SandboxSpec, nul_refusal
from agentrl.sandbox.daytona_exec import (
    CALL_TIMEOUT_S,
    KILL_ALL_EXEC_TIMEOUT_S,
    KILL_ALL_SCRIPT,
    classify_create_error,
    kill_all_result,
    retry_after_s,
    run_command,
)
from agentrl.sandbox.limiter import Backoff, shared_create_limiter

if TYPE_CHECKING:
    from daytona import AsyncDaytona, AsyncSandbox

    from agentrl.config.schema import SandboxConfig

log = logging.getLogger(__name__)

DEFAULT_API_URL = "https://app.daytona.io/api"
RUN_LABEL, CREATE_LABEL = "agentrl_run", "agentrl_create"
STARTED_LABEL = "agentrl_started"  # when the creating provider started (Unix seconds): see sweep_stale
ORPHAN_RECHECK_S = (1.0, 5.0, 30.0)  # a cancelled create may still land server-side: look again
DELETE_TIMEOUT_S = 60.0
SWEEP_PARALLEL_DELETES = 16  # a sweep of hundreds must not become its own 429 storm


class _Secret:
    """Holds the API key; prints as a mask and refuses to be pickled (e.g. into a Ray actor)."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def scrub(self, text: str) -> str:
        return text.replace(self._value, "***") if self._value else text

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("the Daytona API key is never pickled: each process reads $DAYTONA_API_KEY itself")


class DaytonaSandboxProvider:
    """SandboxProvider on Daytona. One per process (or actor); `run_id` labels everything it makes."""

    def __init__(
        self,
        config: SandboxConfig,
        run_id: str,
        *,
        use_polling: bool | None = None,
        orphan_recheck_s: tuple[float, ...] = ORPHAN_RECHECK_S,
    ):
        """`use_polling` forces the SDK's polling mode (no socket.io); None leaves it to
        $DAYTONA_USE_DEPRECATED_POLLING. The stand-in server needs polling."""
        if not run_id:
            raise ValueError("run_id must be a non-empty string: it labels this run's sandboxes for sweeping")
        key = os.environ.get("DAYTONA_API_KEY", "")
        if not key:
            raise SandboxError(
                "auth",
                "DAYTONA_API_KEY is not set: export the Daytona API key in the environment of the process "
                "that creates sandboxes (it is never a config field)",
            )
        self.config = config
        self.run_id = run_id
        self.api_url = config.daytona_api_url or os.environ.get("DAYTONA_API_URL") or DEFAULT_API_URL
        self._key = _Secret(key)
        self._use_polling = use_polling
        self._orphan_recheck_s = orphan_recheck_s
        self._backoff = Backoff(config.retry_backoff_min_s, config.retry_backoff_max_s)
        self._client: AsyncDaytona | None = None
        self._open: set[DaytonaSandbox] = set()
        self._background: set[asyncio.Task] = set()
        self.started_at = int(time.time())
        self.counters: collections.Counter[str] = collections.Counter()

    def __repr__(self) -> str:
        return f"DaytonaSandboxProvider(run_id={self.run_id!r}, api_url={self.api_url!r})"

    # ---- client and helpers -----------------------------------------------------------------
    def _sdk(self) -> AsyncDaytona:
        if self._client is None:  # built inside the running loop: the SDK's HTTP session needs one
            from daytona import AsyncDaytona, DaytonaConfig

            cfg = DaytonaConfig(
                api_key=self._key.reveal(),
                api_url=self.api_url,
                target=self.config.daytona_target,
                use_deprecated_polling=self._use_polling,
            )
            self._client = AsyncDaytona(cfg)
        return self._client

    def _error(
        self, kind: str, what: str, exc: BaseException | None = None, *, retryable: bool = False
    ) -> SandboxError:
        detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        self.counters[f"error_{kind}"] += 1
        return SandboxError(kind, self._key.scrub(f"{what}{detail}"), retryable=retryable)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _params(self, spec: SandboxSpec, tag: str):
        from daytona import CreateSandboxFromImageParams, Resources

        if not spec.image:
            raise ValueError("SandboxSpec.image is required by the Daytona backend (the task's docker_image)")
        reserved = {RUN_LABEL, CREATE_LABEL, STARTED_LABEL} & set(spec.labels)
        if reserved:
            raise ValueError(f"SandboxSpec.labels must not set {sorted(reserved)}: the provider owns them")
        c = self.config
        labels = {
            "task": "unknown",
            "episode": "unknown",
            **spec.labels,
            RUN_LABEL: self.run_id,
            CREATE_LABEL: tag,
            STARTED_LABEL: str(self.started_at),
        }
        return CreateSandboxFromImageParams(
            image=spec.image,
            resources=Resources(
                cpu=max(c.min_cpus, math.ceil(spec.cpus)),
                memory=math.ceil(max(c.min_memory_mb, spec.memory_mb) / 1024),  # the API counts GiB
                disk=math.ceil(max(c.min_disk_mb, spec.disk_mb) / 1024),
            ),
            labels=labels,
            env_vars=dict(spec.env) or None,
            # Without keepalive (our process died) the sandbox stops after 3 missed beats, and a
            # stopped sandbox is deleted at once; the TTL caps its life whatever happens.
            auto_stop_interval=max(15, math.ceil(3 * c.keepalive_s / 60)),
            auto_delete_interval=0,
            ttl_minutes=c.auto_delete_minutes,
            network_block_all=not spec.allow_network,
        )

    # ---- create -----------------------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> DaytonaSandbox:
        c = self.config
        limiter = shared_create_limiter(self.api_url, c.max_concurrent_creates, c.creates_per_minute)
        self._params(spec, "check")  # bad input fails before any API call
        for attempt in range(c.max_create_attempts):
            tag = uuid.uuid4().hex
            self.counters["create_attempts"] += 1
            try:
                async with limiter.slot():
                    sdk_sb = await self._create_once(self._params(spec, tag), tag)
            except _Retry as r:
                self.counters[f"create_{r.kind}"] += 1
                if attempt + 1 == c.max_create_attempts:
                    raise self._error(
                        r.kind,
                        f"sandbox create gave up after {attempt + 1} attempts",
                        r.cause,
                        retryable=True,
                    ) from None
                delay = self._backoff.delay(attempt, retry_after_s=r.retry_after)
                limiter.pause(delay)  # the quota is shared: hold back every create, not only this one
                log.info("sandbox create %s (attempt %d), retrying in %.1fs", r.kind, attempt + 1, delay)
                await asyncio.sleep(delay)
                continue
            self.counters["creates_ok"] += 1
            sandbox = DaytonaSandbox(sdk_sb, self, spec)
            self._open.add(sandbox)
            return sandbox
        raise AssertionError("unreachable: the loop returns or raises")

    async def _create_once(self, params, tag: str) -> AsyncSandbox:
        from daytona import DaytonaTimeoutError

        try:
            return await self._sdk().create(params, timeout=self.config.create_timeout_s)
        except asyncio.CancelledError:
            self._spawn(self._reap(tag, None))  # the server may finish the create after we left
            raise
        except DaytonaTimeoutError as e:
            self._spawn(self._reap(tag, getattr(e, "sandbox_id", None)))
            raise self._error(
                "create", f"sandbox create timed out after {self.config.create_timeout_s}s", e, retryable=True
            ) from None
        except Exception as e:  # noqa: BLE001 - any SDK error is classified into a SandboxError or logged here
            kind = classify_create_error(e)
            if kind in ("throttled", "capacity"):
                raise _Retry(kind, e, retry_after_s(e)) from None
            self._spawn(self._reap(tag, None))  # an error state leaves a sandbox behind
            raise self._error(
                kind, f"sandbox create failed ({kind})", e, retryable=kind == "create"
            ) from None

    async def _reap(self, tag: str, sandbox_id: str | None) -> int:
        """Delete what a failed create `tag` left behind; look again a few times, since a
        cancelled create may still be landing."""
        from daytona import ListSandboxesQuery

        found = 0
        try:
            if sandbox_id:
                found += await self._delete_by_id(sandbox_id)
            for delay in (0.0, *self._orphan_recheck_s):
                if found:
                    break
                await asyncio.sleep(delay)
                async for sb in self._sdk().list(ListSandboxesQuery(labels={CREATE_LABEL: tag})):
                    found += await self._delete(sb)
        except Exception as e:  # noqa: BLE001 - any SDK error is classified into a SandboxError or logged here
            log.warning("orphan reaper for create %s failed: %s", tag, self._key.scrub(str(e)))
        self.counters["orphans_deleted"] += found
        return found

    # ---- delete, sweep, shutdown ------------------------------------------------------------
    async def _delete(self, sdk_sb: AsyncSandbox) -> int:
        """1 when deleted, 0 when it was already gone. Failures are logged, never raised."""
        from daytona import DaytonaNotFoundError

        try:
            await sdk_sb.delete(timeout=DELETE_TIMEOUT_S)
        except DaytonaNotFoundError:
            return 0
        except Exception as e:  # noqa: BLE001 - any SDK error is classified into a SandboxError or logged here
            self.counters["delete_failed"] += 1
            log.warning(
                "deleting sandbox %s failed (sweep will retry): %s", sdk_sb.id, self._key.scrub(str(e))
            )
            return 0
        self.counters["deleted"] += 1
        return 1

    async def _delete_by_id(self, sandbox_id: str) -> int:
        from daytona import DaytonaNotFoundError

        try:
            sdk_sb = await self._sdk().get(sandbox_id, request_timeout=CALL_TIMEOUT_S)
        except DaytonaNotFoundError:
            return 0
        return await self._delete(sdk_sb)

    async def sweep(self) -> int:
        """Delete every sandbox labelled with this run id (call at run end: it also removes
        sandboxes other workers of the run still use; sweep_stale is the one for run start)."""
        return await self._delete_all(await self._run_sandboxes(), "swept")

    async def sweep_stale(self) -> int:
        """At run start: delete the sandboxes an earlier, killed attempt of this run left behind.
        The rule: a sandbox labelled with this run id whose STARTED_LABEL (the Unix second its
        creating provider started; missing on sandboxes of older agentrl versions) is before this
        provider's start. Providers of the live attempt start after the one that sweeps, so their
        sandboxes are never taken, and sandboxes of other runs are never touched (a run that is
        never resumed loses its sandboxes to Daytona itself: without keepalive they auto-stop
        after 3 missed beats and are deleted when stopped, see `_params`)."""

        def stale(sb) -> bool:
            try:
                return int((sb.labels or {}).get(STARTED_LABEL, "")) < self.started_at
            except ValueError:
                return True

        return await self._delete_all([sb for sb in await self._run_sandboxes() if stale(sb)], "swept_stale")

    async def _run_sandboxes(self) -> list:
        from daytona import ListSandboxesQuery

        try:
            return [sb async for sb in self._sdk().list(ListSandboxesQuery(labels={RUN_LABEL: self.run_id}))]
        except Exception as e:  # noqa: BLE001 - any SDK error is classified into a SandboxError or logged here
            raise self._error(
                "sweep", f"listing sandboxes of run {self.run_id} failed", e, retryable=True
            ) from None

    async def _delete_all(self, found: list, counter: str) -> int:
        gate = asyncio.Semaphore(SWEEP_PARALLEL_DELETES)

        async def delete(sb: AsyncSandbox) -> int:
            async with gate:
                return await self._delete(sb)

        n = sum(await asyncio.gather(*(delete(sb) for sb in found)))
        self.counters[counter] += n
        if n:
            log.info("%s: deleted %d sandbox(es) of run %s", counter, n, self.run_id)
        return n

    async def aclose(self) -> None:
        """Close this provider's open sandboxes, finish reapers and deletes, close the client."""
        await asyncio.gather(*(sb.close() for sb in list(self._open)), return_exceptions=True)
        if self._background:
            _, pending = await asyncio.wait(set(self._background), timeout=DELETE_TIMEOUT_S)
            for t in pending:
                t.cancel()
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    def stats(self) -> dict[str, float]:
        return {**self.counters, "open_sandboxes": len(self._open)}


class _Retry(Exception):
    def __init__(self, kind: str, cause: BaseException, retry_after: float | None):
        super().__init__(kind)
        self.kind, self.cause, self.retry_after = kind, cause, retry_after


class DaytonaSandbox:
    """One open Daytona sandbox. `close()` deletes it."""

    def __init__(self, sdk_sb: AsyncSandbox, provider: DaytonaSandboxProvider, spec: SandboxSpec):
        self.id: str = sdk_sb.id
        self._sdk = sdk_sb
        self._p = provider
        self._workdir = spec.workdir
        self._closed = False
        self._lost: str | None = None
        self._keepalive = asyncio.get_running_loop().create_task(self._keep_alive())

    def __repr__(self) -> str:
        return f"DaytonaSandbox(id={self.id!r}, closed={self._closed})"

    def _check_usable(self, op: str) -> None:
        if self._closed:
            raise SandboxError("closed", f"{op} on closed sandbox {self.id}")
        if self._lost:
            raise self._p._error("lost", f"{op}: sandbox {self.id} is gone ({self._lost})")

    async def _keep_alive(self) -> None:
        from daytona import DaytonaNotFoundError

        while True:
            await asyncio.sleep(self._p.config.keepalive_s)
            try:
                await self._sdk.refresh_activity(request_timeout=CALL_TIMEOUT_S)
                self._p.counters["keepalives"] += 1
            except DaytonaNotFoundError:
                self._lost = "deleted while open (keepalive got 404)"
                return
            except Exception as e:  # noqa: BLE001 - a missed beat is tolerated: auto-stop allows three
                self._p.counters["keepalive_failed"] += 1
                log.warning("keepalive of sandbox %s failed: %s", self.id, self._p._key.scrub(str(e)))

    async def _failure(self, op: str, exc: BaseException, kind: str) -> SandboxError:
        """`lost` when the sandbox itself is gone or not running, else `kind`."""
        from daytona import DaytonaNotFoundError

        try:
            await self._sdk.refresh_data(request_timeout=CALL_TIMEOUT_S)
            state = str(getattr(self._sdk.state, "value", self._sdk.state))
            if state != "started":
                self._lost = f"state {state}, reason {self._sdk.error_reason}"
        except DaytonaNotFoundError:
            self._lost = "not found"
        except Exception as probe:  # noqa: BLE001 - any SDK error is classified into a SandboxError or logged here
            self._lost = f"unreachable ({type(probe).__name__})"
        if self._lost:
            return self._p._error("lost", f"{op} failed: sandbox {self.id} is gone ({self._lost})", exc)
        return self._p._error(kind, f"{op} failed in sandbox {self.id}", exc)

    async def exec(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 60.0,
        max_output_bytes: int = 1 << 20,
    ) -> ExecResult:
        self._check_usable("exec")
        refused = nul_refusal(command, env)
        if refused is not None:
            return refused
        try:
            return await run_command(
                self._sdk.process,
                command,
                cwd=cwd if cwd is not None else self._workdir,
                env=env or {},
                timeout_s=timeout_s,
                max_output_bytes=max_output_bytes,
            )
        except (ValueError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - any SDK error is classified into a SandboxError or logged here
            raise await self._failure("exec", e, "exec") from None

    async def upload(self, data: bytes, path: str) -> None:
        self._check_usable("upload")
        try:
            await self._sdk.fs.upload_file(data, path, timeout=int(CALL_TIMEOUT_S * 10))
        except Exception as e:  # noqa: BLE001 - any SDK error is classified into a SandboxError or logged here
            raise await self._failure(f"upload to {path}", e, "io") from None

    async def download(self, path: str) -> bytes:
        """The file's bytes. A missing file in a healthy sandbox raises FileNotFoundError."""
        from daytona import DaytonaNotFoundError

        self._check_usable("download")
        try:
            return await self._sdk.fs.download_file(path, int(CALL_TIMEOUT_S * 10))
        except Exception as e:  # noqa: BLE001 - any SDK error is classified into a SandboxError or logged here
            err = await self._failure(f"download of {path}", e, "io")
            if err.kind != "lost" and isinstance(e, DaytonaNotFoundError):
                raise FileNotFoundError(f"{path} does not exist in sandbox {self.id}") from None
            raise err from None

    async def kill_all(self) -> int:
        """Sandbox protocol: KILL_ALL_SCRIPT through the SDK's process exec (one short call, not a
        session: the session's own shell would be one of the processes it ends)."""
        self._check_usable("kill_all")
        try:
            resp = await self._sdk.process.exec(
                "sh -c " + shlex.quote(KILL_ALL_SCRIPT), timeout=KILL_ALL_EXEC_TIMEOUT_S
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any SDK error is classified into a SandboxError or logged here
            raise await self._failure("kill_all", e, "kill") from None
        return kill_all_result(resp.exit_code, resp.result, self.id)

    async def close(self) -> None:
        """Delete the sandbox. Idempotent; never raises (a failed delete is logged and left to
        `sweep`). The delete runs shielded, so cancelling the caller does not leak it."""
        if self._closed:
            return
        self._closed = True
        self._keepalive.cancel()
        self._p._open.discard(self)
        await asyncio.shield(self._p._spawn(self._p._delete(self._sdk)))
