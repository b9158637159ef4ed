"""Megatron backend benchmark: loss parity with the torch backend, expert parallelism, weight
broadcast efficiency and FP8 quantisation time. Writes bench/results/megatron.json.

Three parts, run by bench/gpu/megatron_gpu.py (or `agentrl bench megatron`):
  single  one process, one device: torch backend vs Megatron backend on the same weights and the same
          trajectories, several steps, fp32 (the parity number) and bf16 (Megatron's training
          dtype, reported beside it), for the tiny GLM and a 5-layer GLM-5.2-shaped model.
  dual    two processes (torchrun): the tiny GLM with EP2 x DP2 (expert shards on two GPUs), its
          loss against the single-process run of the same batch; a TP2 build with and without
          sequence parallelism (what builds, and Megatron's refusal without it, are recorded);
          the export path (HF names -> optional FP8 -> flattened buckets -> broadcast) against a
          raw broadcast of the same bucket sizes, and FP8 quantisation time.
  merge   the two JSONs + offload_stream_efficiency (read from bench/results/offload_h200.json,
          measured there) -> megatron.json with the headline keys.
No number is filled in: a stage that fails records its error and the headline stays absent.
"""

from __future__ import annotations

import json
import subprocess
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

HEADLINES = ("loss_parity_max_rel_diff", "weight_broadcast_efficiency", "offload_stream_efficiency")


