#!/usr/bin/env python
"""The Megatron backend's parallel-layout work on one H200, in one command:

  python bench/gpu/parallel_gpu.py --out bench/results/parallel_gpu.json

Four parts, each recorded with its error if it fails (the others still run):
  tp1_parity      TP1 is unchanged: bench/megatron.py's parity runs (tiny GLM, and the 5-layer
                  GLM-5.2-shaped model) against bench/results/megatron.json's recorded losses
                  (Megatron fp32 vs the recorded Megatron fp32, and vs the torch backend).
  grouped_experts 16 and 32 local experts at GLM-5.2 widths (H 6144, I 2048; 8192 tokens x top-8
                  routed rows, the share of one EP rank): agentrl's grouped GEMMs against
                  megatron's SequentialMLP loop on the same weights, forward + backward, bf16.
  cp_offset       the DSA kernel switch's top-k for one CP4 rank: 8K local queries (zigzag chunks
                  at offsets 0 and 28K) against 32K gathered keys, time and peak memory; its keys
                  against Megatron's dense scorer on a row subset (the full dense scorer needs
                  8K x 32 heads x 32K x 4 B = 34 GB of scores).
  memory_slice    one training step of a per-rank-sized slice (GLM-5.2 widths, one dense and one
                  MoE layer with 16 local experts, a TP2 rank's half vocabulary, 8192 tokens, full
                  recompute, bf16, disk-offloaded Adam): peak allocated HBM against
                  agentrl.config.memory's accounting of the same slice.
Writes one JSON with machine and versions. --small runs every part at toy sizes (CPU smoke test:
tests/test_parallel_gpu_script.py). Budget on one H200: about 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RECORDED = ROOT / "bench/results/megatron.json"
GLM_WIDTH = {"hidden": 6144, "inner": 2048, "tokens": 8192, "topk": 8}
SMALL_WIDTH = {"hidden": 64, "inner": 32, "tokens": 256, "topk": 2}


@contextmanager
def part(report: dict, name: str):
    rec: dict[str, Any] = {"ok": False}
    report["parts"][name] = rec
    t0 = time.time()
    print(f"[parallel-gpu] {name} ...", flush=True)
    try:
        yield rec
        rec["ok"] = True
    except Exception as e:  # noqa: BLE001 - recorded; the other parts still run
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()[-3000:]
        print(rec["traceback"], flush=True)
    finally:
        rec["seconds"] = round(time.time() - t0, 2)
        print(f"[parallel-gpu] {name}: {'ok' if rec['ok'] else 'FAILED'} ({rec['seconds']} s)", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------- tp1 parity

def tp1_parity(rec: dict, small: bool) -> None:
    from agentrl.models.hf_config import hf_config_for
    from bench.megatron import parity_run

    recorded = json.loads(RECORDED.read_text())["single_gpu"]
    cases = [("tiny_parity", hf_config_for("tiny"), {"steps": 3, "n": 8, "length": 64, "lr": 1e-3, "max_tokens": 160})]
    if not small:
        cases.append(("five_layer_parity", hf_config_for("GLM-5.2_5layer", n_routed_experts=8),
                      {"steps": 3, "n": 8, "length": 512, "lr": 1e-5, "max_tokens": 1024, "recompute": "full"}))
    for name, config, kw in cases:
        run: dict[str, Any] = {}
        parity_run(run, config, dtypes=("float32",), **kw)
        now = [s["loss"] for s in run["megatron_float32"]]
        before = [s["loss"] for s in recorded[name]["megatron_float32"]]
        rec[name] = {"megatron_fp32_losses": now, "recorded_megatron_fp32_losses": before,
                     "rel_diff_vs_recorded_megatron": [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(now, before)],
                     "rel_diff_vs_torch": run["rel_diff_float32"],
                     "recorded_rel_diff_vs_torch": recorded[name]["rel_diff_float32"],
                     "peak_gib": run.get("megatron_float32_peak_gib")}


# ---------------------------------------------------------------- grouped experts

def _expert_config(n_experts: int, width: dict):
    from agentrl.models.hf_config import hf_config_for
    from agentrl.models.megatron_builder import transformer_config_from_hf

    hf = hf_config_for("tiny" if width is SMALL_WIDTH else "GLM-5.2_5layer", n_routed_experts=n_experts)
    return transformer_config_from_hf(hf, None, bf16=torch.cuda.is_available(),
                                      use_cpu_initialization=not torch.cuda.is_available())


def _time(fn, repeats: int) -> float:
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync()
    return (time.perf_counter() - t0) / repeats * 1e3


def _expert_step(module, x, counts, probs, upstream) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward + backward of one experts module; (output, input grad) in fp32."""
    xi = x.detach().requires_grad_()
    out, _ = module(xi, counts, probs)
    (out.float() * upstream.float()).sum().backward()
    module.zero_grad(set_to_none=True)
    return out.detach().float(), xi.grad.float()


