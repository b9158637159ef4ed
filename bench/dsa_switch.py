"""DSA layer speed: Megatron's unfused DSA vs the kernel switch, on a Megatron GPTModel (GPU only).

`python -m bench.dsa_switch --out dsa.json [--arch GLM-5.2_5layer] [--seqlens 4096] [--bwd-impls split,atomic]`
Builds the model with agentrl/models/megatron_builder.py on one GPU (bf16), runs one packed
forward + backward per variant (unswitched, then `apply_dsa_kernels` with each sparse MLA backward
impl asked for, the first reported as agentrl_kernels), and reports the median
step time, the peak memory and the logit difference. Routed-expert weights are frozen (no
weight gradients) so the 5-layer model at real widths fits with room for Megatron's dense
[heads, sq, sk] fp32 attention matrices; input gradients still flow through every layer.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def _init_single_gpu() -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(0)


def run(arch: str, seqlens: list[int], iters: int, bwd_impls: tuple[str | None, ...] = (None,)) -> dict:
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from agentrl.models.hf_config import hf_config_for
    from agentrl.models.megatron_builder import build_gpt_model, to_bf16_keeping_fp32_router_bias
    from agentrl.models.megatron_dsa_switch import apply_dsa_kernels, dsa_kernel_stats

    _init_single_gpu()
    torch.manual_seed(0)
    cfg = hf_config_for(arch, num_nextn_predict_layers=0)
    model = build_gpt_model(cfg, use_te=False)
    to_bf16_keeping_fp32_router_bias(model)
    model.cuda()
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.requires_grad_(False)
    total = sum(seqlens)
    ids = torch.randint(0, cfg.vocab_size, (1, total), device="cuda")
    pos = torch.cat([torch.arange(n) for n in seqlens])[None].cuda()
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def step():
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(seqlens),
                              max_seqlen_kv=max(seqlens))
        model.zero_grad(set_to_none=True)
        logits = model(ids, pos, None, packed_seq_params=psp)
        logits.float().square().mean().backward()
        return logits.detach()

    result: dict = {"arch": arch, "seqlens": seqlens, "index_topk": cfg.index_topk}
    logits = {}
    variants = {"megatron_unfused": None}
    for i, impl in enumerate(bwd_impls):  # the first is reported as agentrl_kernels, the others by impl
        variants["agentrl_kernels" if i == 0 else f"agentrl_kernels_bwd_{impl}"] = impl
    for variant, impl in variants.items():
        if variant != "megatron_unfused":
            result["layers_switched"] = apply_dsa_kernels(model, bwd_impl=impl)
            result.setdefault("bwd_impls", {})[variant] = impl or "default"
        torch.cuda.reset_peak_memory_stats()
        try:
            logits[variant] = step()  # warm-up (and autotuning)
            torch.cuda.synchronize()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
        except torch.OutOfMemoryError as exc:  # Megatron's dense path can exceed memory: record it
            result[variant] = {"error": f"OutOfMemoryError: {str(exc)[:300]}"}
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        result[variant] = {"fwd_bwd_ms": round(statistics.median(times), 2),
                           "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    result["kernel_calls"] = dsa_kernel_stats(model)
    if "megatron_unfused" in logits and "agentrl_kernels" in logits:
        a, b = logits["megatron_unfused"].float(), logits["agentrl_kernels"].float()
        result["logits_max_abs_diff"] = float((a - b).abs().max())
        result["logits_max_abs"] = float(a.abs().max())
    base = result.get("megatron_unfused", {}).get("fwd_bwd_ms")
    for variant in variants:
        ms = result.get(variant, {}).get("fwd_bwd_ms")
        if base and ms and variant != "megatron_unfused":
            result["speedup" if variant == "agentrl_kernels" else f"speedup_{variant}"] = round(base / ms, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--arch", default="GLM-5.2_5layer")
    parser.add_argument("--seqlens", default="4096", help="comma-separated packed sequence lengths")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--bwd-impls", default="",
                        help="comma-separated sparse MLA backward impls to time through the switch, one after "
                             "another on the same model (default: the kernels' default only)")
    args = parser.parse_args(argv)
    from kernels.sparse_mla_bwd import BWD_IMPLS

    impls = tuple(x for x in args.bwd_impls.split(",") if x) or (None,)
    bad = [x for x in impls if x is not None and x not in BWD_IMPLS]
    if bad:
        parser.error(f"--bwd-impls: unknown {bad}; choose from {', '.join(BWD_IMPLS)}")
    from bench.machine import machine  # the card and versions travel with the numbers (CI cannot rerun them)

    result = {"machine": machine(), **run(args.arch, [int(x) for x in args.seqlens.split(",")], args.iters, impls)}
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
