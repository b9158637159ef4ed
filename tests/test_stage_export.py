"""Per-stage export for weight updates (agentrl.train.megatron_export.StageExport) on gloo ranks:
each stage's sender gets exactly its stage's HF tensors (per-expert checkpoint names, global layer
numbers, the MTP layer on the last stage), bitwise equal to the HF weights the model was built
from, in the order of `specs()`; ranks outside the sender's TP and EP groups take no part; FP8
conversion (by the experts' owners, or the sender) equals quantising the HF weights directly."""

from __future__ import annotations

import pytest
import torch


def _rank(dist_init, spec: dict, fp8: bool) -> dict:
    from agentrl.config.schema import AlgorithmConfig
    from agentrl.sync.fp8 import fp8_rule
    from agentrl.train.megatron_backend import MegatronBackend
    from agentrl.train.megatron_export import StageExport
    from bench.parallel_cpu import layout_of, model_case, train_config

    config, state = model_case()
    layout = layout_of(spec, config)
    backend = MegatronBackend(config, train_config(), AlgorithmConfig(group_size=2), layout=layout,
                              dist_init=dist_init, hf_state=state)
    export = StageExport(backend.model, config, layout, dist_init.rank)
    specs = export.specs()
    names = frozenset(s.name for s in specs if fp8 and fp8_rule(s)) if fp8 else frozenset()
    got: list[tuple[str, str, torch.Tensor]] = []  # float8 as its bytes: torch cannot unpickle float8 storages
    export.run(lambda n, t: got.append((n, str(t.dtype), t.contiguous().view(torch.uint8).clone())), names)
    return {"stage": export.stage, "sender": export.sender, "participates": export.participates,
            "specs": [(s.name, s.dtype, s.shape) for s in specs], "fp8": sorted(names), "got": got}


def _expected() -> dict[str, torch.Tensor]:
    """The HF tensors an engine loads: per-expert names, MTP layer, no MTP aliases."""
    from agentrl.models.mapping import hf_to_megatron, megatron_to_hf
    from bench.parallel_cpu import model_case

    config, state = model_case()
    return megatron_to_hf(hf_to_megatron(state, config), config, hf_experts="per_expert", mtp_aliases=False)


@pytest.mark.slow
@pytest.mark.parametrize("name,fp8", [("EP2", True), ("TP2", False), ("PP2", True), ("PP2xEP2", False)])
def test_each_stage_sender_gets_exactly_its_tensors(name, fp8):
    from agentrl.sync.fp8 import to_wire
    from agentrl.train.local_world import run_ranks
    from bench.parallel_cpu import LAYOUTS

    spec = LAYOUTS[name]
    ranks = run_ranks(_rank, spec["world"], spec, fp8, timeout_s=300)
    want = _expected()
    seen: dict[str, tuple[str, torch.Tensor]] = {}
    for r, out in enumerate(ranks):
        if r != out["sender"]:
            assert out["got"] == [], f"rank {r} is not a sender but was handed tensors"
            continue
        wire_names = []
        for n, dt, shape in out["specs"]:
            wire_names += [w for w, _ in to_wire(n, torch.zeros(shape), n in out["fp8"])] if n in out["fp8"] else [n]
        assert [n for n, _, _ in out["got"]] == wire_names  # spec order, FP8 pairs in place
        for n, dt, t in out["got"]:
            assert n not in seen, f"{n} sent by two stages"
            seen[n] = (dt, t)
    fp8_names = {n for out in ranks for n in out["fp8"]}
    assert fp8 == bool(fp8_names) and (not fp8 or any(".indexer.wq_b." in n for n in fp8_names))
    expect = {}
    for n, t in want.items():
        expect.update(to_wire(n, t, n in fp8_names))
    assert set(seen) == set(expect)
    for n, t in expect.items():
        assert seen[n][0] == str(t.dtype) and torch.equal(seen[n][1], t.contiguous().view(torch.uint8)), n
    if name == "PP2xEP2":  # ranks 1 (EP peer of sender 0) and 3 (EP peer of sender 2) take part
        assert [out["participates"] for out in ranks] == [True, True, True, True]
