"""Session affinity: consistent hashing unit checks and a restart of a real embedded engine."""

from __future__ import annotations

import pytest
import torch

from agentrl.rollout.router import HashRing, Router
from agentrl.rollout.types import SamplingParams

SESSIONS = [f"episode-{i}" for i in range(2000)]


def test_ring_is_sticky_and_balanced():
    ring = HashRing(["a", "b", "c", "d"], virtual_nodes=64)
    first = {s: ring.lookup(s) for s in SESSIONS}
    assert first == {s: HashRing(["d", "c", "b", "a"]).lookup(s) for s in SESSIONS}  # order-free
    shares = {n: list(first.values()).count(n) / len(SESSIONS) for n in "abcd"}
    assert all(0.15 < v < 0.35 for v in shares.values()), shares


def test_only_the_leaving_engines_sessions_move():
    ring = HashRing(["a", "b", "c", "d"])
    before = {s: ring.lookup(s) for s in SESSIONS}
    down = {s: ring.lookup(s, skip={"b"}) for s in SESSIONS}
    assert all(down[s] == before[s] for s in SESSIONS if before[s] != "b")
    assert all(down[s] != "b" for s in SESSIONS)
    ring.remove("b")
    assert {s: ring.lookup(s) for s in SESSIONS} == down  # removal == skipping
    ring.add("b")
    assert {s: ring.lookup(s) for s in SESSIONS} == before  # and it comes back exactly


def test_adding_an_engine_moves_only_sessions_to_it():
    ring = HashRing(["a", "b", "c"])
    before = {s: ring.lookup(s) for s in SESSIONS}
    ring.add("d")
    after = {s: ring.lookup(s) for s in SESSIONS}
    moved = [s for s in SESSIONS if after[s] != before[s]]
    assert moved and all(after[s] == "d" for s in moved)
    assert 0.1 < len(moved) / len(SESSIONS) < 0.4


def test_bad_configuration_is_rejected():
    with pytest.raises(ValueError, match="at least one"):
        Router([])
    with pytest.raises(ValueError, match="duplicate"):
        Router(["http://x:1", "http://x:1"])
    with pytest.raises(LookupError, match="every engine is down"):
        HashRing(["a"]).lookup("s", skip={"a"})


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


async def test_affinity_holds_through_an_engine_restart():
    from agentrl.rollout.embedded.server import EmbeddedEngineServer

    model = _tiny_llama()
    servers = [EmbeddedEngineServer(model) for _ in range(3)]
    urls = [await s.start() for s in servers]
    router = Router(urls, timeout_s=30)
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    # at least 12 sessions, and enough that every engine is some session's home: the engines' ports
    # are random, so 12 fixed names fell on only two of them now and then (1 run in ~50)
    sessions: list[str] = []
    while len(sessions) < 200 and (len(sessions) < 12 or len({router.engine_for(s) for s in sessions}) < 3):
        sessions.append(f"ep-{len(sessions)}")
    prompts = {s: [i % 200 + 1] * 6 for i, s in enumerate(sessions)}
    try:
        home = {s: router.engine_for(s) for s in sessions}
        assert len(set(home.values())) == 3
        for s in sessions:  # turn 1
            r = await router.generate(prompts[s], sp, session_id=s)
            prompts[s] += r.output_ids + [7]
        victim = urls[1]
        await servers[1].stop()
        moved = set()
        for s in sessions:  # turn 2: the victim refuses connections
            r = await router.generate(prompts[s], sp, session_id=s)
            prompts[s] += r.output_ids + [7]
            if home[s] == victim:
                moved.add(s)
                assert r.cached_tokens == 0  # a new engine: no KV of this session there
            else:
                assert r.cached_tokens > 0  # same engine as turn 1: its KV was reused
        assert router.down == {victim} and moved
        assert all(router.engine_for(s) == home[s] for s in sessions if s not in moved)
        port = int(victim.rsplit(":", 1)[1])
        servers[1] = EmbeddedEngineServer(model)  # the engine restarts on its old address
        assert await servers[1].start(port=port) == victim
        assert await router.refresh() == set()
        assert {s: router.engine_for(s) for s in sessions} == home
        for s in moved:
            await router.generate(prompts[s], sp, session_id=s)
        assert servers[1].scheduler.stats()["requests_done"] == len(moved)
    finally:
        await router.aclose()
        for s in servers:
            await s.stop()
