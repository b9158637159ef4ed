"""What each trainer backend can run, stated once. The planner asks before it accepts a plan, so
`--dry-run` and `train` refuse the same layouts the backend would, with the same words.

Pure data and arithmetic (no torch, no megatron import): the planner runs on machines without them.
"""

from __future__ import annotations

from agentrl.config.layout import Layout

BACKENDS = ("torch", "megatron")

# Megatron backend: which parallel dimensions the backend trains with today, and why not the others.
# Keep these in step with agentrl/train/megatron_backend.py (tests/test_capabilities.py builds the
# backend at every layout this table accepts on gloo).
MEGATRON_UNSUPPORTED = {
    "tp": "train.parallel.tp={v}: megatron-core 0.19.2 refuses TP > 1 for DSA without TransformerEngine "
          "(AbsorbedMLA needs sequence parallel, which its torch norms lack); use tp=1 and spread the model with ep/dp",
    "pp": "train.parallel.pp={v}: the Megatron backend has no pipeline schedule between stages; use pp=1",
    "cp": "train.parallel.cp={v}: context parallelism over packed sequences is not in the Megatron backend; use cp=1",
}


def backend_refusal(backend: str, layout: Layout, device: str) -> str | None:
    """None if `backend` trains `layout` on `device` ("cpu" or "cuda"), else the one-line reason
    naming the config field to change."""
    if backend not in BACKENDS:
        return f"train.backend={backend!r} is not a trainer backend; use one of {', '.join(BACKENDS)}"
    if backend == "torch":
        if layout.world != 1:
            return (f"the torch backend trains on one rank; this plan has {layout.world} trainer ranks "
                    "(set cluster.cpu_trainer_ranks=1, or train.backend=megatron to shard the model)")
        return None
    for dim, why in MEGATRON_UNSUPPORTED.items():
        if layout.size(dim) > 1:
            return why.format(v=layout.size(dim))
    return None
