#!/usr/bin/env python
"""GLM-MoE-DSA parity on one GPU: transformers' reference model vs agentrl's Megatron GPTModel.

Stages (each recorded in the JSON with its numbers, or its error and traceback):
  env               machine (nvidia-smi), torch / transformers / megatron-core / triton versions
  init_distributed  NCCL world of 1 and megatron parallel_state (TP = PP = EP = 1)
  tiny_fp32         tiny GLM in fp32: same weights (agentrl.models.mapping) -> logits diff
  tiny_bf16         the same in bf16 (plus bf16-vs-fp32 of transformers itself as a yardstick)
  tiny_train_step   fp32: loss, grads (mapped back to HF names) and loss after one AdamW step
  tiny_mtp_load     tiny GLM with an MTP layer: HF safetensors -> prepare.convert_hf_to_megatron ->
                    megatron dist_checkpointing.load into the model -> equals the direct mapping
  five_layer        GLM-5.2 widths, 5 layers, few experts: forward + backward time and peak memory
Writes --out even when stages fail, and exits non-zero if any stage failed or a headline number
(fp32_max_abs_logit_diff, bf16_max_abs_logit_diff) is missing. No number is ever filled in.

Run on the GPU machine from the repository root (no TE, no Ray needed):
  python bench/gpu/model_parity.py --out bench/results/model_parity_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, from anywhere

from agentrl.models.mapping import hf_to_megatron, megatron_to_hf

HEADLINE_KEYS = ("fp32_max_abs_logit_diff", "bf16_max_abs_logit_diff")


# ---------------------------------------------------------------- CPU-testable helpers

def load_into_megatron(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a full Megatron-named state dict into `model` (casting dtype), strictly by name.

    TransformerEngine `_extra_state` entries are left alone; anything else missing, unexpected or of
    another shape is an error naming the tensors."""
    target = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
    missing, unexpected = sorted(set(target) - set(state)), sorted(set(state) - set(target))
    shapes = sorted(k for k in set(target) & set(state) if tuple(target[k].shape) != tuple(state[k].shape))
    if missing or unexpected or shapes:
        raise ValueError(f"Megatron model vs mapped weights: missing {missing[:8]} ({len(missing)}), "
                         f"unexpected {unexpected[:8]} ({len(unexpected)}), shape mismatch {shapes[:8]}")
    with torch.no_grad():
        for name, t in target.items():
            t.copy_(state[name].to(device=t.device, dtype=t.dtype))


