"""The Megatron TrainerBackend: GLM-MoE-DSA as a megatron-core GPTModel, trained with the same GRPO +
TIS loss as the torch backend (agentrl.train.loss).

- Process groups from train.parallel (megatron_parallel.init_megatron_parallel); the model of this
  rank from agentrl.models.megatron_builder (no TransformerEngine), loaded from HF weights through
  mapping.hf_to_megatron + sharding.shard_state_dict, or from a converted torch_dist checkpoint.
- Data: each step's trajectories are split over data-parallel ranks by tokens, then packed back to
  back (THD, no padding) into micro-batches of at most train.parallel.max_tokens_per_gpu tokens.
  THD is also what carries DSA's shared top-k through full recompute (megatron_builder docstring).
- Log-probs from the final hidden states (GPTModel's output_processor hook, so the [T, V] logits are
  never built): the fused Triton kernel on one GPU with TP 1, torch chunks on CPU, megatron's
  vocab-parallel cross entropy in chunks when the head is split over TP.
- bf16 weights train through fp32 master copies: micro-batch grads are accumulated in fp32 on the
  masters, all-reduced over DP (experts over expert-DP), clipped by the global norm, stepped by
  torch AdamW or the disk-offloaded AdamW (train.optimizer.offload), and copied back.
- Every rank runs the same number of micro-batches (a rank short of data runs a masked filler pack),
  because expert-parallel token dispatch is a collective.
Pipeline parallelism builds (one stage per rank) but is refused for training: the schedule that
passes activations between stages is not wired in; so is context parallelism (THD attention over
CP needs TransformerEngine). Megatron refuses TP > 1 for DSA without TE (builder's message).
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from agentrl.agent.trajectory import Trajectory
from agentrl.config.schema import AlgorithmConfig, TrainConfig
from agentrl.train.loss import LossConfig, LossInputs, grpo_tis_loss, step_advantages
from agentrl.train.megatron_export import full_megatron_tensor, hf_named_weights
from agentrl.config.layout import Layout
from agentrl.train.capabilities import backend_refusal
from agentrl.train.megatron_parallel import (
    DistInit,
    PackedBatch,
    clip_grad_norm,
    cpu_megatron,
    init_megatron_parallel,
    pack_thd,
    plan_packs,
    reduce_gradients,
    split_for_data_parallel,
    vocab_parallel_logprobs,
)
from agentrl.train.offload_adam import DiskOffloadAdamW, make_optimizer

_SUM_KEYS = ("tis_clip_frac_sum", "tis_weight_sum", "pg_clip_frac_sum", "mismatch_kl_sum", "loss_tokens")


class MegatronBackend:
    def __init__(self, hf_config: Any, train: TrainConfig, algo: AlgorithmConfig, *, layout: Layout | None = None,
                 dist_init: DistInit | None = None,
                 hf_state: dict[str, torch.Tensor] | None = None, megatron_checkpoint: str | Path | None = None,
                 temperature: float = 1.0, run_dir: str | Path | None = None, seed: int = 0,
                 qk_norm_eps: float | None = 1e-6, advantage_sign: float = 1.0):
        """`layout`: the plan's trainer layout (None: one rank); `dist_init`: how this rank joins the
        trainer's world (None: already initialised, or a world of one).
        `hf_state`: full HF-named weights (e.g. a transformers model's state_dict); or
        `megatron_checkpoint`: a folder written by agentrl.models.prepare; neither: Megatron's init.
        `qk_norm_eps` 1e-6 is what transformers' GlmMoeDsa (the embedded engine) uses for the q/kv
        latent norms; None uses rms_norm_eps, as SGLang does."""
        from megatron.core import parallel_state as ps

        from agentrl.models.megatron_builder import build_gpt_model, to_bf16_keeping_fp32_router_bias
        from agentrl.models.sharding import shard_key, shard_state_dict

        self.hf_config, self.train_cfg, self.algo = hf_config, train, algo
        self.temperature, self.advantage_sign = temperature, advantage_sign
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
        if self.device.type == "cpu":  # the alltoall dispatcher creates a CUDA stream; allgather is equivalent at EP 1
            extra.update(use_cpu_initialization=True, moe_token_dispatcher_type="allgather")
        if hf_state is not None or megatron_checkpoint is not None:
            extra["perform_initialization"] = False  # every weight is overwritten next
        torch.manual_seed(seed)
        with cpu_megatron():
            self.model = build_gpt_model(hf_config, self.layout, use_te=False, qk_norm_eps=qk_norm_eps,
                                         recompute=train.parallel.recompute, cp_comm=train.parallel.cp_comm,
                                         bf16=self.bf16, **extra).to(self.device)
        self.dsa_layers_switched = 0
        if train.dsa_kernels:  # DSA top-k and sparse attention through kernels/ (megatron_dsa_switch)
            from agentrl.models.megatron_dsa_switch import apply_dsa_kernels

            self.dsa_layers_switched = apply_dsa_kernels(self.model)
        source: dict[str, torch.Tensor] | None = None
        if hf_state is not None:
            from agentrl.models.mapping import hf_to_megatron

            full = hf_to_megatron({k: v.detach().cpu() for k, v in hf_state.items()}, hf_config)
            source = shard_state_dict(full, hf_config, self.layout)[shard_key(self.coords)]
            self._load_local(source)
        elif megatron_checkpoint is not None:
            from agentrl.models.prepare import load_megatron_checkpoint

            load_megatron_checkpoint(self.model, megatron_checkpoint)
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.tp_partitioned = {n for n, p in self.named_params if getattr(p, "tensor_model_parallel", False)}
        if self.bf16:
            to_bf16_keeping_fp32_router_bias(self.model)
            # Masters from the fp32 source when there is one, so loading does not round them to bf16.
            self.masters = [(n, (source[n] if source is not None else p.detach()).to(self.device, torch.float32)
                             .clone().requires_grad_(True)) for n, p in self.named_params]
        else:
            self.masters = self.named_params
        self.optimizer = make_optimizer([m for _, m in self.masters], train.optimizer, run_dir or "run",
                                        rank=self.coords.rank)
        self._version = 0

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

    # -- log-probs -----------------------------------------------------------------------------
    def _logprobs(self, pb: PackedBatch) -> torch.Tensor:
        """[T] log-prob of each position's next token, from the final hidden states."""
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()

        def from_hidden(hidden_states: torch.Tensor, output_layer: Any, output_weight: Any, **_: Any) -> torch.Tensor:
            weight = output_weight if output_weight is not None else output_layer.weight
            h = hidden_states
            sequence_parallel = tp > 1 and self.model.config.sequence_parallel
            if sequence_parallel:
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True,
                                                         group=ps.get_tensor_model_parallel_group())
            h = h[:, 0]  # [T, 1, H] -> [T, H]
            y = pb.targets
            if tp > 1:
                return vocab_parallel_logprobs(h, weight, y, temperature=self.temperature,
                                               chunk_tokens=self.train_cfg.logprob_chunk_tokens,
                                               tp_group=ps.get_tensor_model_parallel_group(),
                                               reduce_hidden_grad=not sequence_parallel)
            if h.is_cuda:  # the fused Triton kernel (kernels/logprobs.py)
                from kernels.logprobs import fused_logprobs

                return fused_logprobs(h.contiguous(), weight.to(h.dtype), y, temperature=self.temperature)
            from kernels.logprobs_torch import chunked_logprobs

            return chunked_logprobs(h, weight, y, temperature=self.temperature,
                                    chunk_tokens=self.train_cfg.logprob_chunk_tokens)

        with cpu_megatron():
            return self.model(input_ids=pb.input_ids, position_ids=pb.position_ids, attention_mask=None,
                              packed_seq_params=pb.packed_seq_params(), output_processor=from_hidden)

    # -- one optimizer step --------------------------------------------------------------------
    def _my_packs(self, trajectories: list[Trajectory], advantages: list[float]) -> list[PackedBatch]:
        from megatron.core import parallel_state as ps

        lengths = [len(t.token_ids) for t in trajectories]
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        mine = split_for_data_parallel(lengths, dp)[ps.get_data_parallel_rank(with_context_parallel=True)]
        budget = self.train_cfg.parallel.max_tokens_per_gpu
        pad_to = ps.get_tensor_model_parallel_world_size() if self.model.config.sequence_parallel else 1
        packs = [pack_thd(trajectories, advantages, [mine[i] for i in p], pad_to)
                 for p in plan_packs([lengths[i] for i in mine], budget)]
        # Same micro-batch count on every rank: EP token dispatch is a collective.
        count = torch.tensor([len(packs)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        filler = Trajectory(episode_id="filler", task_id="", group_id="", prompt_len=2, token_ids=[0] * max(2, pad_to),
                            loss_mask=[0] * max(2, pad_to), rollout_logprobs=[0.0] * max(2, pad_to),
                            weight_versions=[-1] * max(2, pad_to), outcome="truncated", reward=0.0)
        packs += [pack_thd([filler], [0.0], [0], pad_to) for _ in range(int(count.item()) - len(packs))]
        return [p.to(self.device) for p in packs]

    def train_step(self, trajectories: list[Trajectory], group_ids: list[str]) -> dict[str, float]:
        t0 = time.perf_counter()
        adv, advantages, reward_mean = step_advantages(trajectories, group_ids, self.advantage_sign)
        packs = self._my_packs(trajectories, advantages)
        from megatron.core import parallel_state as ps

        dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        total = torch.tensor([float(sum(p.loss_mask.sum() for p in packs))], device=self.device)
        dist.all_reduce(total, group=dp_group)
        total_loss_tokens = int(total.item())
        self.model.train()
        with torch.no_grad():
            old = [self._logprobs(p).float() for p in packs]
        self.optimizer.zero_grad(set_to_none=True)
        for _, m in self.masters:
            m.grad = None
        sums = torch.zeros(1 + len(_SUM_KEYS), dtype=torch.float64)
        for i, p in enumerate(packs):
            logp = self._logprobs(p).float()
            loss, metrics = grpo_tis_loss(LossInputs(logp=logp, old_logp=old[i], rollout_logp=p.rollout_logp,
                                                     advantages=p.advantages, mask=p.loss_mask),
                                          self.loss_cfg, total_loss_tokens)
            with cpu_megatron():
                loss.backward()
            sums += torch.tensor([float(loss.detach())] + [metrics.get(k, 0.0) for k in _SUM_KEYS], dtype=torch.float64)
            if self.bf16:
                self._accumulate_master_grads()
        reduce_gradients(self.masters)
        grad_norm = clip_grad_norm(self.masters, self.tp_partitioned, self.train_cfg.optimizer.grad_clip)
        self.optimizer.step()
        if self.bf16:
            with torch.no_grad():
                for (_, p), (_, m) in zip(self.named_params, self.masters, strict=True):
                    p.copy_(m)
        self._version += 1
        sums_dev = sums.to(self.device)
        dist.all_reduce(sums_dev, group=dp_group)
        loss_total, *rest = sums_dev.tolist()
        s = dict(zip(_SUM_KEYS, rest))
        n = max(s["loss_tokens"], 1.0)
        versions = [t.oldest_version for t in trajectories if t.oldest_version is not None]
        return {
            "loss": loss_total, "grad_norm": grad_norm, "reward_mean": reward_mean,
            "advantage_abs_mean": float(np.mean(np.abs(advantages))),
            "zero_variance_groups": adv.zero_variance_groups, "groups": adv.groups, "loss_tokens": int(n),
            "micro_batches": len(packs), "tis_clip_frac": s["tis_clip_frac_sum"] / n,
            "tis_weight_mean": (s["tis_weight_sum"] / n) if self.loss_cfg.use_tis else 1.0,
            "pg_clip_frac": s["pg_clip_frac_sum"] / n, "rollout_train_mismatch": s["mismatch_kl_sum"] / n,
            "oldest_token_version": min(versions) if versions else -1, "step_time_s": time.perf_counter() - t0,
        }

    def _accumulate_master_grads(self) -> None:
        """bf16 param grads -> fp32 master grads after each micro-batch (accumulating in fp32)."""
        for (_, p), (_, m) in zip(self.named_params, self.masters, strict=True):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    # -- weights out ---------------------------------------------------------------------------
    def named_weights(self, hf_experts: str = "fused") -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named weights, one tensor at a time: TP pieces all-gathered, each expert broadcast
        from the EP rank that owns it. Every rank of the model must iterate (collectives); all ranks
        get every tensor. `hf_experts`: "fused" (transformers' layout, the embedded engine) or
        "per_expert" (checkpoint / SGLang layout)."""
        local = {k: v.detach() for k, v in self.model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
        yield from hf_named_weights(self.hf_config, lambda name: full_megatron_tensor(name, local, self.hf_config),
                                    hf_experts=hf_experts)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, directory: Path, extra: dict) -> None:
        """Per-rank files in a temp folder, renamed by rank 0 once every rank has written (all ranks
        see the same filesystem path). A crash leaves the previous checkpoint intact."""
        directory = Path(directory)
        tmp = directory.with_name(directory.name + ".tmp")
        rank = self.coords.rank
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        on_disk = isinstance(self.optimizer, DiskOffloadAdamW)
        if on_disk:
            self.optimizer.save_checkpoint(tmp / f"optimizer_rank{rank}")
        state = {
            "model": self.model.state_dict(), "masters": {n: m.detach().cpu() for n, m in self.masters} if self.bf16 else None,
            "optimizer": None if on_disk else self.optimizer.state_dict(), "version": self._version,
            "layout": self.layout.to_json(), "extra": extra,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        }
        torch.save(state, tmp / f"rank{rank}.pt")
        dist.barrier()
        if rank == 0:
            if directory.exists():
                shutil.rmtree(directory)
            tmp.rename(directory)
        dist.barrier()

    def load_checkpoint(self, directory: Path) -> dict:
        rank = self.coords.rank
        path = Path(directory) / f"rank{rank}.pt"
        if not path.exists():
            raise ValueError(f"{path} is missing: {directory} was written by another layout or world size than "
                             f"this run's {self.layout.describe()}; resume with the same train.parallel and ranks")
        state = torch.load(path, weights_only=False, map_location=self.device)
        if state.get("layout") != self.layout.to_json():
            raise ValueError(f"{directory} was written with layout {state.get('layout')}, this run has "
                             f"{self.layout.to_json()}; resume with the same train.parallel and world size")
        self.model.load_state_dict(state["model"], strict=False)
        if self.bf16:
            with torch.no_grad():
                for n, m in self.masters:
                    m.copy_(state["masters"][n])
        if state["optimizer"] is None:
            self.optimizer.load_checkpoint(Path(directory) / f"optimizer_rank{rank}")
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self._version = int(state["version"])
        torch.set_rng_state(state["rng"]["torch"].cpu())
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        return state["extra"]
