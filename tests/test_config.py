"""The config tree: recipes load, overrides apply, bad keys and values fail naming the key."""

import pytest

from agentrl.config.loader import ConfigError, list_recipes, load_config, parse_override
from agentrl.config.schema import RunConfig


def test_every_recipe_loads_and_names_itself():
    names = list_recipes()
    assert {"glm5_2_tbench2", "glm5_2_8gpu", "glm5_2_5layer_1node", "local"} <= set(names)
    for name in names:
        cfg = load_config(name)
        assert cfg.recipe == name


def test_reference_recipe_numbers():
    cfg = load_config("glm5_2_tbench2")
    assert (cfg.cluster.num_nodes, cfg.cluster.gpus_per_node, cfg.cluster.hardware) == (16, 4, "GB300")
    assert cfg.algorithm.eps_clip == 0.2 and cfg.algorithm.eps_clip_high == 0.28
    assert (cfg.algorithm.tis_clip_low, cfg.algorithm.tis_clip) == (0.5, 2.0)
    assert cfg.train.optimizer.lr == 1e-6 and cfg.train.optimizer.beta2 == 0.98
    assert cfg.algorithm.group_size * cfg.algorithm.prompts_per_step == 64
    assert cfg.buffer.max_episodes_in_flight == 128
    assert cfg.rollout.sglang.kv_cache_dtype == "fp8_e4m3" and cfg.rollout.sglang.page_size == 64


def test_overrides_are_typed():
    cfg = load_config("local", ["train.max_steps=7", "rollout.temperature=0.5", "train.parallel.pp_layer_split=[2,3]"])
    assert cfg.train.max_steps == 7
    assert cfg.rollout.temperature == 0.5
    assert cfg.train.parallel.pp_layer_split == [2, 3]


def test_dict_field_override():
    cfg = load_config("local", ["rollout.sglang.env.MY_FLAG=1"])
    assert cfg.rollout.sglang.env["MY_FLAG"] == "1"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.max_stepz=3", "train.max_stepz"),
        ("nosuch.key=1", "nosuch"),
        ("train.max_steps=abc", "train.max_steps"),
        ("train.max_steps=0", "train.max_steps"),
        ("train.max_steps.deeper=1", "train.max_steps"),
        ("sandbox.backend=docker", "sandbox.backend"),
        ("train.max_steps", "section.key=value"),
    ],
)
def test_bad_override_names_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("local", [override])
    assert needle in str(e.value)


def test_unknown_key_in_yaml_is_an_error(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  max_steps: 2\n  learning_rate: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "train.learning_rate" in str(e.value) and "unknown key" in str(e.value)


def test_invalid_yaml_and_unknown_recipe(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML: line 2, column 1: expected ',' or ']'") as e:
        load_config(p)
    assert "\n" not in str(e.value)  # one line, where and what
    p.write_text("train:\n  max_steps: 2\n\tbad: 1\n")
    with pytest.raises(ConfigError, match=r"line 3, column 1: found character '\\t'"):
        load_config(p)
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path / "dir.yaml")
    with pytest.raises(ConfigError, match="known recipes"):
        load_config("no_such_recipe")


def test_secret_names_are_refused_in_engine_env():
    with pytest.raises(ConfigError, match="DAYTONA_API_KEY"):
        load_config("local", ["rollout.sglang.env.DAYTONA_API_KEY=abc"])


def test_defaults_are_one_tree():
    cfg = RunConfig()
    assert cfg.cluster.host == "127.0.0.1"
    assert cfg.rollout.pause_mode == "retract"  # never mixes old KV with new weights by default


def test_parse_override_parses_yaml_scalars():
    assert parse_override("a.b=true") == (["a", "b"], True)
    assert parse_override("a.b=null") == (["a", "b"], None)
    assert parse_override("a.b=x=y") == (["a", "b"], "x=y")
