"""What each trainer backend can run, stated once. The planner asks before it accepts a plan, so
`--dry-run` and `train` refuse the same layouts the backend would, with the same words.

Pure data and arithmetic (no torch, no megatron import): the planner runs on machines without them.
"""

from __future__ import annotations

from agentrl.config.layout import Layout

BACKENDS = ("torch", "megatron")

# Megatron backend (no TransformerEngine): TP with sequence parallelism, PP (1F1B), CP (all-gather)
# and EP all train (tests/test_megatron_parallel.py checks each against one rank on gloo). What it
# does not, and why; tests/test_capabilities.py checks planner and backend agree on every recipe.
MEGATRON_UNSUPPORTED = {
    "sequence_parallel": "train.parallel.sequence_parallel=false with tp={tp}: Megatron's AbsorbedMLA (DSA) "
                         "needs sequence parallelism at TP > 1; set train.parallel.sequence_parallel=true",
    "etp": "train.parallel.etp={etp}: the grouped-GEMM experts keep every routed expert whole on its EP rank; "
           "set train.parallel.etp=1",
    "pp_split": "train.parallel.pp_layer_split={split}: Megatron splits a pipeline as a first stage, equal middle "
                "stages and a last stage; make the middle stages equal (or set pp_first/last_stage_layers)",
}


def _megatron_refusal(layout: Layout) -> str | None:
    if layout.tp > 1 and not layout.sequence_parallel:
        return MEGATRON_UNSUPPORTED["sequence_parallel"].format(tp=layout.tp)
    if layout.etp > 1:
        return MEGATRON_UNSUPPORTED["etp"].format(etp=layout.etp)
    if len(set(layout.pp_split[1:-1])) > 1:
        return MEGATRON_UNSUPPORTED["pp_split"].format(split=list(layout.pp_split))
    return None


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
    return _megatron_refusal(layout)
