"""`make_backend`: the one way a trainer rank gets its TrainerBackend, from the resolved plan.

The plan names the backend and the layout; this rank's coordinates follow from its rank. Weights
come from the converted checkpoint when there is one (model.local_dir, else model.megatron_dir;
Megatron only), else from the HF model of model.path / model.name.
"""

from __future__ import annotations

from pathlib import Path

from agentrl.config.plan import RunPlan
from agentrl.config.schema import RunConfig
from agentrl.train.backend import TrainerBackend
from agentrl.train.dist_init import DistInit


def make_backend(cfg: RunConfig, plan: RunPlan, dist_init: DistInit, run_dir: str | Path) -> TrainerBackend:
    """The backend of trainer rank `dist_init.rank` of `plan` (it joins the trainer's world here)."""
    run_dir = Path(run_dir)
    if dist_init.world != plan.layout.world:
        raise ValueError(f"rank {dist_init.rank} was started in a world of {dist_init.world}, the plan has "
                         f"{plan.layout.world} trainer ranks")
    if plan.backend == "dry":  # train --rehearse: placement and actors only, no torch in the process
        from agentrl.train.dry import DryBackend

        return DryBackend(plan.layout, plan.layout.coords(dist_init.rank))
    import torch

    torch.manual_seed(cfg.seed)
    if plan.backend == "megatron":
        return _megatron(cfg, plan, dist_init, run_dir)
    if plan.backend != "torch":
        raise ValueError(f"plan.backend={plan.backend!r}: no such trainer backend")
    from agentrl.models.policy import load_policy
    from agentrl.train.torch_backend import TorchBackend

    model, tok = load_policy(cfg.model.path or cfg.model.name, seed=cfg.seed, cache_dir=run_dir / "model_cache")
    if plan.gpus_per_rank and torch.cuda.is_available():
        model = model.cuda()
    return TorchBackend(model, cfg.train, cfg.algorithm, pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
                        temperature=cfg.rollout.temperature, run_dir=run_dir)


def _megatron(cfg: RunConfig, plan: RunPlan, dist_init: DistInit, run_dir: Path) -> TrainerBackend:
    from agentrl.models.hf_config import hf_config_for
    from agentrl.train.megatron_backend import MegatronBackend

    m = cfg.model
    common = dict(layout=plan.layout, dist_init=dist_init, temperature=cfg.rollout.temperature, run_dir=run_dir,
                  seed=cfg.seed)
    converted = next((d for d in (m.local_dir, m.megatron_dir) if d is not None and Path(d).exists()), None)
    if m.path is not None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(str(m.path), local_files_only=True)
    else:
        hf_config = hf_config_for(m.name)
    if converted is not None:
        return MegatronBackend(hf_config, cfg.train, cfg.algorithm, megatron_checkpoint=converted, **common)
    from agentrl.models.policy import load_policy

    model, _ = load_policy(m.path or m.name, seed=cfg.seed, cache_dir=run_dir / "model_cache")
    return MegatronBackend(model.config, cfg.train, cfg.algorithm, hf_state=model.state_dict(), **common)
