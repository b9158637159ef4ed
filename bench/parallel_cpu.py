"""Megatron backend parity on CPU: each parallel layout (TP2, PP2, CP2, EP2, TP2 x PP2, PP2 x EP2,
TP2 x CP2; at most 4 gloo ranks) against one rank, on the tiny GLM (MLA, DSA with index sharing:
layers 1, 2, 4 compute the top-k, 3 and 5 reuse it; sigmoid MoE; one MTP layer), fp32.

Per layout: the HF export before training equals the HF weights bit for bit; one train_step; its
loss, the reduced gradients of every HF tensor and the weights after the optimizer step, against
the same step on one rank; every rank's metrics dict is the same. `run_layout` is what the slow
tests (tests/test_megatron_parallel.py) assert on; `python -m bench.parallel_cpu` writes
bench/results/parallel_cpu.json.

Why the tolerances hold: all layouts compute the same fp32 math; only summation order differs
(TP partial sums, DP/CP gradient all-reduce, different micro-batch packing per DP rank). The Adam
epsilon is raised to ADAM_EPS so the first step's update, -lr * g / (|g| + eps), moves by at most
lr / eps per unit of gradient difference (with the default 1e-8, a grad of 1e-9 that differs in its
last bits could move a weight by a whole lr).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

LAYOUTS: dict[str, dict[str, Any]] = {
    "TP2": {"world": 2, "tp": 2},
    "PP2": {"world": 2, "pp": 2},
    "CP2": {"world": 2, "cp": 2},
    "EP2": {"world": 2, "ep": 2},
    "TP2xPP2": {"world": 4, "tp": 2, "pp": 2, "recompute": "full"},  # and full recompute with the 1F1B schedule
    "PP2xEP2": {"world": 4, "pp": 2, "ep": 2},
    "TP2xCP2": {"world": 4, "tp": 2, "cp": 2},
}
PP_SPLIT = (3, 2)  # the second stage starts on layer 4, which computes its top-k; layer 5 shares it
LR, ADAM_EPS = 1e-3, 1e-6
MAX_TOKENS_PER_GPU = 40  # several micro-batches per rank (trajectories of 12..30 tokens)
N_TRAJECTORIES = 6


def trajectories(n: int = N_TRAJECTORIES, seed: int = 0):
    """Varied lengths (12, 15, ..., 27) and rewards; prompt tokens masked."""
    import torch

    from agentrl.agent.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 12 + 3 * i
        ids = torch.randint(7, 1000, (length,), generator=g).tolist()
        sampled = length - 6
        out.append(Trajectory(episode_id=f"e{i}", task_id="t", group_id=f"g{i // 2}", prompt_len=6, token_ids=ids,
                              loss_mask=[0] * 6 + [1] * sampled,
                              rollout_logprobs=[0.0] * 6 + (-7.0 + 0.1 * torch.randn(sampled, generator=g)).tolist(),
                              weight_versions=[-1] * 6 + [0] * sampled, outcome="scored", reward=float(i % 2)))
    return out


def model_case(seed: int = 0):
    """(hf config, fp32 HF state with the MTP layer) of the tiny GLM."""
    from agentrl.models.tiny import build_tiny_model, tiny_mtp_state_dict

    model = build_tiny_model(seed, mtp=True).float()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state.update(tiny_mtp_state_dict(model.config, seed))
    mtp = f"model.layers.{model.config.num_hidden_layers}."  # released checkpoints repeat these two
    state[mtp + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[mtp + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    return model.config, state


def train_config(dsa_kernels: bool = False, recompute: str = "none"):
    from agentrl.config.schema import TrainConfig

    train = TrainConfig(logprob_chunk_tokens=32, dtype="float32", dsa_kernels=dsa_kernels)
    train.optimizer.lr, train.optimizer.eps = LR, ADAM_EPS
    train.parallel.recompute = recompute
    train.parallel.max_tokens_per_gpu = MAX_TOKENS_PER_GPU
    return train


def layout_of(spec: dict[str, Any], config):
    from agentrl.config.layout import Layout

    pp = spec.get("pp", 1)
    return Layout.resolve(world=spec["world"], tp=spec.get("tp", 1), pp=pp, cp=spec.get("cp", 1),
                          ep=spec.get("ep", 1), pp_split=PP_SPLIT if pp == 2 else None,
                          num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
                          n_experts=config.n_routed_experts)


def rank_program(dist_init, spec: dict[str, Any], dsa_kernels: bool = False) -> dict[str, Any]:
    """One rank of one layout: export, one step, grads and weights after it (full on every rank;
    rank 0 returns them)."""
    import torch

    from agentrl.config.schema import AlgorithmConfig
    from agentrl.train.megatron_backend import MegatronBackend

    config, state = model_case()
    backend = MegatronBackend(config, train_config(dsa_kernels, spec.get("recompute", "none")),
                              AlgorithmConfig(group_size=2),
                              layout=layout_of(spec, config), dist_init=dist_init, hf_state=state)
    exported = dict(backend.named_weights())
    exact = set(exported) == set(state) and all(torch.equal(exported[k], state[k]) for k in state)
    trajs = trajectories()
    t0 = time.perf_counter()
    metrics = backend.train_step(trajs, [t.group_id for t in trajs])
    step_s = time.perf_counter() - t0
    grads = {k: v.clone() for k, v in backend.named_grads()}
    weights = {k: v.clone() for k, v in backend.named_weights()}
    # PP > 1 with MTP: the last stage's embedding copy must stay equal to the first stage's
    shared = backend.shared_embedding
    out: dict[str, Any] = {"metrics": metrics, "export_exact": exact, "step_s": step_s,
                           "memory": backend.memory_report(),
                           "shared_embedding": shared.detach().clone() if shared is not None else None}
    if dsa_kernels:
        from agentrl.models.megatron_dsa_switch import dsa_kernel_stats

        out["dsa_kernels"] = dsa_kernel_stats(backend.model)
    if dist_init.rank == 0:
        out.update(grads=grads, weights=weights)
    return out


def run_layout(name: str, reference: dict[str, Any] | None = None, *, dsa_kernels: bool = False) -> dict[str, Any]:
    """Numbers of one layout (or of one rank, name "1") against `reference` (the one-rank run)."""
    from agentrl.train.local_world import run_ranks

    spec = {"world": 1} if name == "1" else LAYOUTS[name]
    t0 = time.perf_counter()
    ranks = run_ranks(rank_program, spec["world"], spec, dsa_kernels)
    wall = time.perf_counter() - t0
    head = ranks[0]
    drop = ("step_time_s",)  # measured per run; every rank reports the world's maximum
    same_metrics = all({k: v for k, v in r["metrics"].items() if k not in drop}
                       == {k: v for k, v in head["metrics"].items() if k not in drop} for r in ranks)
    result = {"layout": name, "world": spec["world"], "export_exact": all(r["export_exact"] for r in ranks),
              "same_metrics_on_every_rank": same_metrics, "loss": head["metrics"]["loss"],
              "step_time_s": head["metrics"]["step_time_s"], "wall_s": wall,
              "micro_batches": head["metrics"]["micro_batches"], "grads": head["grads"], "weights": head["weights"],
              "memory_accounted_equals_measured": all(r["memory"]["accounted"] == r["memory"]["measured"]
                                                      for r in ranks),
              "state_bytes_per_rank": [r["memory"]["measured"] for r in ranks],
              "embedding_copies": sum(r["shared_embedding"] is not None for r in ranks),
              "embedding_copies_equal": _copies_equal([r["shared_embedding"] for r in ranks], spec)}
    if dsa_kernels:
        result["dsa_kernels"] = [r["dsa_kernels"] for r in ranks]
    if reference is not None:
        result.update(compare(result, reference))
    return result


def _copies_equal(copies: list, spec: dict[str, Any]) -> bool:
    """The embedding on the first and last stage of each pipeline (same TP rank) bit for bit."""
    import torch

    from agentrl.models.hf_config import hf_config_for

    layout = layout_of(spec, hf_config_for("tiny"))
    if layout.pp == 1:
        return all(c is None for c in copies)
    for group in layout.groups()["pp"]:
        first, last = copies[group[0]], copies[group[-1]]
        if first is None or last is None or not torch.equal(first, last):
            return False
    return True


def compare(run: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """Loss relative difference, the largest gradient and post-step weight differences."""
    def max_diff(a: dict, b: dict) -> float:
        if set(a) != set(b):
            return float("inf")
        return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)

    return {"loss_rel_diff": abs(run["loss"] - reference["loss"]) / abs(reference["loss"]),
            "grad_max_diff": max_diff(run["grads"], reference["grads"]),
            "grad_max_abs": max(float(g.abs().max()) for g in reference["grads"].values()),
            "weight_max_diff_after_step": max_diff(run["weights"], reference["weights"])}


def run_parallel_cpu_bench(out: Path, names: tuple[str, ...] = tuple(LAYOUTS)) -> dict[str, Any]:
    from bench.machine import machine

    reference = run_layout("1")
    rows = []
    for name in names:
        row = run_layout(name, reference)
        rows.append({k: v for k, v in row.items() if k not in ("grads", "weights")})
    report = {"benchmark": "parallel_cpu", "machine": machine(), "model": "tiny GLM (5 layers + MTP), fp32",
              "trajectories": N_TRAJECTORIES, "max_tokens_per_gpu": MAX_TOKENS_PER_GPU,
              "reference": {k: v for k, v in reference.items() if k not in ("grads", "weights")}, "layouts": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    import sys

    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench/results/parallel_cpu.json")
    print(json.dumps(run_parallel_cpu_bench(path)["layouts"], indent=1))
