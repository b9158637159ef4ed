"""The launcher as a user runs it: --dry-run output, errors, and secret hygiene."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launchers" / "run_glm5_2_daytona.py"
PLANTED = "dtn_planted_secret_9f8e7d6c5b4a"


def run(*args, env_extra=None):
    env = {**os.environ, "DAYTONA_API_KEY": PLANTED, "WANDB_API_KEY": PLANTED + "_wandb", **(env_extra or {})}
    return subprocess.run([sys.executable, str(LAUNCHER), *args], capture_output=True, text=True, env=env, timeout=120)


def test_dry_run_json_reference():
    from agentrl.config.front import resolve_run
    from agentrl.config.plan import PlanError, check_plan_runnable

    r = run("train", "--num-nodes", "16", "--dry-run", "--json")
    d = json.loads(r.stdout)
    assert d["train_nodes"] == 8 and d["inference_nodes"] == 8
    assert {k: d["layout"][k] for k in ("tp", "cp", "pp", "ep")} == {"tp": 2, "cp": 4, "pp": 4, "ep": 8}
    assert d["layout"]["stage_first_layers"] == [1, 19, 39, 59]
    assert len(d["engines"]) == 8
    assert all({"nodes", "gpus_per_node", "command"} <= set(e) for e in d["engines"])
    assert "sglang.launch_server" in d["engines"][0]["command"]
    # The dry run says what `train` would: runnable, or refused with the backend's own words.
    try:
        check_plan_runnable(resolve_run(num_nodes=16, check_runnable=False)[1])
        assert r.returncode == 0 and d["runnable"] is True, r.stderr
    except PlanError as e:
        assert r.returncode == 2 and d["runnable"] is False and d["refusal"] == str(e)
        assert f"this plan cannot run: {e}" in r.stderr


def test_dry_run_tables_and_no_secret_anywhere():
    outputs = []
    for args in (["train", "--num-nodes", "16", "--dry-run"], ["train", "--num-nodes", "16", "--dry-run", "--json"],
                 ["prepare", "--dry-run", "--json"], ["train", "--dry-run", "--set", "train.parallel.tp=zz"]):
        r = run(*args)
        outputs.append(r.stdout + r.stderr)
    assert "TP2" in outputs[0] and "sglang.launch_server" in outputs[0]
    for out in outputs:
        assert PLANTED not in out


def test_secret_in_override_value_is_redacted():
    r = run("train", "--config", "local", "--dry-run", "--set", f"logging.run_dir=/tmp/{PLANTED}")
    assert r.returncode == 0, r.stderr
    assert PLANTED not in r.stdout + r.stderr


def test_rejected_split_names_layer_and_valid_starts():
    r = run("train", "--num-nodes", "16", "--dry-run", "--set", "train.parallel.pp_first_stage_layers=19",
            "--set", "train.parallel.pp_last_stage_layers=19")
    assert r.returncode == 2
    assert "layer 20" in r.stderr and "Valid starts: [1, 2, 3, 7" in r.stderr


def test_a_cluster_plan_without_a_cluster_says_what_to_start():
    """A multi-node plan with no Ray address: refused before anything starts, with the ray start lines."""
    r = run("train", "--config", "local_cluster", "--set", "cluster.simulate_nodes=false")
    assert r.returncode == 2
    assert "no cluster was given" in r.stderr and "cluster.ray_address" in r.stderr
    assert "ray start --head" in r.stderr and "agentrl_inference" in r.stderr
    r = run("train", "--num-nodes", "16")
    assert r.returncode == 2 and "not built yet" not in r.stderr
    assert "this plan cannot run" in r.stderr or "no cluster was given" in r.stderr


def test_unknown_model_name():
    r = run("train", "--model-name", "gpt-9", "--dry-run")
    assert r.returncode == 2 and "--model-name" in r.stderr


@pytest.mark.parametrize("sub", ["prepare", "prepare-cp", "train", "full-train"])
def test_help_explains(sub):
    r = subprocess.run([sys.executable, str(LAUNCHER), sub, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--dry-run" in r.stdout and "--num-nodes" in r.stdout


def test_prepare_and_prepare_cp_on_tiny_checkpoint(tmp_path):
    hf, md, local = tmp_path / "hf", tmp_path / "md", tmp_path / "local"
    from agentrl.models.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(hf)
    r = run("prepare", "--model-name", "tiny", "--set", f"model.path={hf}", "--set", f"model.megatron_dir={md}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (md / ".metadata").exists() or any(md.iterdir())
    r1 = run("prepare-cp", "--model-name", "tiny", "--set", f"model.megatron_dir={md}", "--set", f"model.local_dir={local}")
    r2 = run("prepare-cp", "--model-name", "tiny", "--set", f"model.megatron_dir={md}", "--set", f"model.local_dir={local}")
    assert r1.returncode == r2.returncode == 0
    assert "0 already verified" in r1.stderr and "0 copied" in r2.stderr


def test_prepare_rejects_wrong_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    r = run("prepare", "--model-name", "GLM-5.2", "--set", f"model.path={tmp_path}", "--set", "model.megatron_dir=/tmp/x")
    assert r.returncode == 2 and "model_type" in r.stderr and "glm_moe_dsa" in r.stderr


def test_config_show_gives_the_same_verdict_as_train():
    """`agentrl config show` prints the plan with the refusal `train` would give, and exits 2 on one."""
    from typer.testing import CliRunner

    from agentrl.config.cli import app
    from agentrl.config.front import resolve_run
    from agentrl.config.plan import PlanError, check_plan_runnable

    for recipe in ("local", "glm5_2_tbench2"):
        r = CliRunner().invoke(app, ["show", "--config", recipe, "--json"])
        d = json.loads(r.stdout[: r.stdout.rindex("}") + 1])
        assert d["recipe"] == recipe
        try:
            check_plan_runnable(resolve_run(config=recipe, check_runnable=False)[1])
            assert r.exit_code == 0 and d["runnable"] is True and d["refusal"] is None, r.output
        except PlanError as e:
            assert r.exit_code == 2 and d["runnable"] is False and d["refusal"] == str(e)


def test_a_run_folder_that_cannot_be_written_is_one_line_before_anything_starts(tmp_path):
    (tmp_path / "a_file").write_text("in the way\n")
    for run_dir in (tmp_path / "a_file" / "run", Path("/proc/agentrl-run")):
        r = run("train", "--model-name", "tiny", "--sandbox", "local", "--run-dir", str(run_dir))
        assert r.returncode == 2, r.stderr
        assert f"logging.run_dir={run_dir}: cannot write there" in r.stderr and "--run-dir" in r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_model_path_that_is_no_checkpoint_is_refused_in_one_line(tmp_path):
    r = run("train", "--model-name", "tiny", "--sandbox", "local", "--run-dir", str(tmp_path / "run"),
            "--set", f"model.path={tmp_path}")
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: model.path={tmp_path} has no config.json: not an HF checkpoint folder; point it at one"


def test_daytona_without_its_key_is_refused_before_ray_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DAYTONA_API_KEY", "RAY_ADDRESS")}
    r = subprocess.run([sys.executable, str(LAUNCHER), "train", "--model-name", "tiny", "--sandbox", "daytona",
                        "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "Ray dashboard" not in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()  # a refused run leaves no folder behind
    assert r.stderr.strip() == ("error: sandbox.backend=daytona: DAYTONA_API_KEY is not set; export the Daytona API "
                                "key in this shell (it is never a config field), or use --sandbox local")
