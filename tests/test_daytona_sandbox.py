"""Daytona backend: the real `daytona` SDK against the local stand-in server (no cloud)."""

from __future__ import annotations

import asyncio
import logging
import pickle
import time

import pytest

from agentrl.config.schema import SandboxConfig
from agentrl.sandbox.base import Sandbox, SandboxError, SandboxProvider, SandboxSpec
from agentrl.sandbox.daytona import DaytonaSandboxProvider
from agentrl.sandbox.daytona_exec import wrap_command
from tests.doubles.daytona_standin import start_standin

KEY = "sk-dtn-TEST-5f3a9c1e7b2d4e6f8a0b"  # planted; must never show up anywhere
SPEC = SandboxSpec(image="ubuntu:22.04", workdir=".", labels={"task": "t1", "episode": "e1"})


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setenv("DAYTONA_API_KEY", KEY)
    monkeypatch.setenv("DAYTONA_USE_DEPRECATED_POLLING", "true")  # the stand-in has no socket.io
    handles = []

    def start(**faults):
        url, handle = start_standin(api_key=KEY, **faults)
        handles.append(handle)
        return url, handle

    yield start
    for h in handles:
        h.stop()


@pytest.fixture
async def make_provider():
    providers = []

    def make(url: str, run_id: str = "run-a", **cfg) -> DaytonaSandboxProvider:
        base = {"daytona_api_url": url, "retry_backoff_min_s": 0.01, "retry_backoff_max_s": 0.05}
        p = DaytonaSandboxProvider(
            SandboxConfig(backend="daytona", **{**base, **cfg}), run_id, orphan_recheck_s=(0.3, 1.0)
        )
        providers.append(p)
        return p

    yield make
    for p in providers:
        await p.aclose()


async def test_happy_path_create_exec_files_close(standin, make_provider):
    url, h = standin()
    p = make_provider(url)
    assert isinstance(p, SandboxProvider)
    sb = await p.create(
        SandboxSpec(
            image="ubuntu:22.04",
            workdir=".",
            cpus=0.5,
            memory_mb=512,
            disk_mb=100,
            env={"GREETING": "hello"},
            labels={"task": "t1", "episode": "e7"},
        )
    )
    assert isinstance(sb, Sandbox)
    body = h.create_body(sb.id)
    assert (body["cpu"], body["memory"], body["disk"]) == (1, 2, 10)  # floored at 1 CPU / 2 GiB / 10 GiB
    assert {"agentrl_run": "run-a", "task": "t1", "episode": "e7"}.items() <= body["labels"].items()
    assert body["networkBlockAll"] is True and body["autoDeleteInterval"] == 0
    assert body["ttlMinutes"] == 240 and body["autoStopInterval"] >= 15
    assert "FROM ubuntu:22.04" in body["buildInfo"]["dockerfileContent"]

    r = await sb.exec('echo "$GREETING $X"; echo oops >&2; exit 3', env={"X": "w o'rld"})
    assert (r.exit_code, r.output, r.timed_out, r.truncated) == (3, "hello w o'rld\noops\n", False, False)
    await sb.exec("mkdir -p sub")
    assert (await sb.exec("pwd", cwd="sub")).output.strip().endswith("/sub")

    payload = bytes(range(256)) * 10
    await sb.upload(payload, "data/blob.bin")
    assert await sb.download("data/blob.bin") == payload
    assert (await sb.exec("wc -c < data/blob.bin")).output.strip() == "2560"
    with pytest.raises(FileNotFoundError):
        await sb.download("no/such/file")

    await sb.close()
    await sb.close()  # idempotent
    assert h.deleted == [sb.id] and h.live() == []
    with pytest.raises(SandboxError) as ei:
        await sb.exec("true")
    assert ei.value.kind == "closed"
    assert h.unknown_routes == []
    assert p.stats()["creates_ok"] == 1 and p.stats()["open_sandboxes"] == 0


async def test_exec_timeout_kills_command_and_output_is_capped(standin, make_provider):
    url, h = standin()
    sb = await make_provider(url).create(SPEC)
    t0 = time.monotonic()
    r = await sb.exec("echo started; sleep 1.6; touch marker", timeout_s=1)
    assert r.timed_out and r.exit_code == -1 and r.output == "started\n"  # output so far is kept
    assert time.monotonic() - t0 < 2.4
    await asyncio.sleep(1.8 - (time.monotonic() - t0))
    assert (await sb.exec("test -e marker")).exit_code == 1  # the command was killed, not left running

    r = await sb.exec("head -c 5000 /dev/zero | tr '\\0' a; exit 7", max_output_bytes=100)
    assert (r.exit_code, r.output, r.truncated) == (7, "a" * 100, True)
    # polling is short calls only: several GETs for one command, none holding the connection
    polls = [c for c in h.calls if c[0] == "GET" and "/command/" in c[1] and not c[1].endswith("/logs")]
    assert len(polls) >= 3