def megatron_tensors(model: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full-name weights (or grads; zeros where none) of a TP1/PP1/EP1 Megatron model, on CPU fp32."""
    out = {}
    params = dict(model.named_parameters())
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        if grads:
            g = params[name].grad if name in params else None
            t = torch.zeros_like(t) if g is None else g
        out[name] = t.detach().float().cpu()
    return out


def hf_tensors(model: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    out = {}
    params = dict(model.named_parameters())
    for name, t in model.state_dict(keep_vars=True).items():
        if grads:
            g = params[name].grad if name in params else None
            t = torch.zeros_like(t) if g is None else g
        out[name] = t.detach().float().cpu()
    return out


def diff_stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a.float() - b.float()).abs()
    scale = b.float().abs().max().item()
    return {"max_abs": d.max().item(), "mean_abs": d.mean().item(), "ref_max_abs": scale,
            "frac_gt_1e-3": (d > 1e-3).float().mean().item()}


def worst_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], n: int = 6) -> list[dict[str, Any]]:
    """The n tensors with the largest max-abs difference relative to the reference's scale."""
    rows = []
    for k in sorted(set(a) & set(b)):
        d = (a[k] - b[k]).abs().max().item()
        scale = b[k].abs().max().item()
        rows.append({"name": k, "max_abs": d, "ref_max_abs": scale, "rel": d / scale if scale else d})
    return sorted(rows, key=lambda r: -r["rel"])[:n]


def perturb_(model: torch.nn.Module, seed: int) -> None:
    """transformers initialises norms to 1 and the expert bias to 0: randomise them (and every
    other tensor a little) so a swapped or mis-mapped tensor shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            noise = torch.randn(t.shape, generator=gen).to(t.device, t.dtype)
            if t.ndim == 1:  # norms, norm biases, expert bias
                t.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            else:
                t.add_(0.01 * noise)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


def causal_mask(batch: int, seq: int, device: Any) -> torch.Tensor:
    """Megatron's bool mask (True = masked). DSA keeps its per-forward top-k sharing state on this
    object (on the shared config when None), so every forward gets a fresh one."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1)[None, None].expand(batch, 1, seq, seq)


def synthetic_mtp_layer(config: Any, state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of MTP layer `num_hidden_layers` (transformers never builds it): a copy of the
    last MoE layer that computes its DSA index (Megatron's MTP layer always has an indexer), perturbed,
    plus the MTP-only tensors; embed/head copies equal the main ones, as in released checkpoints."""
    n, h = config.num_hidden_layers, config.hidden_size
    donor = max(i for i in range(n) if config.indexer_types[i] == "full" and config.mlp_layer_types[i] == "sparse")
    gen = torch.Generator().manual_seed(seed)
    src, dst = f"model.layers.{donor}.", f"model.layers.{n}."
    layer = {dst + k[len(src):]: v + 0.01 * torch.randn(v.shape, generator=gen).to(v.dtype)
             for k, v in state.items() if k.startswith(src)}
    for name, shape in (("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)),
                        ("shared_head.norm.weight", (h,))):
        layer[dst + name] = torch.randn(shape, generator=gen)
    layer[dst + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    layer[dst + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    return layer


# ---------------------------------------------------------------- report

class Report:
    def __init__(self, out: Path):
        self.out, self.data = out, {"stages": {}, "started_unix": time.time()}

    @contextmanager
    def stage(self, name: str):
        print(f"[parity] {name} ...", flush=True)
        rec: dict[str, Any] = {"ok": False}
        self.data["stages"][name] = rec
        t0 = time.time()
        try:
            yield rec
            rec["ok"] = True
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - recorded; the next stage still runs (torch's
            # CheckpointException derives from BaseException, seen on the H200)
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()
            print(rec["traceback"], file=sys.stderr, flush=True)
        finally:
            rec["seconds"] = round(time.time() - t0, 3)
            print(f"[parity] {name}: {'ok' if rec['ok'] else 'FAILED'} ({rec['seconds']} s)", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.write()

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.out)


# ---------------------------------------------------------------- GPU stages

def machine_info() -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        from megatron.core import package_info

        info["megatron_core"] = package_info.__version__
    except Exception as e:  # noqa: BLE001 - reported in the JSON; later stages fail on it loudly
        info["megatron_core"] = f"not importable: {e}"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["transformer_engine"] = bool(__import__("importlib.util").util.find_spec("transformer_engine"))
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True)
    info["machine"] = smi.stdout.strip().splitlines()[0]
    return info


def init_distributed(seed: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def hf_model(config: Any, dtype: torch.dtype, state: dict[str, torch.Tensor] | None, seed: int,
             device: str = "cuda"):
    """transformers' model (eager attention: the DSA index mask path); random weights unless `state`."""
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    if state is None:
        perturb_(model, seed)
    else:
        model.load_state_dict(state, strict=True)
    return model.to(device, dtype)


def megatron_model(config: Any, bf16: bool, state: dict[str, torch.Tensor] | None, **kw: Any):
    from agentrl.models.megatron_builder import build_gpt_model, to_bf16_keeping_fp32_router_bias

    model = build_gpt_model(config, use_te=False, qk_norm_eps=1e-6, bf16=bf16, **kw).cuda()
    if bf16:
        to_bf16_keeping_fp32_router_bias(model)
    if state is not None:
        load_into_megatron(model, state)
    return model


def mg_forward(model: Any, ids: torch.Tensor, labels: torch.Tensor | None = None, carrier: str = "mask") -> torch.Tensor:
    """Megatron forward of [b, s] rows. DSA keeps each forward's shared top-k on an object: the
    attention mask ("mask"), the shared config ("none"), or PackedSeqParams ("packed": the rows are
    packed into one THD sequence, and the output is unpacked to [b, s, ...] again)."""
    b, s = ids.shape
    pos = torch.arange(s, device=ids.device)[None].expand(b, s)
    if carrier == "mask":
        return model(input_ids=ids, position_ids=pos, attention_mask=causal_mask(b, s, ids.device), labels=labels)
    if carrier == "none":
        return model(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels)
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=ids.device)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)
    out = model(input_ids=ids.reshape(1, -1), position_ids=pos.reshape(1, -1), attention_mask=None,
                labels=None if labels is None else labels.reshape(1, -1), packed_seq_params=packed)
    return out.reshape(b, s, *out.shape[2:])


def logits_stage(rec: dict, config: Any, dtype: torch.dtype, ids: torch.Tensor, seed: int,
                 carrier: str = "mask") -> dict[str, torch.Tensor]:
    ref = hf_model(config, torch.float32, None, seed)
    state = {k: v.detach().cpu() for k, v in ref.state_dict().items()}
    hf = ref.to(dtype).eval()
    for name, buf in hf.named_buffers():  # Megatron keeps the expert bias in fp32 (router.py); match it
        if name.endswith("e_score_correction_bias"):
            buf.data = state[name].to(buf.device)
    mg = megatron_model(config, dtype == torch.bfloat16, hf_to_megatron(state, config)).eval()
    with torch.no_grad():
        a, b = mg_forward(mg, ids, carrier=carrier).float(), hf(ids).logits.float()
    rec["megatron_vs_hf"] = diff_stats(a, b)
    rec["logits_shape"] = list(a.shape)
    if dtype != torch.float32:
        with torch.no_grad():
            rec["hf_bf16_vs_hf_fp32"] = diff_stats(b, ref.float()(ids).logits.float())
    del hf, mg, ref
    return state


def train_step_stage(rec: dict, config: Any, ids: torch.Tensor, seed: int, lr: float) -> None:
    hf = hf_model(config, torch.float32, None, seed).train()
    mg = megatron_model(config, False, hf_to_megatron(hf_tensors(hf), config)).train()
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.98),
                              weight_decay=0.0) for m in (hf, mg)]
    loss_hf, loss_mg = next_token_loss(hf(ids).logits, ids), next_token_loss(mg_forward(mg, ids), ids)
    loss_hf.backward()
    loss_mg.backward()
    rec["loss_before"] = {"hf": loss_hf.item(), "megatron": loss_mg.item(), "abs_diff": abs(loss_hf.item() - loss_mg.item())}
    g_hf, g_mg = hf_tensors(hf, grads=True), megatron_to_hf(megatron_tensors(mg, grads=True), config)
    rec["grad_worst_tensors"] = worst_tensors(g_mg, g_hf)
    for opt in opts:
        opt.step()
    w_mg = megatron_to_hf(megatron_tensors(mg), config)
    rec["weights_after_step_worst"] = worst_tensors(w_mg, hf_tensors(hf))
    with torch.no_grad():
        after_hf, after_mg = next_token_loss(hf(ids).logits, ids).item(), next_token_loss(mg_forward(mg, ids), ids).item()
    rec["loss_after"] = {"hf": after_hf, "megatron": after_mg, "abs_diff": abs(after_hf - after_mg)}


