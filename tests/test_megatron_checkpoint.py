"""Sharded checkpoints of the Megatron backend (dist_checkpointing, torch_dist): written at EP2 with
the disk-offloaded Adam, resumed at TP2 x PP2, the next step equals the run that never stopped; a
save that died half-way leaves the previous checkpoint loadable."""

from __future__ import annotations

import pytest

from bench.parallel_cpu import LAYOUTS, layout_of, model_case, train_config, trajectories

LOSS_REL_TOL, WEIGHT_TOL = 1e-5, 1e-5  # as tests/test_megatron_parallel.py


def _backend(dist_init, name: str, tmp: str):
    from agentrl.config.schema import AlgorithmConfig
    from agentrl.train.megatron_backend import MegatronBackend

    config, state = model_case()
    train = train_config()
    train.optimizer.offload, train.optimizer.offload_dir = "disk", f"{tmp}/optim-{name}"
    return MegatronBackend(config, train, AlgorithmConfig(group_size=2), layout=layout_of(LAYOUTS[name], config),
                           dist_init=dist_init, hf_state=state, run_dir=f"{tmp}/run")


def save_after_one_step(dist_init, tmp: str) -> dict:
    """EP2: step, checkpoint, step again; what the uninterrupted second step gave."""
    b = _backend(dist_init, "EP2", tmp)
    trajs = trajectories()
    gids = [t.group_id for t in trajs]
    b.train_step(trajs, gids)
    b.save_checkpoint(f"{tmp}/ck", {"step": 1, "note": "ep2"})
    second = b.train_step(trajs, gids)
    weights = dict(b.named_weights())  # every rank iterates (collectives); rank 0 reports
    return {"loss": second["loss"], "weights": weights if dist_init.rank == 0 else None}


def resume_and_step(dist_init, tmp: str) -> dict:
    """TP2 x PP2: load the EP2 checkpoint, take the second step."""
    b = _backend(dist_init, "TP2xPP2", tmp)
    extra = b.load_checkpoint(f"{tmp}/ck")
    trajs = trajectories()
    second = b.train_step(trajs, [t.group_id for t in trajs])
    weights = dict(b.named_weights())
    return {"extra": extra, "version": b.version, "loss": second["loss"],
            "weights": weights if dist_init.rank == 0 else None}


@pytest.mark.slow
def test_checkpoint_saved_at_ep2_resumes_at_tp2_pp2(tmp_path):
    from agentrl.train.local_world import run_ranks

    tmp = str(tmp_path)
    want = run_ranks(save_after_one_step, 2, tmp)[0]
    # A later save that died half-way: only its temp folder exists; the checkpoint stays whole.
    (tmp_path / "ck.tmp").mkdir()
    (tmp_path / "ck.tmp" / "__0_0.distcp").write_bytes(b"torn")
    got = run_ranks(resume_and_step, 4, tmp)
    assert all(r["extra"] == {"step": 1, "note": "ep2"} and r["version"] == 2 for r in got)
    assert abs(got[0]["loss"] - want["loss"]) <= LOSS_REL_TOL * abs(want["loss"])
    diff = max(float((got[0]["weights"][k] - want["weights"][k]).abs().max()) for k in want["weights"])
    assert diff <= WEIGHT_TOL, diff


def test_a_folder_without_metadata_is_refused_with_the_reason(tmp_path):
    from types import SimpleNamespace

    from agentrl.train.dist_checkpoint import load_backend_checkpoint

    (tmp_path / "ck").mkdir()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_backend_checkpoint(SimpleNamespace(), tmp_path / "ck")
