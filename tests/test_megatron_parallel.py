"""The Megatron backend at every parallel layout CI can run (at most 4 gloo ranks) against one rank:
tiny GLM with DSA index sharing and an MTP layer, fp32 (bench/parallel_cpu.py runs the ranks).

Tolerances: the same fp32 math in another summation order. Measured (bench/results/
parallel_cpu.json): loss within 1.0e-6 relative, gradients within 2.5e-8 (largest gradient 0.04),
weights after one Adam step within 1.5e-6 (lr 1e-3). A wrong reduction (a missing TP sum of a norm
grad, a CP rank's tokens counted twice, an expert from the wrong owner) moves the gradients by
about their own size, far outside 1e-4.
"""

from __future__ import annotations

import pytest

LOSS_REL_TOL = 1e-5
GRAD_TOL = 1e-4
WEIGHT_TOL = 1e-5  # 1% of the step's learning rate


@pytest.fixture(scope="module")
def one_rank():
    from bench.parallel_cpu import run_layout

    return run_layout("1")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["TP2", "PP2", "CP2", "EP2", "TP2xPP2", "PP2xEP2", "TP2xCP2"])
def test_layout_trains_like_one_rank(name, one_rank):
    from bench.parallel_cpu import run_layout

    run = run_layout(name, one_rank)
    assert run["export_exact"], "the HF export before training must equal the HF weights bit for bit"
    assert run["same_metrics_on_every_rank"]
    # every rank's weights, main_grads, masters and moments are what agentrl.config.memory accounts
    assert run["memory_accounted_equals_measured"], run["state_bytes_per_rank"]
    # with PP, the MTP stage's embedding copy equals the first stage's after the step (embedding group)
    assert run["embedding_copies_equal"]
    assert run["loss_rel_diff"] <= LOSS_REL_TOL, run["loss_rel_diff"]
    assert run["grad_max_diff"] <= GRAD_TOL < run["grad_max_abs"], (run["grad_max_diff"], run["grad_max_abs"])
    assert run["weight_max_diff_after_step"] <= WEIGHT_TOL, run["weight_max_diff_after_step"]


@pytest.mark.slow
def test_dsa_kernel_switch_under_tp_and_cp_uses_offsets_and_trains_like_one_rank():
    """TP2 x CP2 with train.dsa_kernels: each rank's query rows (a TP row shard of CP zigzag chunks)
    go through the offset top-k against the gathered keys, never Megatron's dense fallback."""
    from bench.parallel_cpu import run_layout

    one = run_layout("1", dsa_kernels=True)
    run = run_layout("TP2xCP2", one, dsa_kernels=True)
    for stats in run["dsa_kernels"]:
        assert stats["fallback"] == 0 and stats["offset_runs"] > 0 and stats["attention"] > 0, stats
    assert run["loss_rel_diff"] <= LOSS_REL_TOL and run["grad_max_diff"] <= GRAD_TOL, run