def mtp_load_stage(rec: dict, config: Any, seed: int, workdir: Path) -> None:
    """HF safetensors (with an MTP layer) -> torch_dist via prepare.py -> megatron's own loader."""
    from safetensors.torch import save_file

    from agentrl.models.prepare import convert_hf_to_megatron, load_megatron_checkpoint

    ref = hf_model(config, torch.float32, None, seed)
    state = {k: v.detach().cpu().contiguous() for k, v in ref.state_dict().items()}
    full = {**state, **synthetic_mtp_layer(config, state, seed)}
    hf_dir = workdir / "hf_tiny_mtp"
    hf_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(hf_dir)
    save_file(full, str(hf_dir / "model.safetensors"))
    ckpt = convert_hf_to_megatron(hf_dir, workdir / "mg_tiny_mtp")
    mg = megatron_model(config, False, None)
    load_megatron_checkpoint(mg, ckpt)
    got, want = megatron_tensors(mg), hf_to_megatron(full, config)
    rec["tensors"] = len(want)
    rec["mismatched"] = [k for k in want if k not in got or not torch.equal(got[k], want[k].float())]
    rec["missing_in_model"] = sorted(set(want) - set(got))
    ids = torch.randint(0, config.vocab_size, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    try:
        per_token = mg_forward(mg.train(), ids, labels=ids)  # main loss with the MTP loss hooked in
        rec["mtp_forward_loss"] = per_token.float().mean().item()
    except Exception as e:  # noqa: BLE001 - recorded, then the stage fails below
        rec["mtp_forward_error"] = f"{type(e).__name__}: {e}"
        rec["mtp_forward_traceback"] = traceback.format_exc()
    if rec["mismatched"] or rec["missing_in_model"] or "mtp_forward_error" in rec:
        raise AssertionError(f"{len(rec['mismatched'])} tensors differ after dist_checkpointing.load: {rec['mismatched'][:6]}")


def five_layer_stage(rec: dict, config: Any, seq: int, iters: int, seed: int, recompute: bool,
                     carrier: str = "mask") -> None:
    torch.cuda.reset_peak_memory_stats()
    kw = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} if recompute else {}
    mg = megatron_model(config, True, None, **kw).train()
    rec["params_b"] = sum(p.numel() for p in mg.parameters()) / 1e9
    rec["weights_gib"] = torch.cuda.memory_allocated() / 2**30
    gen = torch.Generator("cuda").manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (1, seq), device="cuda", generator=gen)
    times = []
    for i in range(iters + 1):  # the first iteration warms up kernels and allocator
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = mg_forward(mg, ids, labels=ids, carrier=carrier).float().mean()
        loss.backward()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
        mg.zero_grad(set_to_none=True)
    rec["loss"] = loss.item()
    rec["fwd_bwd_seconds"] = times
    rec["tokens_per_second"] = seq / (sum(times) / len(times))
    rec["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq", type=int, default=64, help="tiny-model sequence length (> index_topk: sparse)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--five-layer-experts", type=int, default=8)
    p.add_argument("--five-layer-seqs", default="2048,4096", help="without recompute")
    p.add_argument("--five-layer-recompute-seqs", default="4096,6144",
                   help="with full recompute. Without TE, DSA attention materialises [heads, s, s] fp32 "
                        "scores: 8192 ran out of the H200's 140 GiB with and without recompute")
    p.add_argument("--recompute-carriers", default="packed,none",
                   help="where DSA keeps the shared top-k under recompute (see mg_forward); add 'mask' to "
                        "reproduce megatron 0.19.2 failing: recompute detaches the mask, dropping the top-k")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder; default: a new temp folder")
    args = p.parse_args(argv)
    from agentrl.models.hf_config import hf_config_for

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="agentrl_parity_"))
    report = Report(args.out)
    with report.stage("env") as rec:
        rec.update(machine_info())
        report.data.update(machine=rec["machine"], versions={k: rec.get(k) for k in (
            "torch", "transformers", "megatron_core", "triton", "cuda", "python", "transformer_engine")})
    with report.stage("init_distributed"):
        init_distributed(args.seed)
    # 16 indexer heads: with relu scoring, 4 heads leave exact-zero score ties that either
    # implementation may break differently; 16 make them vanishingly rare.
    tiny = hf_config_for("tiny", index_n_heads=16)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, tiny.vocab_size, (2, args.seq), generator=gen).cuda()
    for name, dtype, key in (("tiny_fp32", torch.float32, HEADLINE_KEYS[0]), ("tiny_bf16", torch.bfloat16, HEADLINE_KEYS[1])):
        with report.stage(name) as rec:
            logits_stage(rec, tiny, dtype, ids, args.seed)
            report.data[key] = rec["megatron_vs_hf"]["max_abs"]
            report.data[key.replace("max", "mean")] = rec["megatron_vs_hf"]["mean_abs"]
    with report.stage("tiny_fp32_packed") as rec:  # THD packing: the trainer's layout
        logits_stage(rec, tiny, torch.float32, ids, args.seed, carrier="packed")
    with report.stage("tiny_train_step") as rec:
        train_step_stage(rec, tiny, ids, args.seed, args.lr)
        report.data["train_step_loss_after_abs_diff"] = rec["loss_after"]["abs_diff"]
    with report.stage("tiny_mtp_load") as rec:
        mtp_load_stage(rec, hf_config_for("tiny", index_n_heads=16, num_nextn_predict_layers=1), args.seed, workdir)
    five = hf_config_for("GLM-5.2_5layer", n_routed_experts=args.five_layer_experts)
    runs = [(int(s), False, "mask") for s in args.five_layer_seqs.split(",") if s]
    runs += [(int(s), True, c) for s in args.five_layer_recompute_seqs.split(",") if s
             for c in args.recompute_carriers.split(",")]
    for seq, recompute, carrier in runs:
        with report.stage(f"five_layer_seq{seq}" + (f"_recompute_{carrier}" if recompute else "")) as rec:
            rec["experts"] = args.five_layer_experts
            five_layer_stage(rec, five, seq, args.iters, args.seed, recompute, carrier)
    report.data["finished_unix"] = time.time()
    failed = [n for n, r in report.data["stages"].items() if not r["ok"]]
    missing = [k for k in HEADLINE_KEYS if k not in report.data]
    report.data["failed_stages"], report.data["ok"] = failed, not failed and not missing
    report.write()
    print(json.dumps({k: report.data.get(k) for k in ("machine", *HEADLINE_KEYS, "failed_stages")}, indent=1))
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
