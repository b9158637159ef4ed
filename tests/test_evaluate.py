"""`agentrl eval` and the learning report: pass-rate statistics, and a real evaluation end to end."""

from __future__ import annotations

import json
import shutil

import pytest

from agentrl.evaluate import summarise, wilson_interval
from bench.learning import compare, per_family, samples_for, two_proportion_p_value


def test_wilson_interval_brackets_the_rate_and_stays_in_range():
    low, high = wilson_interval(0, 20)
    assert low == 0.0 and 0.1 < high < 0.2  # 0/20 still allows ~16%
    low, high = wilson_interval(10, 20)
    assert low < 0.5 < high and high - low < 0.5
    low, high = wilson_interval(20, 20)
    assert high == pytest.approx(1.0) and low > 0.8
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_two_proportion_p_value_separates_signal_from_noise():
    assert two_proportion_p_value(5, 80, 30, 80) < 1e-4  # 6% -> 38%: not chance
    assert two_proportion_p_value(5, 80, 7, 80) > 0.2  # 6% -> 9%: could be chance
    assert two_proportion_p_value(30, 80, 5, 80) > 0.99  # worse, not better
    assert two_proportion_p_value(0, 10, 0, 10) == 1.0
    assert two_proportion_p_value(0, 0, 1, 1) is None


def test_learning_report_plays_at_least_80_episodes_a_side():
    assert samples_for(40, 1) == 2  # 40 held-out-family tasks: 2 samples each
    assert samples_for(136, 1) == 1  # 136 held-out instances: one each is already 136
    assert samples_for(5, 16) == 16  # asking for more is kept
    assert samples_for(3, 1) * 3 >= 80


def test_learning_report_compares_a_split_before_and_after():
    before = {"pass_rate": 4 / 80, "passed": 4, "samples": 80, "ci95": [0.02, 0.12], "infra_errors": 0}
    after = {"pass_rate": 20 / 80, "passed": 20, "samples": 80, "ci95": [0.17, 0.35], "infra_errors": 1}
    r = compare(before, after, "heldout_instances")
    assert r["heldout_instances_before"] == 0.05 and r["heldout_instances_after"] == 0.25
    assert r["heldout_instances_gain"] == pytest.approx(0.2)
    assert r["heldout_instances_samples"] == 80 and r["heldout_instances_infra_errors"] == [0, 1]
    assert r["heldout_instances_p_value_one_sided"] < 0.01
    assert compare(after, before, "eval")["eval_p_value_one_sided"] > 0.99  # worse is not a gain


def test_learning_report_groups_generated_tasks_by_family():
    per_task = {"tail-lines-s7001-000": {"passed": 1, "samples": 2},
                "tail-lines-s7001-001": {"passed": 0, "samples": 2},
                "set-mode-s7002-003": {"passed": 2, "samples": 2}}
    assert per_family(per_task) == {"set-mode": "2/2", "tail-lines": "1/4"}


def test_summarise_counts_infra_errors_apart():
    eps = [{"task_id": "a", "outcome": "scored", "reward": 1.0},
           {"task_id": "a", "outcome": "scored", "reward": 0.0},
           {"task_id": "b", "outcome": "agent_timeout", "reward": 0.0},
           {"task_id": "b", "outcome": "infra_error:sandbox", "reward": None}]
    r = summarise(eps)
    assert (r["passed"], r["samples"], r["infra_errors"]) == (1, 3, 1)
    assert r["pass_rate"] == pytest.approx(1 / 3)
    assert r["per_task"]["a"] == {"samples": 2, "passed": 1, "infra_errors": 0, "pass_rate": 0.5}
    assert r["per_task"]["b"]["samples"] == 1 and r["per_task"]["b"]["infra_errors"] == 1