async def test_throttle_storm_is_retried_with_backoff_and_counted(standin, make_provider):
    url, h = standin(throttle_creates=5, retry_after_s=0.02)
    p = make_provider(url)
    sb = await p.create(SPEC)
    assert h.throttled_sent == 5 and h.creates_received == 6
    assert p.counters["create_throttled"] == 5 and p.counters["creates_ok"] == 1
    await sb.close()


async def test_throttling_gives_up_after_max_attempts(standin, make_provider):
    url, h = standin(throttle_creates=100)
    p = make_provider(url, max_create_attempts=3)
    with pytest.raises(SandboxError) as ei:
        await p.create(SPEC)
    assert ei.value.kind == "throttled" and ei.value.retryable
    assert h.creates_received == 3 and h.live() == []


async def test_capacity_errors_are_retried(standin, make_provider):
    url, h = standin(capacity_errors=2)
    p = make_provider(url)
    await p.create(SPEC)
    assert h.capacity_sent == 2 and p.counters["create_capacity"] == 2


async def test_twenty_concurrent_creates_respect_the_process_wide_limit(standin, make_provider):
    url, h = standin(start_delay_s=0.15)  # slow creates: each stays 'starting' and is polled
    a, b = (
        make_provider(url, "run-a", max_concurrent_creates=3),
        make_provider(url, "run-b", max_concurrent_creates=3),
    )
    boxes = await asyncio.gather(*(p.create(SPEC) for p in [a, b] * 10))
    assert len({s.id for s in boxes}) == 20
    assert 2 <= h.max_concurrent_creates <= 3  # two providers, one limit: it is shared
    assert any(c[0] == "GET" and c[1].startswith("/api/sandbox/") for c in h.calls)  # waited for 'started'
    await asyncio.gather(*(s.close() for s in boxes))
    assert h.live() == [] and sorted(h.deleted) == sorted(s.id for s in boxes)


async def test_create_timeout_with_sandbox_id_deletes_the_orphan(standin, make_provider):
    url, h = standin(start_delay_s=30)
    p = make_provider(url, create_timeout_s=1)
    with pytest.raises(SandboxError) as ei:
        await p.create(SPEC)
    assert ei.value.kind == "create" and "timed out" in str(ei.value)
    await p.aclose()  # waits for the reaper
    assert h.creates_received == 1  # a timeout is not retried here: the caller decides
    assert len(h.created) == 1 and h.deleted == h.created and h.live() == []
    assert p.counters["orphans_deleted"] == 1


async def test_create_timeout_before_the_answer_still_reaps_by_label(standin, make_provider):
    url, h = standin(create_delay_s=1.5)  # the sandbox exists, the POST answers too late
    p = make_provider(url, create_timeout_s=1)
    with pytest.raises(SandboxError):
        await p.create(SPEC)
    await p.aclose()
    assert len(h.created) == 1 and h.live() == []


async def test_cancelled_create_leaves_no_orphan(standin, make_provider):
    url, h = standin(start_delay_s=30)
    p = make_provider(url)
    task = asyncio.ensure_future(p.create(SPEC))
    while not h.created:
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await p.aclose()
    assert h.live() == [] and h.deleted == h.created


async def test_image_build_failure_is_not_retried(standin, make_provider):
    url, h = standin(fail_build_images=("bad/image:1",))
    p = make_provider(url)
    with pytest.raises(SandboxError) as ei:
        await p.create(SandboxSpec(image="bad/image:1", workdir="."))
    assert ei.value.kind == "image_build" and not ei.value.retryable
    assert "manifest unknown" in str(ei.value)  # the reason reaches the caller for quarantine
    await p.aclose()
    assert h.creates_received == 1 and h.live() == []  # one attempt, and its failed sandbox deleted


async def test_sandbox_dying_mid_exec_is_lost(standin, make_provider):
    url, h = standin(die_on_exec=2, die_delay_s=0.2)
    sb = await make_provider(url).create(SPEC)
    assert (await sb.exec("echo fine")).exit_code == 0
    with pytest.raises(SandboxError) as ei:
        await sb.exec("sleep 5", timeout_s=10)
    assert ei.value.kind == "lost"
    with pytest.raises(SandboxError) as ei:
        await sb.upload(b"x", "x")
    assert ei.value.kind == "lost"
    await sb.close()  # never raises, and still deletes what is left
    assert h.live() == []


