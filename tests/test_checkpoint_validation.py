"""validate_glm_checkpoint: the right folder passes, every wrong one fails fast with a clear message."""

from __future__ import annotations

import json

import pytest

from agentrl.models.checkpoint import CheckpointError, validate_glm_checkpoint
from agentrl.models.hf_config import hf_config_for


def _write(folder, config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config) if not isinstance(config, str) else config)
    return folder


def _glm_config(name="GLM-5.2", **changes):
    config = hf_config_for(name).to_dict()
    config.update(changes)
    return config


def test_valid_glm_5_2_and_5layer_folders_pass(tmp_path):
    full = _write(tmp_path / "full", _glm_config())
    assert validate_glm_checkpoint(full)["num_hidden_layers"] == 78
    five = _write(tmp_path / "five", _glm_config("GLM-5.2_5layer"))
    assert validate_glm_checkpoint(five, "GLM-5.2_5layer")["num_hidden_layers"] == 5


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match=r"does not exist.*set model.path"):
        validate_glm_checkpoint(tmp_path / "nope")


def test_folder_without_config_json(tmp_path):
    with pytest.raises(CheckpointError, match=r"config.json not found.*point model.path"):
        validate_glm_checkpoint(tmp_path)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_invalid_json(tmp_path, text):
    folder = _write(tmp_path, text)
    with pytest.raises(CheckpointError, match=r"config.json.*(not valid JSON|JSON list).*re-download"):
        validate_glm_checkpoint(folder)


def test_wrong_model_type(tmp_path):
    folder = _write(tmp_path, _glm_config(model_type="deepseek_v32"))
    with pytest.raises(CheckpointError) as err:
        validate_glm_checkpoint(folder)
    msg = str(err.value)
    assert str(folder / "config.json") in msg and "'model_type'" in msg
    assert "'deepseek_v32'" in msg and "'glm_moe_dsa'" in msg and "point model.path" in msg


@pytest.mark.parametrize("found", [None, ["GlmMoeDsaModel"], ["GlmMoeDsaForCausalLM", "Other"]])
def test_wrong_architectures(tmp_path, found):
    config = _glm_config()
    if found is None:
        del config["architectures"]
    else:
        config["architectures"] = found
    folder = _write(tmp_path, config)
    with pytest.raises(
        CheckpointError, match=r"'architectures' is .*expected \['GlmMoeDsaForCausalLM'\]; set"
    ):
        validate_glm_checkpoint(folder)


def test_wrong_depth_names_both_numbers_and_the_fix(tmp_path):
    folder = _write(tmp_path, _glm_config("GLM-5.2_5layer"))
    with pytest.raises(CheckpointError) as err:
        validate_glm_checkpoint(folder, "GLM-5.2")
    msg = str(err.value)
    assert "'num_hidden_layers' is 5, expected 78" in msg
    assert "it matches model.name GLM-5.2_5layer or tiny" in msg
    full = _write(tmp_path / "full", _glm_config())
    with pytest.raises(
        CheckpointError, match="'num_hidden_layers' is 78, expected 5.*matches model.name GLM-5.2\\)"
    ):
        validate_glm_checkpoint(full, "GLM-5.2_5layer")
    odd = _write(tmp_path / "odd", _glm_config(num_hidden_layers=12))
    with pytest.raises(CheckpointError, match=r"GLM names and depths: GLM-5.2 \(78\), GLM-5.2_5layer \(5\)"):
        validate_glm_checkpoint(odd, "tiny")


def test_auto_map_is_refused(tmp_path):
    folder = _write(tmp_path, _glm_config(auto_map={"AutoModelForCausalLM": "modeling_glm.GlmForCausalLM"}))
    with pytest.raises(CheckpointError, match=r"'auto_map' is present.*never runs remote code.*delete"):
        validate_glm_checkpoint(folder)


def test_non_glm_model_name_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="not a GLM-MoE-DSA model"):
        validate_glm_checkpoint(tmp_path, "smollm2-135m")
    with pytest.raises(ValueError, match="unknown model name"):
        validate_glm_checkpoint(tmp_path, "GLM-6")


def test_validate_and_hf_config_commands(tmp_path):
    from typer.testing import CliRunner

    from agentrl.models.cli import app

    runner = CliRunner()
    good = _write(tmp_path / "good", _glm_config())
    result = runner.invoke(app, ["validate", str(good)])
    assert result.exit_code == 0 and "78 layers" in result.output
    bad = _write(tmp_path / "bad", _glm_config(num_hidden_layers=77))
    result = runner.invoke(app, ["validate", str(bad)])
    assert result.exit_code == 1 and "expected 78" in result.output
    result = runner.invoke(app, ["hf-config", "GLM-5.2_5layer"])
    assert result.exit_code == 0 and json.loads(result.output)["num_hidden_layers"] == 5