@pytest.mark.slow
def test_eval_command_runs_real_episodes_and_loads_a_checkpoint(tmp_path):
    """The tiny model on a real task in a real sandbox, from its own weights and from a checkpoint."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    import torch
    from typer.testing import CliRunner

    from agentrl.cli import app
    from agentrl.config.schema import AlgorithmConfig, TrainConfig
    from agentrl.models.tiny import build_tiny_model
    from agentrl.train.torch_backend import TorchBackend

    backend = TorchBackend(build_tiny_model(0), TrainConfig(), AlgorithmConfig())
    with torch.no_grad():
        next(backend.model.parameters()).add_(0.01)
    backend._version = 3
    backend.save_checkpoint(tmp_path / "ck", {"step": 3})
    args = ["eval", "--set", "rollout.max_new_tokens=8", "--set", "agent.max_turns=1", "--task", "write-name",
            "--samples", "2", "--concurrency", "2"]
    for name, extra in (("base", []), ("trained", ["--checkpoint", str(tmp_path / "ck")])):
        out = tmp_path / f"{name}.json"
        result = CliRunner().invoke(app, [*args, *extra, "--out", str(out)])
        assert result.exit_code == 0, result.output
        report = json.loads(out.read_text())
        assert report["samples"] + report["infra_errors"] == 2
        assert report["infra_errors"] == 0, report["outcomes"]
        assert report["pass_rate"] == 0.0  # a random tiny model does not write Ada Lovelace
        assert report["weight_version"] == (3 if extra else 0)
        assert len((tmp_path / "eval" / "eval_episodes.jsonl").read_text().splitlines()) == 2


def test_eval_command_names_a_missing_checkpoint(tmp_path):
    from typer.testing import CliRunner

    from agentrl.cli import app

    result = CliRunner().invoke(app, ["eval", "--task", "write-name", "--samples", "1",
                                      "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 2
    assert "not a checkpoint folder" in result.output


def test_learning_report_finds_both_held_out_splits_of_a_generated_set(tmp_path):
    from agentrl.config.schema import RunConfig
    from bench.learning import held_out_splits
    from envs.tbench2.generate.build import generate_tasks

    generate_tasks(tmp_path, ["make-dir", "tail-lines"], 2, seed=3)
    splits = {"train": ["make-dir-s3-000"], "eval": ["tail-lines-s3-000", "tail-lines-s3-001"],
              "eval_instances": ["make-dir-s3-001"]}
    (tmp_path / "SPLITS.json").write_text(json.dumps(splits))
    cfg = RunConfig.model_validate({"env": {"name": "tbench2", "tasks_dir": str(tmp_path)}})
    assert held_out_splits(cfg) == {"eval": splits["eval"], "eval_instances": splits["eval_instances"]}
    del splits["eval_instances"]  # a set without held-out instances (the fixture tasks): families only
    (tmp_path / "SPLITS.json").write_text(json.dumps(splits))
    assert held_out_splits(cfg) == {"eval": splits["eval"]}


def test_training_pass_rate_counts_every_training_episode_by_version(tmp_path):
    from bench.learning import plot_learning, training_pass_rates

    def ep(version, passed, evaluate=False, outcome="scored"):
        return json.dumps({"versions": [version], "passed": passed, "evaluate": evaluate, "outcome": outcome})

    (tmp_path / "transcripts").mkdir()
    (tmp_path / "transcripts" / "worker_0.jsonl").write_text("\n".join([
        ep(0, False), ep(1, True), ep(0, True, evaluate=True),  # an eval episode is not training
        ep(2, True), ep(3, True), ep(3, False, outcome="infra_error:sandbox"),  # nor is an infra error
    ]) + "\n")
    curve = training_pass_rates(tmp_path)
    assert [(c["versions"], c["passed"], c["episodes"]) for c in curve] == [([0, 1], 1, 2), ([2, 3], 2, 2)]
    report = {"train_pass_rate_by_version": curve, "in_run_evals": [{"version": 0, "pass_rate": 0.1}],
              "eval_before": 0.0, "eval_before_ci95": [0.0, 0.05],
              "eval_after": 0.2, "eval_after_ci95": [0.1, 0.3]}
    plot_learning(report, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_eval_command_refuses_bad_tasks_and_an_unwritable_out_before_any_episode(tmp_path):
    from typer.testing import CliRunner

    from agentrl.cli import app

    def run(*args):
        return CliRunner().invoke(app, ["eval", "--samples", "1", *args])

    (tmp_path / "a_file").write_text("in the way\n")
    cases = {("--task", "write_name"): "did you mean 'write-name'?",
             ("--task", "write-name,nope"): "--task 'nope': env tbench2 has no such task",
             ("--task", "malformed-toml"): "not a valid task of env tbench2: task malformed-toml: task.toml",
             ("--task", "write-name", "--out", str(tmp_path / "a_file" / "r.json")): "cannot write there",
             ("--harness", "foo"): "--harness 'foo': use agentrl or harbor"}
    for args, message in cases.items():
        result = run(*args)
        assert result.exit_code == 2 and message in " ".join(result.output.replace("│", " ").split()), (args, result.output)
        assert "evaluating" not in result.output and "[1/" not in result.output  # nothing played


def test_learning_report_names_a_folder_that_is_no_run(tmp_path):
    from bench.learning import run_learning_report

    (tmp_path / "a_file").write_text("x")
    for not_a_run in (tmp_path / "nope", tmp_path / "a_file", tmp_path):
        with pytest.raises(FileNotFoundError, match=f"{not_a_run} holds no config.json: not a run dir"):
            run_learning_report(not_a_run, tmp_path / "learning.json", samples=1)