def grouped_experts(rec: dict, small: bool) -> None:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from agentrl.train.cpu_shims import cpu_megatron
    from agentrl.train.grouped_experts import GroupedExperts

    width = SMALL_WIDTH if small else GLM_WIDTH
    groups = ProcessGroupCollection.use_mpu_process_groups()
    for n in ((4,) if small else (16, 32)):
        config = _expert_config(n, width)
        with cpu_megatron():
            loop = SequentialMLP(n, config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                                 pg_collection=groups).to(_device())
            grouped = GroupedExperts(n, config, groups).to(_device())
        grouped.load_state_dict({k: v for k, v in loop.state_dict().items() if not k.endswith("_extra_state")})
        rows = width["tokens"] * width["topk"]
        g = torch.Generator(device=_device()).manual_seed(0)
        counts = torch.distributions.Multinomial(rows, torch.ones(n)).sample().long()  # balanced-ish routing
        x = torch.randn(rows, config.hidden_size, device=_device(), dtype=config.params_dtype, generator=g)
        probs = torch.rand(rows, device=_device(), generator=g)
        upstream = torch.randn(rows, config.hidden_size, device=_device(), dtype=config.params_dtype, generator=g)
        batch = (x, counts, probs, upstream)
        outs = {"loop": _expert_step(loop, *batch), "grouped": _expert_step(grouped, *batch)}
        repeats = 2 if small else 10
        ms_loop = _time(lambda m=loop, b=batch: _expert_step(m, *b), repeats)
        ms_grouped = _time(lambda m=grouped, b=batch: _expert_step(m, *b), repeats)
        scale = float(outs["loop"][0].abs().max())
        rec[f"experts_{n}"] = {"routed_rows": rows, "hidden": config.hidden_size, "inner": config.moe_ffn_hidden_size,
                               "loop_ms": ms_loop, "grouped_ms": ms_grouped, "speedup": ms_loop / ms_grouped,
                               "out_max_rel_diff": float((outs["loop"][0] - outs["grouped"][0]).abs().max()) / scale,
                               "dx_max_rel_diff": float((outs["loop"][1] - outs["grouped"][1]).abs().max())
                               / float(outs["loop"][1].abs().max())}


# ---------------------------------------------------------------- CP offset top-k

