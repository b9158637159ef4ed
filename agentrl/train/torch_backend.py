"""The torch TrainerBackend: one process, any transformers causal LM, CPU or one GPU.

Log-probs are computed from the final hidden states in token chunks (kernels.logprobs_torch),
so the [tokens, vocab] fp32 matrix is never materialised for the whole batch.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from agentrl.agent.trajectory import Trajectory
from agentrl.config.schema import AlgorithmConfig, TrainConfig
from agentrl.train import rng
from agentrl.train.batching import MicroBatch, collate, plan_micro_batches
from agentrl.train.loss import LossConfig, LossInputs, grpo_tis_loss, step_advantages
from agentrl.train.offload_adam import DiskOffloadAdamW, make_optimizer
from kernels.logprobs_torch import chunked_logprobs


def freeze_below_top_layers(model: torch.nn.Module, n: int) -> int:
    """Leave only the top `n` decoder layers and the final norm trainable; returns the number of
    trainable parameters. Embeddings and the LM head (often tied to them) are frozen, so the
    backward pass stops at the lowest trainable layer."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"train.trainable_layers: {type(model).__name__} has no decoder `layers` list; "
                         "unset train.trainable_layers to train every parameter")
    if n > len(layers):
        raise ValueError(f"train.trainable_layers={n} but the model has {len(layers)} layers; use 1..{len(layers)}")
    model.requires_grad_(False)
    for layer in list(layers)[len(layers) - n:]:
        layer.requires_grad_(True)
    norm = getattr(decoder, "norm", None)
    if norm is not None:
        norm.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class TorchBackend:
    def __init__(self, model: torch.nn.Module, train: TrainConfig, algo: AlgorithmConfig, *, pad_id: int = 0,
                 temperature: float = 1.0, run_dir: str | Path | None = None):
        """`run_dir` names the optimizer's folder when its state is offloaded to disk."""
        self.model = model
        self.train_cfg = train
        self.algo = algo
        self.pad_id = pad_id
        self.temperature = temperature
        self.loss_cfg = LossConfig(algo.eps_clip, algo.eps_clip_high, algo.use_tis, algo.tis_clip_low,
                                   algo.tis_clip, algo.kl_coef)
        if train.optimizer.offload == "disk" and run_dir is None:
            raise ValueError("train.optimizer.offload=disk needs the run dir (the state folder is named after it)")
        if train.trainable_layers is not None:
            freeze_below_top_layers(model, train.trainable_layers)
        self.optimizer = make_optimizer(model.parameters(), train.optimizer, run_dir or "run")
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if algo.kl_coef > 0 else None
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    # -- log-probs ---------------------------------------------------------------------------
    def _token_logprobs(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """[B, L-1] log-probs of each next token under `model` at the sampling temperature."""
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        hidden = base(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state[:, :-1]
        weight = model.get_output_embeddings().weight
        B, T, H = hidden.shape
        # Only positions the loss reads need the LM head: prompts and observations (most of an
        # agentic sequence) are skipped; their entries stay 0 and the loss masks them out.
        rows = mb.loss_mask.reshape(-1).nonzero().squeeze(1)
        h, y = hidden.reshape(B * T, H).index_select(0, rows), mb.targets.reshape(-1).index_select(0, rows)
        if hidden.is_cuda:
            # The fused Triton kernel (kernels/logprobs.py): 649 TFLOP/s at GLM-5.2 sizes on an H200.
            from kernels.logprobs import fused_logprobs

            flat = fused_logprobs(h.contiguous(), weight.to(h.dtype), y, temperature=self.temperature)
        else:
            flat = chunked_logprobs(h, weight, y, temperature=self.temperature,
                                    chunk_tokens=self.train_cfg.logprob_chunk_tokens)
        out = torch.zeros(B * T, dtype=flat.dtype, device=flat.device)
        return out.index_copy(0, rows, flat).view(B, T)

    # -- one optimizer step --------------------------------------------------------------------
    def train_step(self, trajectories: list[Trajectory], group_ids: list[str]) -> dict[str, float]:
        t0 = time.perf_counter()
        adv, advantages, reward_mean = step_advantages(trajectories, group_ids, self.algo.advantage_norm)
        device = next(self.model.parameters()).device
        batches = [collate(trajectories, advantages, idx, self.pad_id).to(device)
                   for idx in plan_micro_batches([len(t.token_ids) for t in trajectories],
                                                 self.train_cfg.micro_batch_tokens)]
        total_loss_tokens = int(sum(mb.loss_mask.sum() for mb in batches))
        self.model.train()
        # One optimizer step per batch: every micro-batch sees the weights as they were before the
        # step, so its "old" log-probs are its own current ones, detached (ratio 1, as PPO's first
        # epoch). That saves a full forward pass per step.
        with torch.no_grad():
            ref = [self._token_logprobs(self.ref_model, mb) for mb in batches] if self.ref_model else None
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        loss_total = 0.0
        for i, mb in enumerate(batches):
            if not mb.loss_mask.any():  # nothing sampled to train (stale tokens masked, an episode done at reset)
                continue
            logp = self._token_logprobs(self.model, mb)
            loss, m = grpo_tis_loss(
                LossInputs(logp=logp, old_logp=logp.detach(), rollout_logp=mb.rollout_logp, advantages=mb.advantages,
                           mask=mb.loss_mask, ref_logp=ref[i] if ref else None),
                self.loss_cfg, total_loss_tokens)
            loss.backward()
            loss_total += float(loss.detach())
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, self.train_cfg.optimizer.grad_clip)
        self.optimizer.step()
        self._version += 1
        n = max(sums.get("loss_tokens", 0.0), 1.0)
        versions = [t.oldest_version for t in trajectories if t.oldest_version is not None]
        return {
            "loss": loss_total,
            "grad_norm": float(grad_norm),
            "reward_mean": reward_mean,
            "advantage_abs_mean": float(np.mean(np.abs(advantages))),
            "zero_variance_groups": adv.zero_variance_groups,
            "groups": adv.groups,
            "loss_tokens": int(n),
            "micro_batches": len(batches),
            "tis_clip_frac": sums.get("tis_clip_frac_sum", 0.0) / n,
            "tis_weight_mean": sums.get("tis_weight_sum", n) / n,
            "pg_clip_frac": sums.get("pg_clip_frac_sum", 0.0) / n,
            "rollout_train_mismatch": sums.get("mismatch_kl_sum", 0.0) / n,
            "oldest_token_version": min(versions) if versions else -1,
            "step_time_s": time.perf_counter() - t0,
        }

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.model.state_dict().items():
            yield name, t.detach()

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, directory: Path, extra: dict) -> None:
        """Atomic: written to a temp folder, then renamed; a crash leaves the previous one intact."""
        directory = Path(directory)
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        on_disk = isinstance(self.optimizer, DiskOffloadAdamW)
        if on_disk:  # hard links to the committed bucket files, not a copy through RAM
            self.optimizer.save_checkpoint(tmp / "optimizer")
        torch.save({
            "model": self.model.state_dict(),
            "optimizer": None if on_disk else self.optimizer.state_dict(),
            "version": self._version,
            "rng": rng.capture(),
            "extra": extra,
        }, tmp / "state.pt")
        with open(tmp / "state.pt", "rb") as f:
            os.fsync(f.fileno())
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)

    def load_checkpoint(self, directory: Path) -> dict:
        state = torch.load(Path(directory) / "state.pt", weights_only=True)  # tensors and plain data only
        _check_same_architecture(self.model, state["model"], Path(directory) / "state.pt")
        self.model.load_state_dict(state["model"])
        if state["optimizer"] is None:
            self.optimizer.load_checkpoint(Path(directory) / "optimizer")
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self._version = int(state["version"])
        rng.restore(state["rng"])
        return state["extra"]


def _check_same_architecture(model: torch.nn.Module, saved: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse a checkpoint of another model before anything is copied (torch would load the
    matching tensors first and then raise with every key name, thousands of lines for a big model)."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in saved.items()}
    missing, unexpected = sorted(own.keys() - got.keys()), sorted(got.keys() - own.keys())
    resized = sorted(k for k in own.keys() & got.keys() if own[k] != got[k])
    if missing or unexpected or resized:
        example = (missing or unexpected or resized)[0]
        raise ValueError(
            f"{path}: checkpoint of a different model architecture than {type(model).__name__} "
            f"({len(missing)} tensors missing, {len(unexpected)} unexpected, {len(resized)} of another shape; "
            f"e.g. {example!r}); resume with the model it was trained from (model.name / model.path) or "
            f"move the run's checkpoints/ folder away to start fresh")