@contextmanager
def stage(report: dict, name: str):
    rec: dict[str, Any] = {"ok": False}
    report.setdefault("stages", {})[name] = rec
    t0 = time.time()
    print(f"[megatron-bench] {name} ...", flush=True)
    try:
        yield rec
        rec["ok"] = True
    except Exception as e:  # noqa: BLE001 - recorded; later stages still run
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()[-4000:]
        print(rec["traceback"], flush=True)
    finally:
        rec["seconds"] = round(time.time() - t0, 2)
        print(f"[megatron-bench] {name}: {'ok' if rec['ok'] else 'FAILED'} ({rec['seconds']} s)", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=30)
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def trajectories(n: int, length: int, vocab: int, seed: int = 0) -> list:
    """Synthetic GRPO batch: groups of 4, half the prompt masked, rewards 0/1 within each group."""
    from agentrl.agent.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        size = length - (i % 4) * (length // 8)  # mixed lengths: real THD packing
        prompt = size // 2
        ids = torch.randint(7, vocab, (size,), generator=g).tolist()
        rollout = (-torch.rand(size - prompt, generator=g) * 8).tolist()
        out.append(Trajectory(episode_id=f"e{i}", task_id="t", group_id=f"g{i // 4}", prompt_len=prompt, token_ids=ids,
                              loss_mask=[0] * prompt + [1] * (size - prompt), rollout_logprobs=[0.0] * prompt + rollout,
                              weight_versions=[-1] * prompt + [0] * (size - prompt), outcome="scored",
                              reward=float(i % 2)))
    return out


def train_config(dtype: str, lr: float, max_tokens: int, recompute: str = "none"):
    from agentrl.config.schema import TrainConfig

    train = TrainConfig(logprob_chunk_tokens=4096, dtype=dtype)  # type: ignore[arg-type]
    train.optimizer.lr, train.optimizer.weight_decay = lr, 0.0
    train.parallel.recompute = recompute  # type: ignore[assignment]
    train.parallel.max_tokens_per_gpu = max_tokens
    return train


def hf_model(config: Any, seed: int, device: str):
    from transformers import GlmMoeDsaForCausalLM

    from agentrl.models.tiny import randomize_router_bias

    torch.manual_seed(seed)
    # Small models are initialised on the CPU generator, so every process (one GPU, two GPUs, CPU)
    # gets the same weights; a 5-layer model at real widths is initialised on the GPU for speed.
    init_device = "cpu" if config.hidden_size < 1024 else device
    with torch.device(init_device):
        model = GlmMoeDsaForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_router_bias(model, seed)
    return model.to(device)


def parity_run(rec: dict, config: Any, *, steps: int, n: int, length: int, lr: float, max_tokens: int,
               dtypes: tuple[str, ...] = ("float32", "bfloat16"), recompute: str = "none", seed: int = 0) -> None:
    """Torch backend (fp32) then Megatron backend per dtype, sequentially (a 5-layer model at real
    widths does not fit twice with Adam state), on the same initial weights and batch."""
    from agentrl.config.schema import AlgorithmConfig
    from agentrl.train.megatron_backend import MegatronBackend
    from agentrl.train.torch_backend import TorchBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    algo = AlgorithmConfig(group_size=4)
    batch = trajectories(n, length, config.vocab_size, seed)
    gids = [t.group_id for t in batch]
    model = hf_model(config, seed, device)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    rec["params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
    rec["tokens_per_step"] = sum(len(t.token_ids) for t in batch)
    tb = TorchBackend(model, train_config("float32", lr, max_tokens), algo)
    rec["torch"] = [tb.train_step(batch, gids) for _ in range(steps)]
    del tb, model
    for dtype in dtypes:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        mb = MegatronBackend(config, train_config(dtype, lr, max_tokens, recompute), algo, hf_state=state)
        rec[f"megatron_{dtype}"] = [mb.train_step(batch, gids) for _ in range(steps)]
        if torch.cuda.is_available():
            rec[f"megatron_{dtype}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rec[f"rel_diff_{dtype}"] = [abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12)
                                    for a, b in zip(rec["torch"], rec[f"megatron_{dtype}"])]
        del mb


def run_single(out: Path, *, five_layer: bool = True, five_layer_experts: int = 8, five_layer_len: int = 512) -> dict:
    from agentrl.models.hf_config import hf_config_for
    from bench.machine import machine

    report: dict[str, Any] = {"machine": machine(), "driver": driver_version()}
    with stage(report, "tiny_parity") as rec:
        parity_run(rec, hf_config_for("tiny"), steps=3, n=8, length=64, lr=1e-3, max_tokens=160)
    _write(out, report)
    if five_layer:
        with stage(report, "five_layer_parity") as rec:
            cfg = hf_config_for("GLM-5.2_5layer", n_routed_experts=five_layer_experts)
            rec["config"] = {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "experts": five_layer_experts,
                             "vocab": cfg.vocab_size}
            parity_run(rec, cfg, steps=3, n=8, length=five_layer_len, lr=1e-5, max_tokens=2 * five_layer_len,
                       dtypes=("float32", "bfloat16"), recompute="full")
    _write(out, report)
    return report


# ---------------------------------------------------------------- two processes

def run_dual(out: Path, *, export_gib: float = 8.0, bucket_mb: int = 256, seed: int = 0, small: bool = False) -> dict:
    """Under torchrun with 2 ranks (NCCL on GPUs, gloo on CPU)."""
    import os

    import torch.distributed as dist

    from agentrl.config.layout import Layout
    from agentrl.config.schema import AlgorithmConfig
    from agentrl.models.hf_config import hf_config_for
    from agentrl.train.megatron_parallel import DistInit, init_megatron_parallel

    config = hf_config_for("tiny")
    layout = Layout.resolve(world=2, ep=2, num_layers=config.num_hidden_layers,
                            num_heads=config.num_attention_heads, n_experts=config.n_routed_experts)
    # torchrun's variables name this rank; the library reads none (a DistInit says how to join)
    dist_init = DistInit(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"],
                         int(os.environ["MASTER_PORT"]), int(os.environ.get("LOCAL_RANK", "0")))
    report: dict[str, Any] = {}
    init_megatron_parallel(layout, dist_init, seed=seed)
    rank = dist.get_rank()
    with stage(report, "tiny_ep2") as rec:
        from agentrl.train.megatron_backend import MegatronBackend

        model = hf_model(config, seed, "cpu")
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        train = train_config("float32", 1e-3, 160)
        train.parallel.ep, train.parallel.tp = 2, 1
        batch = trajectories(8, 64, config.vocab_size, seed)
        mb = MegatronBackend(config, train, AlgorithmConfig(group_size=4), hf_state=state, layout=layout,
                             dist_init=dist_init)
        rec["local_experts"] = sum(1 for n in mb.model.state_dict() if ".local_experts." in n and "linear_fc1" in n)
        rec["steps"] = [mb.train_step(batch, [t.group_id for t in batch]) for _ in range(3)]
        exported = dict(mb.named_weights())
        rec["exported_tensors"] = len(exported)
        rec["export_names_match_hf"] = set(exported) == set(state)
        del mb
    with stage(report, "tp2_attempt") as rec:
        rec.update(tp2_attempt())
    with stage(report, "weight_broadcast") as rec:
        rec.update(broadcast_bench(rank, export_gib, bucket_mb, fp8=False, small=small))
    with stage(report, "weight_broadcast_fp8") as rec:
        rec.update(broadcast_bench(rank, export_gib, bucket_mb, fp8=True, small=small))
    if rank == 0:
        _write(out, report)
    dist.barrier()
    return report


def tp2_attempt() -> dict:
    """Ask megatron itself for a TP2 DSA model without TransformerEngine, with agentrl's sequence-
    parallel norms (builds) and without sequence parallelism (AbsorbedMLA refuses); records both."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from agentrl.config.layout import Layout
    from agentrl.models.hf_config import hf_config_for
    from agentrl.models.megatron_builder import megatron_config_fields
    from agentrl.train.cpu_shims import cpu_megatron

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)
    result: dict[str, Any] = {}
    try:
        for sp in (True, False):
            tiny = hf_config_for("tiny")
            layout = Layout.resolve(world=2, tp=2, num_layers=tiny.num_hidden_layers, sequence_parallel=sp)
            fields = megatron_config_fields(tiny, layout, bf16=False)
            try:
                from megatron.core.models.gpt import GPTModel

                from agentrl.models.megatron_builder import (
                    _point_absorbed_mla_at_local_linear,
                    local_dsa_backend,
                    local_layer_specs,
                )

                with cpu_megatron():
                    config = MLATransformerConfig(**fields)
                    _point_absorbed_mla_at_local_linear()
                    spec = local_layer_specs(config, local_dsa_backend(1e-6))
                    GPTModel(config=config, transformer_layer_spec=spec, vocab_size=1024, max_sequence_length=4096,
                             position_embedding_type="rope")
                result[f"sequence_parallel_{sp}"] = "built"
            except Exception as e:  # noqa: BLE001 - this is the measurement
                result[f"sequence_parallel_{sp}"] = f"{type(e).__name__}: {str(e)[:600]}"
    finally:
        ps.destroy_model_parallel()
    return result


def synthetic_hf_weights(gib: float, device: torch.device, small: bool = False) -> list[tuple[str, torch.Tensor]]:
    """bf16 tensors with GLM-5.2 shapes and HF names (32 of its 256 experts per layer), layer after
    layer, until `gib` GiB. `small`: widths / 16 and 4 experts (CPU smoke runs)."""
    h, q, kv, heads = (384, 128, 32, 4) if small else (6144, 2048, 512, 64)
    inter, experts = (128, 4) if small else (2048, 32)
    shapes = [("self_attn.q_a_proj.weight", (q, h)), ("self_attn.q_b_proj.weight", (heads * 256, q)),
              ("self_attn.kv_a_proj_with_mqa.weight", (kv + 64, h)), ("self_attn.kv_b_proj.weight", (heads * 448, kv)),
              ("self_attn.o_proj.weight", (h, heads * 256)), ("input_layernorm.weight", (h,)),
              ("mlp.gate.weight", (256, h))]
    shapes += [(f"mlp.experts.{e}.{p}.weight", (inter, h) if p != "down_proj" else (h, inter))
               for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")]
    g = torch.Generator(device=device).manual_seed(0)
    out, total, layer = [], 0, 0
    while total < gib * 2**30:
        for name, shape in shapes:
            t = torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
            out.append((f"model.layers.{layer}.{name}", t))
            total += t.numel() * 2
        layer += 1
    return out


def broadcast_bench(rank: int, gib: float, bucket_mb: int, *, fp8: bool, repeats: int = 5, small: bool = False) -> dict:
    """Rank 0 exports, rank 1 receives (the engine side), over a weight-update group built as the
    trainer builds it for SGLang (nccl_export.init_weights_update_group). Raw baseline: the same bucket byte sizes broadcast from a preallocated buffer."""
    import torch.distributed as dist

    from agentrl.sync.nccl_export import (
        NcclWeightExporter,
        init_weights_update_group,
        plan_buckets,
        receive_bucket,
    )

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    import os

    port = int(os.environ.get("MASTER_PORT", "29500")) + 7 + (1 if fp8 else 0)
    group = init_weights_update_group("127.0.0.1", port, rank, 2, f"bench_fp8_{fp8}", backend="nccl" if cuda else "gloo")
    bucket_bytes = bucket_mb << 20
    named = synthetic_hf_weights(gib, device, small) if rank == 0 else []
    # Payloads once, untimed (SGLang gets them by HTTP while the broadcast runs).
    if fp8 and rank == 0:  # first, on an idle GPU: the quantiser's autotuner times its configs here
        rec_quant = fp8_quant_timing(named)
    exporter = NcclWeightExporter(group, group_name="bench", bucket_bytes=bucket_bytes, fp8=fp8, src=0)
    plans = [exporter.payloads(named) if rank == 0 else None]
    dist.broadcast_object_list(plans, src=0, group=group)
    payloads = plans[0]
    rec: dict[str, Any] = {"fp8": fp8, "bucket_mb": bucket_mb, "buckets": len(payloads)}
    times, checks = [], []
    for r in range(repeats + 1):  # the first one warms up (and verifies)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        if rank == 0:
            stats = exporter.export(iter(named), version=r)
            rec["bytes"] = stats.bytes
            rec.setdefault("flatten_s", []).append(stats.flatten_s)
        else:
            for p in payloads:
                got = receive_bucket(group, p["names"], p["dtypes"], p["shapes"], device, src=0)
                if r == 0:
                    checks.append(sum(float(t.view(-1).view(torch.uint8).to(torch.int64).sum()) for _, t in got))
        if cuda:
            torch.cuda.synchronize()
        if r:
            times.append(time.perf_counter() - t0)
    if rank == 0:  # the checksum of what was sent, bucket by bucket
        for b in plan_buckets(iter(named), fp8, bucket_bytes):
            checks.append(sum(float(t.contiguous().view(-1).view(torch.uint8).to(torch.int64).sum())
                              for it in b for _, t in it.materialise()))
    gathered = [None, None]
    dist.all_gather_object(gathered, checks, group=group)
    rec["received_equals_sent"] = gathered[0] == gathered[1]
    sizes = [sum(_payload_bytes(p)) for p in payloads]
    raw = torch.empty(max(sizes), dtype=torch.uint8, device=device)
    raw_times = []
    for r in range(repeats + 1):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for n in sizes:
            dist.broadcast(raw[:n], src=0, group=group)
        if cuda:
            torch.cuda.synchronize()
        if r:
            raw_times.append(time.perf_counter() - t0)
    total = sum(sizes)
    rec.update(export_s=times, raw_s=raw_times, total_bytes=total,
               export_gbps=total / min(times) / 1e9, raw_gbps=total / min(raw_times) / 1e9,
               efficiency=min(raw_times) / min(times))
    if fp8 and rank == 0:
        rec["fp8_quant"] = rec_quant
    del named
    return rec


def _payload_bytes(p: dict) -> list[int]:
    out = []
    for dt, shape in zip(p["dtypes"], p["shapes"]):
        numel = 1
        for s in shape:
            numel *= s
        out.append(numel * torch.empty((), dtype=getattr(torch, dt)).element_size())
    return out


def fp8_quant_timing(named: list[tuple[str, torch.Tensor]]) -> dict:
    from agentrl.sync.nccl_export import fp8_eligible, quantize_named

    eligible = [(n, t) for n, t in named if fp8_eligible(n, t)]
    list(quantize_named(iter(eligible[:4]), True))  # autotune / warm up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in quantize_named(iter(eligible), True):
        pass
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for _, t in eligible)
    return {"tensors": len(eligible), "input_bytes": nbytes, "seconds": dt, "input_gbps": nbytes / dt / 1e9}


# ---------------------------------------------------------------- merge

def merge(single: Path, dual: Path, offload: Path, out: Path) -> dict:
    s = json.loads(single.read_text()) if single.exists() else {}
    d = json.loads(dual.read_text()) if dual.exists() else {}
    report: dict[str, Any] = {"machine": s.get("machine"), "driver": s.get("driver"),
                              "versions": (s.get("machine") or {}).get("versions"),
                              "single_gpu": s.get("stages"), "two_gpu": d.get("stages")}
    rel = [x for st in (s.get("stages") or {}).values() if st.get("ok") for x in st.get("rel_diff_float32", [])]
    if rel:
        report["loss_parity_max_rel_diff"] = max(rel)
        report["loss_parity_note"] = "fp32 Megatron vs fp32 torch backend, all steps of every model"
    bf = [x for st in (s.get("stages") or {}).values() if st.get("ok") for x in st.get("rel_diff_bfloat16", [])]
    if bf:
        report["loss_parity_bf16_max_rel_diff"] = max(bf)
    ep2 = (d.get("stages") or {}).get("tiny_ep2") or {}
    one = (s.get("stages") or {}).get("tiny_parity") or {}
    if ep2.get("ok") and one.get("ok"):  # same weights, same batch: EP2 x DP2 against one process
        report["ep2_vs_single_rel_diff"] = [abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-12)
                                            for a, b in zip(ep2["steps"], one["megatron_float32"])]
    wb = (d.get("stages") or {}).get("weight_broadcast") or {}
    if wb.get("ok") and wb.get("received_equals_sent"):
        report["weight_broadcast_efficiency"] = wb["efficiency"]
        report["weight_broadcast_gbps"] = wb["export_gbps"]
        report["raw_broadcast_gbps"] = wb["raw_gbps"]
    fp = (d.get("stages") or {}).get("weight_broadcast_fp8") or {}
    if fp.get("ok"):
        report["fp8_quant"] = fp.get("fp8_quant")
        report["weight_broadcast_fp8_efficiency"] = fp.get("efficiency")  # vs raw broadcast of the fp8 bytes
        if wb.get("ok"):  # does FP8 shorten the sync of the same weights, end to end?
            report["fp8_export_speedup_vs_bf16_export"] = min(wb["export_s"]) / min(fp["export_s"])
    if offload.exists():
        off = json.loads(offload.read_text())
        if "offload_stream_efficiency" in off:
            report["offload_stream_efficiency"] = off["offload_stream_efficiency"]
            report["offload_stream_source"] = f"{offload} (measured by `agentrl bench offload` on the H200 host)"
    report["missing_headlines"] = [k for k in HEADLINES if k not in report]
    _write(out, report)
    return report


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)