async def test_exec_failure_in_a_healthy_sandbox_is_exec(standin, make_provider):
    url, _h = standin(exec_errors=1)
    sb = await make_provider(url).create(SPEC)
    with pytest.raises(SandboxError) as ei:
        await sb.exec("echo hi")
    assert ei.value.kind == "exec"
    assert (await sb.exec("echo hi")).output == "hi\n"  # the sandbox is fine


async def test_sweep_deletes_only_this_runs_sandboxes(standin, make_provider):
    url, h = standin()
    mine = [h.plant({"agentrl_run": "run-a", "task": "t"}) for _ in range(2)]
    other = h.plant({"agentrl_run": "run-b"})
    unlabelled = h.plant({})
    p = make_provider(url, "run-a")
    live = await p.create(SPEC)
    assert await p.sweep() == 3
    assert sorted(h.live()) == sorted([other, unlabelled])
    assert set(mine) | {live.id} <= set(h.deleted)
    assert await p.sweep() == 0


async def test_keepalive_refreshes_activity_while_open(standin, make_provider):
    url, h = standin()
    sb = await make_provider(url, keepalive_s=0.1).create(SPEC)
    await asyncio.sleep(0.45)
    assert h.activity_refreshes >= 2
    await sb.close()
    n = h.activity_refreshes
    await asyncio.sleep(0.25)
    assert h.activity_refreshes == n  # stops with the sandbox


async def test_secret_never_leaks(standin, make_provider, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    url, _h = standin(exec_errors=1)
    p = make_provider(url)
    sb = await p.create(SPEC)
    texts = [repr(p), str(p), repr(sb), p.config.model_dump_json(), repr(p.stats())]
    with pytest.raises(SandboxError) as ei:
        await sb.exec("echo hi")
    texts.append(str(ei.value))
    with pytest.raises(TypeError) as pe:
        pickle.dumps(p)  # never shipped to another process with the key inside
    texts.append(str(pe.value))
    # a rejected key: the auth error names the problem, not the key
    url2, h2 = standin()
    h2.faults.api_key = "something-else"
    with pytest.raises(SandboxError) as ei2:
        await make_provider(url2).create(SPEC)
    assert ei2.value.kind == "auth"
    texts.append(str(ei2.value))
    await sb.close()
    await asyncio.sleep(0.1)  # let the reaper of the rejected create try, and log, with the bad key
    assert "orphan reaper" in caplog.text  # the failure was logged (so the check below means something)
    texts.append(caplog.text)
    assert all(KEY not in t for t in texts)
    monkeypatch.delenv("DAYTONA_API_KEY")
    with pytest.raises(SandboxError, match="DAYTONA_API_KEY is not set") as ei3:
        DaytonaSandboxProvider(SandboxConfig(daytona_api_url=url), "run-a")
    assert ei3.value.kind == "auth"


def test_bad_input_is_rejected_with_the_field_named(monkeypatch):
    monkeypatch.setenv("DAYTONA_API_KEY", KEY)
    p = DaytonaSandboxProvider(SandboxConfig(), "run-a")
    with pytest.raises(ValueError, match="SandboxSpec.image"):
        p._params(SandboxSpec(image=None), "t")
    with pytest.raises(ValueError, match="agentrl_run"):
        p._params(SandboxSpec(image="x", labels={"agentrl_run": "other"}), "t")
    with pytest.raises(ValueError, match="shell identifiers"):
        wrap_command("true", None, {"BAD-NAME": "1"}, 10, 1.0)
    with pytest.raises(ValueError, match="run_id"):
        DaytonaSandboxProvider(SandboxConfig(), "")


async def test_sweep_stale_deletes_only_what_an_earlier_attempt_of_the_run_left(standin, make_provider):
    url, h = standin()
    p = make_provider(url, "run-a")
    old = str(p.started_at - 3600)
    leftovers = [h.plant({"agentrl_run": "run-a", "agentrl_started": old}), h.plant({"agentrl_run": "run-a"})]
    other_run = h.plant({"agentrl_run": "run-b", "agentrl_started": old})
    live_peer = h.plant({"agentrl_run": "run-a", "agentrl_started": str(p.started_at + 5)})  # a later worker's
    mine = await p.create(SPEC)
    assert h.labels_of(mine.id)["agentrl_started"] == str(p.started_at)
    assert await p.sweep_stale() == 2
    assert set(leftovers) <= set(h.deleted)
    assert sorted(h.live()) == sorted([other_run, live_peer, mine.id])
    assert await p.sweep_stale() == 0
