"""The Megatron TrainerBackend: GLM-MoE-DSA as a megatron-core GPTModel at the plan's layout (TP with
sequence parallelism, PP with 1F1B, CP with all-gather, EP, DP), trained with the same GRPO + TIS
loss as the torch backend (agentrl.train.loss).

- Process groups from the plan's Layout (megatron_parallel.init_megatron_parallel); this rank's
  pipeline stage from agentrl.models.megatron_builder (no TransformerEngine), loaded from HF
  weights through mapping.hf_to_megatron + sharding.shard_state_dict, or from a converted
  checkpoint.
- Data (packing.py): trajectories split over DP ranks by tokens (the CP / TP / PP ranks of a DP
  rank share them), packed back to back (THD) into micro-batches of at most
  train.parallel.max_tokens_per_gpu tokens per GPU, CP-sliced in zigzag. Every rank runs the same
  number of micro-batches (a rank short of data runs masked fillers): EP dispatch, the pipeline and
  CP gathers are collectives.
- Micro-batches run through Megatron's schedule (pipeline.py): a forward-only pass for the old
  log-probs, then forward + backward. Log-probs come from the last stage's final hidden states
  (GPTModel's output_processor hook), so [T, V] logits never exist.
- Memory: params in train.dtype and an fp32 `main_grad` accumulator per param on the device
  (grads.py). With train.optimizer.offload=disk the fp32 masters and Adam moments live on
  node-local disk (offload_adam.DiskOffloadAdamW): 6 B per param on the GPU in bf16. Otherwise a
  bf16 model keeps fp32 masters beside it. agentrl.config.memory accounts the same bytes.
- Frozen: the DSA indexer (Megatron detaches its inputs; indexer loss 0) and the MTP layers
  (MTP_LOSS_SCALE below). The word embedding's last-stage copy (MTP) stays trainable and equal to
  the first stage's through the embedding-group all-reduce.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from agentrl.agent.trajectory import Trajectory
from agentrl.config.layout import Layout
from agentrl.config.schema import AlgorithmConfig, TrainConfig
from agentrl.train.capabilities import backend_refusal
from agentrl.train.cpu_shims import cpu_megatron
from agentrl.train.grads import attach_main_grads, clip_grad_norm, reduce_gradients, zero_main_grads
from agentrl.train.loss import LossConfig, LossInputs, grpo_tis_loss, step_advantages
from agentrl.train.megatron_parallel import DistInit, head_logprobs, init_megatron_parallel
from agentrl.train.offload_adam import DiskOffloadAdamW, make_optimizer
from agentrl.train.packing import PackedBatch, PackShape, filler_pack, my_packs
from agentrl.train.pipeline import run_micro_batches

# The MTP layers are not trained by RL: their loss is not part of the policy objective, and
# Megatron normalises it per rank and micro-batch (process_mtp_loss: per-micro-batch means, or
# per-token sums scaled by a rolled/unrolled token ratio computed on each CP rank's slice), so its
# gradient would depend on the layout and the packing. With 0 the released MTP head is kept as
# loaded; speculative decoding with it stays exact, only its acceptance rate may drift.
MTP_LOSS_SCALE = 0.0

_SUM_KEYS = ("loss", "tis_clip_frac_sum", "tis_weight_sum", "pg_clip_frac_sum", "mismatch_kl_sum", "loss_tokens")


class MegatronBackend:
    def __init__(self, hf_config: Any, train: TrainConfig, algo: AlgorithmConfig, *, layout: Layout | None = None,
                 dist_init: DistInit | None = None,
                 hf_state: dict[str, torch.Tensor] | None = None, megatron_checkpoint: str | Path | None = None,
                 temperature: float = 1.0, run_dir: str | Path | None = None, seed: int = 0,
                 qk_norm_eps: float | None = 1e-6, grouped_experts: bool = True):
        """`layout`: the plan's trainer layout (None: one rank); `dist_init`: how this rank joins the
        trainer's world (None: already initialised, or a world of one).
        `hf_state`: full HF-named weights (e.g. a transformers model's state_dict); or
        `megatron_checkpoint`: a folder written by agentrl.models.prepare; neither: Megatron's init.
        `qk_norm_eps` 1e-6 is what transformers' GlmMoeDsa (the embedded engine) uses for the q/kv
        latent norms; None uses rms_norm_eps, as SGLang does. `grouped_experts` False keeps
        Megatron's SequentialMLP loop (the parity reference)."""
        from megatron.core import parallel_state as ps

        from agentrl.models.megatron_builder import build_gpt_model, to_bf16_keeping_fp32_router_bias

        self.hf_config, self.train_cfg, self.algo = hf_config, train, algo
        self.temperature = temperature
        self.loss_cfg = LossConfig(algo.eps_clip, algo.eps_clip_high, algo.use_tis, algo.tis_clip_low,
                                   algo.tis_clip, algo.kl_coef)
        if algo.kl_coef > 0:
            raise ValueError("algorithm.kl_coef > 0 needs a reference model, which the Megatron backend does not "
                             "keep (it would double the weights in HBM); set algorithm.kl_coef=0")
        if train.optimizer.offload == "disk" and run_dir is None:
            raise ValueError("train.optimizer.offload=disk needs the run dir (the state folder is named after it)")
        if hf_state is not None and megatron_checkpoint is not None:
            raise ValueError("pass hf_state or megatron_checkpoint, not both")
        self.layout = layout or Layout.single(hf_config.num_hidden_layers)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if why := backend_refusal("megatron", self.layout, device):
            raise ValueError(why)
        self.coords = init_megatron_parallel(self.layout, dist_init, seed=seed)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.bf16 = train.dtype == "bfloat16"
        extra: dict[str, Any] = {}
        if self.device.type == "cpu":
            extra["use_cpu_initialization"] = True
        if hf_state is not None or megatron_checkpoint is not None:
            extra["perform_initialization"] = False  # every weight is overwritten next
        torch.manual_seed(seed)
        with cpu_megatron():
            self.model = build_gpt_model(hf_config, self.layout, use_te=False, qk_norm_eps=qk_norm_eps,
                                         recompute=train.parallel.recompute, cp_comm=train.parallel.cp_comm,
                                         bf16=self.bf16, mtp_loss_scale=MTP_LOSS_SCALE,
                                         grouped_experts=grouped_experts, **extra).to(self.device)
        self.dsa_layers_switched = 0
        if train.dsa_kernels:  # DSA top-k and sparse attention through kernels/ (megatron_dsa_switch)
            from agentrl.models.megatron_dsa_switch import apply_dsa_kernels

            self.dsa_layers_switched = apply_dsa_kernels(self.model)
        if hf_state is not None:
            from agentrl.models.mapping import hf_to_megatron
            from agentrl.models.sharding import shard_key, shard_state_dict

            full = hf_to_megatron({k: v.detach().cpu() for k, v in hf_state.items()}, hf_config)
            self._load_local(shard_state_dict(full, hf_config, self.layout)[shard_key(self.coords)])
        elif megatron_checkpoint is not None:
            from agentrl.models.prepare import load_megatron_checkpoint

            load_megatron_checkpoint(self.model, megatron_checkpoint)
        self._freeze_untrained()
        if self.bf16:
            to_bf16_keeping_fp32_router_bias(self.model)
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        attach_main_grads(self.named_params)
        self.shared_embedding = self._shared_embedding(ps)
        self.sequence_parallel = bool(self.model.config.sequence_parallel)
        opt_cfg = train.optimizer
        if self.bf16 and opt_cfg.offload != "disk":
            self.masters = [(n, p.detach().float().clone().requires_grad_(True)) for n, p in self.named_params]
        else:  # fp32 params are their own masters; disk offload keeps the masters on disk
            self.masters = []
        steps_on = [m for _, m in self.masters] or [p for _, p in self.named_params]
        self.optimizer = make_optimizer(steps_on, opt_cfg, run_dir or "run", rank=self.coords.rank)
        self.pack_shape = PackShape(cp_size=self.layout.cp, cp_rank=self.coords.cp,
                                    sp_size=self.layout.tp if self.sequence_parallel else 1)
        self._version = 0
        self._exporter = None

    def _freeze_untrained(self) -> None:
        for name, p in self.model.named_parameters():
            if ".indexer." in name or (MTP_LOSS_SCALE == 0 and name.startswith("mtp.")):
                p.requires_grad_(False)

    def _shared_embedding(self, ps) -> torch.nn.Parameter | None:
        """This stage's word-embedding weight when it is in the embedding group (PP > 1 with MTP or
        tied weights: first and last stage each hold one), else None."""
        mtp = bool(getattr(self.model.config, "mtp_num_layers", None))
        if self.layout.pp == 1 or not (mtp or self.model.share_embeddings_and_output_weights):
            return None
        if not (ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()):
            return None
        weight = self.model.shared_embedding_or_output_weight()
        return weight if weight is not None and weight.requires_grad else None

    def _load_local(self, state: dict[str, torch.Tensor]) -> None:
        target = {k: v for k, v in self.model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
        missing, unexpected = sorted(set(target) - set(state)), sorted(set(state) - set(target))
        if missing or unexpected:
            raise ValueError(f"HF weights do not fit this rank's Megatron model: missing {missing[:6]}, "
                             f"unexpected {unexpected[:6]}; was hf_state made for this model config?")
        with torch.no_grad():
            for name, t in target.items():
                if tuple(t.shape) != tuple(state[name].shape):
                    raise ValueError(f"{name}: shape {tuple(state[name].shape)} in the HF weights, {tuple(t.shape)} in the model")
                t.copy_(state[name].to(device=t.device, dtype=t.dtype))

    @property
    def version(self) -> int:
        return self._version

    # -- forward -------------------------------------------------------------------------------
    def _forward(self, pack: PackedBatch, packed_seq_params: Any) -> torch.Tensor:
        """This stage's output for `pack`: hidden states, or [T_local] log-probs on the last stage."""
        def logprobs(hidden_states: torch.Tensor, output_layer: Any, output_weight: Any, **_: Any) -> torch.Tensor:
            weight = output_weight if output_weight is not None else output_layer.weight
            return head_logprobs(hidden_states, weight, pack.targets, temperature=self.temperature,
                                 chunk_tokens=self.train_cfg.logprob_chunk_tokens,
                                 sequence_parallel=self.sequence_parallel).float()

        return self.model(input_ids=pack.input_ids, position_ids=pack.position_ids, attention_mask=None,
                          packed_seq_params=packed_seq_params, output_processor=logprobs)

    def _my_packs(self, trajectories: list[Trajectory], advantages: list[float]) -> list[PackedBatch]:
        packs = my_packs(trajectories, advantages, self.layout.dp, self.coords.dp,
                         self.train_cfg.parallel.max_tokens_per_gpu, self.pack_shape)
        count = torch.tensor([len(packs)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        packs += [filler_pack(self.pack_shape) for _ in range(int(count.item()) - len(packs))]
        return [p.to(self.device) for p in packs]

    # -- one optimizer step --------------------------------------------------------------------
    def train_step(self, trajectories: list[Trajectory], group_ids: list[str]) -> dict[str, float]:
        """One optimizer step. Every rank calls it with the same arguments and returns the same dict."""
        from megatron.core import parallel_state as ps

        t0 = time.perf_counter()
        adv, advantages, reward_mean = step_advantages(trajectories, group_ids, self.algo.advantage_norm)
        packs = self._my_packs(trajectories, advantages)
        total = torch.tensor([float(sum(p.loss_mask.sum() for p in packs))], device=self.device)
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        total_loss_tokens = int(total.item())
        self.model.train()
        with torch.no_grad():
            old = run_micro_batches(self.model, packs, self._forward, forward_only=True)
        zero_main_grads(self.named_params)
        sums = torch.zeros(len(_SUM_KEYS), dtype=torch.float64)

        def loss(i: int, pack: PackedBatch, logp: torch.Tensor) -> torch.Tensor:
            value, metrics = grpo_tis_loss(LossInputs(logp=logp, old_logp=old[i], rollout_logp=pack.rollout_logp,
                                                      advantages=pack.advantages, mask=pack.loss_mask),
                                           self.loss_cfg, total_loss_tokens)
            sums.add_(torch.tensor([float(value.detach())] + [metrics.get(k, 0.0) for k in _SUM_KEYS[1:]],
                                   dtype=torch.float64))
            return value

        run_micro_batches(self.model, packs, self._forward, loss)
        reduce_gradients(self.named_params, sequence_parallel=self.sequence_parallel,
                         shared_embedding=self.shared_embedding)
        grad_norm = clip_grad_norm(self.named_params, self.train_cfg.optimizer.grad_clip)
        self._optimizer_step()
        self._version += 1
        return self._metrics(sums, grad_norm, len(packs), trajectories, adv, advantages, reward_mean, t0)

    def _optimizer_step(self) -> None:
        if isinstance(self.optimizer, DiskOffloadAdamW) or not self.masters:
            holders = [p for _, p in self.named_params]
            if not isinstance(self.optimizer, DiskOffloadAdamW):  # torch AdamW reads .grad
                for p in holders:
                    p.grad = p.main_grad
            self.optimizer.step()
            for p in holders:
                p.grad = None
            return
        for (_, p), (_, m) in zip(self.named_params, self.masters, strict=True):
            m.grad = p.main_grad
        self.optimizer.step()
        with torch.no_grad():
            for (_, p), (_, m) in zip(self.named_params, self.masters, strict=True):
                p.copy_(m)
                m.grad = None

    def _metrics(self, sums: torch.Tensor, grad_norm: float, micro_batches: int, trajectories, adv, advantages,
                 reward_mean: float, t0: float) -> dict[str, float]:
        """The same dict on every rank: loss sums from the ranks that own a distinct part of the
        loss (last stage, TP rank 0; every CP and DP rank), summed over the world."""
        from megatron.core import parallel_state as ps

        owns = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
        reduced = (sums if owns else torch.zeros_like(sums)).to(self.device)
        dist.all_reduce(reduced)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=self.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        s = dict(zip(_SUM_KEYS, reduced.tolist(), strict=True))
        n = max(s["loss_tokens"], 1.0)
        versions = [t.oldest_version for t in trajectories if t.oldest_version is not None]
        return {
            "loss": s["loss"], "grad_norm": grad_norm, "reward_mean": reward_mean,
            "advantage_abs_mean": float(np.mean(np.abs(advantages))),
            "zero_variance_groups": adv.zero_variance_groups, "groups": adv.groups, "loss_tokens": int(n),
            "micro_batches": micro_batches, "tis_clip_frac": s["tis_clip_frac_sum"] / n,
            "tis_weight_mean": (s["tis_weight_sum"] / n) if self.loss_cfg.use_tis else 1.0,
            "pg_clip_frac": s["pg_clip_frac_sum"] / n, "rollout_train_mismatch": s["mismatch_kl_sum"] / n,
            "oldest_token_version": min(versions) if versions else -1, "step_time_s": float(elapsed.item()),
        }

    # -- memory --------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, dict[str, float]]:
        """This rank's persistent training state in bytes: "accounted" by agentrl.config.memory (the
        accounting --dry-run prints) and "measured" from the tensors the backend holds on its device
        (weights, main_grads, masters, optimizer moments; the moments exist after the first step)."""
        from megatron.core import parallel_state as ps

        from agentrl.config.memory import state_bytes
        from agentrl.config.model_shapes import gpu_params, shapes_of

        stage = self.coords.pp
        params = gpu_params(shapes_of(self.hf_config), self.layout.stages()[stage], first=ps.is_pipeline_first_stage(),
                            last=ps.is_pipeline_last_stage(), tp=self.layout.tp, ep=self.layout.ep)
        accounted = state_bytes(params, self.train_cfg.dtype, self.train_cfg.optimizer.offload)

        def nbytes(tensors) -> float:
            return float(sum(t.numel() * t.element_size() for t in tensors if t.device == self.device))

        moments = [v for st in getattr(self.optimizer, "state", {}).values() if isinstance(st, dict)
                   for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
        measured = {"weights": nbytes(self.model.parameters()), "grads": nbytes(p.main_grad for _, p in self.named_params),
                    "masters": nbytes(m for _, m in self.masters), "moments": nbytes(moments)}
        return {"accounted": accounted["device"], "measured": measured,
                "accounted_disk": accounted["disk"], "accounted_host": accounted["host"]}

    # -- weights out ---------------------------------------------------------------------------
    def named_weights(self, hf_experts: str = "fused") -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF-named tensor of the whole model (global layer numbers, MTP included), one at a
        time, on EVERY rank: TP pieces all-gathered, experts from their EP owners, each tensor
        broadcast from its pipeline stage. Every rank must iterate to the end (collectives).
        `hf_experts`: "fused" (transformers' layout) or "per_expert" (checkpoints, SGLang)."""
        from agentrl.train.megatron_export import MegatronExporter

        if self._exporter is None:  # what each stage holds, exchanged once
            self._exporter = MegatronExporter(self.model, self.hf_config, self.layout)
        yield from self._exporter.hf_weights(hf_experts)

    def named_grads(self, hf_experts: str = "fused") -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named fp32 gradients of the last step (reduced over every parallel dimension, after
        clipping; zeros for frozen tensors), delivered like named_weights (every rank iterates)."""
        from agentrl.train.megatron_export import MegatronExporter, grads_like_state_dict

        if self._exporter is None:
            self._exporter = MegatronExporter(self.model, self.hf_config, self.layout)
        yield from self._exporter.hf_weights(hf_experts, grads_like_state_dict(self.model))

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, directory: Path, extra: dict) -> None:
        """Sharded (Megatron dist_checkpointing, torch_dist): model, masters and Adam state of every
        rank; written to a temp folder and renamed when complete. Every rank calls it."""
        from agentrl.train.dist_checkpoint import save_backend_checkpoint

        save_backend_checkpoint(self, Path(directory), extra)

    def load_checkpoint(self, directory: Path) -> dict:
        """Load a checkpoint written by save_checkpoint at any layout; returns its `extra`."""
        from agentrl.train.dist_checkpoint import load_backend_checkpoint

        return load_backend_checkpoint(self, Path(directory))
