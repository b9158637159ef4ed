"""EngineGroup on a local Ray: embedded engines started through the engine actor (engine_argv, the
embedded CLI), found dead by pid and restarted; a two-node engine on a simulated two-node cluster
comes up with its node ranks and one dist-init address. All slow: every engine is a process that
imports torch and loads a model (~7 s each on the 2-core machine)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest

from agentrl.cluster.ray_env import INFER_RESOURCE, TRAIN_RESOURCE
from agentrl.config.loader import load_config
from agentrl.config.plan import EngineSpec, resolve_plan
from agentrl.rollout.client import EngineClient
from agentrl.rollout.types import SamplingParams
from tests.proc_util import running

pytestmark = pytest.mark.slow
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def config(*sets: str):
    return load_config("local", ["rollout.embedded.base_port=0", "rollout.engine_start_timeout_s=120",
                                 "rollout.embedded.torch_threads=1", *sets])


async def generates(url: str) -> bool:
    async with EngineClient(url, timeout_s=60) as c:
        r = await c.generate([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0), session_id="t")
        return len(r.output_ids) == 3


async def wait_dead(group, i: int, node_rank: int = 0) -> None:
    for _ in range(200):
        if not await group.actors[i][node_rank].alive.remote():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine {i} node {node_rank} did not die")


@pytest.fixture
def local_ray(monkeypatch):
    import ray

    for k, v in RAY_ENV.items():
        monkeypatch.setenv(k, v)
    ray.init(address="local", num_cpus=2, resources={TRAIN_RESOURCE: 1000, INFER_RESOURCE: 1000},
             include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


async def test_two_engines_start_serve_and_one_killed_is_restarted(local_ray, tmp_path):
    from agentrl.cluster.engines import EngineGroup

    ray = local_ray
    cfg = config("rollout.embedded.num_engines=2")
    plan = resolve_plan(cfg, check_runnable=False)
    group = EngineGroup(cfg, plan, tmp_path, "grp")
    try:
        urls = await group.start()
        assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
        assert all(await asyncio.gather(*(generates(u) for u in urls)))
        actor = ray.get_actor("grp-engine-1-node0")
        node_ip = ray.nodes()[0]["NodeManagerAddress"]  # Ray's address of the node, as the dashboard shows it
        assert await actor.__ray_call__.remote(lambda self: repr(self)) == f"engine 1 node_rank 0 on {node_ip}"
        assert await group.check() == []
        old = await group.pid(1)
        os.kill(old, signal.SIGKILL)
        await wait_dead(group, 1)
        downs = []

        async def on_down(i: int) -> None:
            downs.append(i)

        assert await group.check(on_down=on_down) == [1] and downs == [1]
        assert await group.pid(1) != old and group.url(1) == urls[1]  # same URL: the router's identity
        assert await generates(urls[1]) and await generates(urls[0])
        assert group.restarts == [0, 1]
        assert (tmp_path / "logs" / "engine_1_node0.log").read_text().count("start: ") == 2
        info = await group.server_info(0)
        assert info["engine"] == "agentrl-embedded" and info["device"] == "cpu"
        # The actor itself dies (its node process is lost): its engine goes with it (parent-death
        # signal), and check() replaces the actor in the same slot, on the same port.
        pid0 = await group.pid(0)
        ray.kill(group.actors[0][0])
        for _ in range(200):
            if not running(pid0):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the engine outlived its actor")
        assert await group.check() == [0]
        assert group.url(0) == urls[0] and await generates(urls[0])
    finally:
        await group.stop()


async def test_restarts_stop_at_the_limit(local_ray, tmp_path):
    from agentrl.cluster.engines import EngineGroup, EngineGroupError

    cfg = config("rollout.embedded.num_engines=1", "rollout.engine_max_restarts=0")
    group = EngineGroup(cfg, resolve_plan(cfg, check_runnable=False), tmp_path, "lim")
    try:
        await group.start()
        os.kill(await group.pid(0), signal.SIGKILL)
        await wait_dead(group, 0)
        with pytest.raises(EngineGroupError, match=r"engine 0 died 1 times.*engine_max_restarts=0.*engine_0_node0.log"):
            await group.check()
    finally:
        await group.stop()


async def test_two_node_engine_on_two_simulated_nodes(monkeypatch, tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    from agentrl.cluster.engines import EngineGroup

    for k, v in RAY_ENV.items():
        monkeypatch.setenv(k, v)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {INFER_RESOURCE: 1000}, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={INFER_RESOURCE: 1000})
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cfg = config("rollout.embedded.num_engines=1")
    plan = resolve_plan(cfg, check_runnable=False)
    plan = dataclasses.replace(plan, engines=[EngineSpec(0, "embedded", [0, 1], 0.0, 0, "tiny")])
    group = EngineGroup(cfg, plan, tmp_path, "two")
    try:
        (url,) = await group.start()
        assert await generates(url)
        nodes = await asyncio.gather(*(a.node_id.remote() for a in group.actors[0]))
        assert nodes[0] != nodes[1]  # STRICT_SPREAD: one Ray node each
        node0, node1 = await group.commands(0)
        addr = node0[node0.index("--dist-init-addr") + 1]
        assert addr.startswith(await group.actors[0][0].node_ip.remote() + ":")  # on node 0
        assert node1[node1.index("--dist-init-addr") + 1] == addr
        assert node0[node0.index("--node-rank") + 1] == "0" and node1[node1.index("--node-rank") + 1] == "1"
        assert node0[node0.index("--nnodes") + 1] == node1[node1.index("--nnodes") + 1] == "2"
        pids = await asyncio.gather(*(a.pid.remote() for a in group.actors[0]))
        os.kill(pids[1], signal.SIGKILL)  # node 1 dies: the engine restarts whole
        await wait_dead(group, 0, node_rank=1)
        assert await group.check() == [0]
        new = await asyncio.gather(*(a.pid.remote() for a in group.actors[0]))
        assert new[0] != pids[0] and new[1] != pids[1] and group.url(0) == url
        assert await generates(url)
    finally:
        await group.stop()
        ray.shutdown()
        cluster.shutdown()