def cp_offset(rec: dict, small: bool) -> None:
    from megatron.core.transformer.experimental_attention_variant import dsa, dsa_layout, dsa_masking

    from agentrl.models.megatron_dsa_switch import _ACTIVE, _ORIGINALS, DsaKernelState, _install_dispatchers

    _install_dispatchers()
    cp, keys, heads, dim, topk = (4, 1024, 8, 16, 64) if small else (4, 32768, 32, 128, 2048)
    dev, dtype = _device(), (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    cu = torch.tensor([0, keys], device=dev)
    pos = dsa_layout.build_packed_allgather_cp_local_positions(cu, cp, 0, dev)  # CP rank 0: chunks 0 and 7
    starts, ends = dsa_masking.generate_varlen_mask_params_for_positions(cu, pos)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(pos.numel(), 1, heads, dim, device=dev, dtype=dtype, generator=g)
    k = torch.randn(keys, 1, dim, device=dev, dtype=dtype, generator=g)
    w = torch.rand(pos.numel(), 1, heads, device=dev, generator=g) / heads
    state = DsaKernelState()

    def kernel():
        token = _ACTIVE.set(state)
        try:
            return dsa.fused_qk_topk_naive(q, k, w, topk, varlen_starts=starts, varlen_ends=ends)[1]
        finally:
            _ACTIVE.reset(token)

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    got = kernel()
    ms = _time(kernel, 1 if small else 5)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if torch.cuda.is_available() else None
    half = pos.numel() // 2
    sub = torch.cat([torch.arange(0, 256, device=dev), torch.arange(half, half + 256, device=dev)])
    sub = sub[sub < pos.numel()]
    _, want = _ORIGINALS["fused_qk_topk_naive"](q[sub], k, w[sub], topk, varlen_starts=starts[sub], varlen_ends=ends[sub])
    overlap = []
    for row, r in enumerate(sub.tolist()):
        a = {i for i in got[0, r].tolist() if i >= 0}
        b = {i for i in want[0, row].tolist() if i >= 0}
        overlap.append(len(a & b) / max(len(b), 1))
    rec.update({"queries": pos.numel(), "keys": keys, "cp": cp, "heads": heads, "topk": topk, "ms": ms,
                "peak_extra_gib": peak, "calls": dict(state.calls), "dense_scores_gib": pos.numel() * heads * keys * 4 / 2**30,
                "topk_overlap_vs_dense_min": min(overlap), "topk_overlap_vs_dense_mean": sum(overlap) / len(overlap)})


# ---------------------------------------------------------------- memory of a per-rank slice

def memory_slice(rec: dict, small: bool, offload_dir: Path, dsa_kernels: bool = False) -> None:
    from agentrl.config.memory import activation_bytes
    from agentrl.config.model_shapes import shapes_of
    from agentrl.config.schema import AlgorithmConfig, TrainConfig
    from agentrl.models.hf_config import hf_config_for
    from agentrl.train.megatron_backend import MegatronBackend
    from bench.megatron import trajectories

    if small:
        config, length = hf_config_for("tiny"), 128
    else:  # one dense + one MoE layer, 16 local experts (EP16), half of GLM-5.2's vocabulary (TP2's shard)
        config = hf_config_for("GLM-5.2_5layer", num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=16,
                               vocab_size=154880 // 2)
        length = GLM_WIDTH["tokens"] // 2
    train = TrainConfig(dtype="bfloat16" if torch.cuda.is_available() else "float32")
    train.parallel.recompute, train.parallel.max_tokens_per_gpu = "full", 2 * length
    train.optimizer.offload, train.optimizer.offload_dir = "disk", offload_dir
    train.dsa_kernels = dsa_kernels
    backend = MegatronBackend(config, train, AlgorithmConfig(group_size=2), run_dir=offload_dir / "run")
    batch = trajectories(2, length, config.vocab_size)
    tokens = sum(len(t.token_ids) for t in batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    metrics = backend.train_step(batch, [t.group_id for t in batch])
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    report = backend.memory_report()
    shapes = shapes_of(config)
    act = activation_bytes(shapes, range(config.num_hidden_layers), tokens=tokens, tp=1, in_flight=1,
                           chunk=train.logprob_chunk_tokens, last=True, index_topk=config.index_topk,
                           fused_logprobs=torch.cuda.is_available(), dense_dsa=not dsa_kernels)
    accounted = sum(report["accounted"].values()) + sum(act.values())
    rec.update({"dsa_kernels": dsa_kernels, "params_b": sum(p.numel() for p in backend.model.parameters()) / 1e9,
                "tokens": tokens,
                "micro_batches": metrics["micro_batches"], "state_accounted": report["accounted"],
                "state_measured": report["measured"], "activations_accounted": act, "accounted_gib": accounted / 2**30,
                "peak_allocated_gib": peak / 2**30 if peak is not None else None,
                "peak_over_accounted": peak / accounted if peak is not None else None,
                "disk_state_gib": sum(report["accounted_disk"].values()) / 2**30, "step_s": metrics["step_time_s"]})
    del backend


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/parallel_gpu.json")
    p.add_argument("--small", action="store_true", help="toy sizes (CPU smoke test)")
    p.add_argument("--offload-dir", type=Path, default=Path("/tmp/agentrl-parallel-gpu"),
                   help="node-local folder for the memory slice's disk-offloaded Adam state")
    p.add_argument("--parts", nargs="*", default=["tp1_parity", "grouped_experts", "cp_offset", "memory_slice"])
    a = p.parse_args(argv)
    from agentrl.config.layout import Layout
    from agentrl.train.megatron_parallel import init_megatron_parallel
    from bench.machine import machine

    init_megatron_parallel(Layout.single(1))  # one rank; every part below reuses it
    report: dict[str, Any] = {"benchmark": "parallel_gpu", "machine": machine(), "small": a.small, "parts": {}}
    runs = {"tp1_parity": lambda r: tp1_parity(r, a.small), "grouped_experts": lambda r: grouped_experts(r, a.small),
            "cp_offset": lambda r: cp_offset(r, a.small), "memory_slice": lambda r: memory_slice(r, a.small, a.offload_dir),
            # the same slice through the DSA kernel switch: no dense scores, so it checks the other terms
            "memory_slice_dsa_kernels": lambda r: memory_slice(r, a.small, a.offload_dir, dsa_kernels=True)}
    for name in a.parts:
        with part(report, name) as rec:
            runs[name](rec)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    failed = [n for n, r in report["parts"].items() if not r["ok"]]
    print(f"[parallel-gpu] wrote {a.out}; failed parts: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
