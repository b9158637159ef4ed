"""load_policy and `agentrl models init-tiny`: offline loading of tiny, HF folders and SmolLM2."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from agentrl.models.arch import TINY
from agentrl.models.checkpoint import validate_glm_checkpoint
from agentrl.models.cli import app as models_app
from agentrl.models.policy import load_policy
from agentrl.models.tiny import build_tiny_model

runner = CliRunner()


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_load_policy_tiny_in_memory_is_seeded():
    model, tok = load_policy("tiny", seed=3)
    assert type(model).__name__ == "GlmMoeDsaForCausalLM" and not model.training
    assert len(tok) == model.config.vocab_size == TINY.vocab_size
    assert _same_weights(model, build_tiny_model(3))
    bf16, _ = load_policy("tiny", torch.bfloat16, seed=3)
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    result = runner.invoke(models_app, ["init-tiny", str(out), "--seed", "7"])
    assert result.exit_code == 0, result.output
    return out


def test_init_tiny_writes_a_complete_offline_checkpoint(tiny_ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (tiny_ckpt / name).is_file(), name
    config = validate_glm_checkpoint(tiny_ckpt, "tiny")
    assert config["index_topk_freq"] == 2 and "auto_map" not in config
    model = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt), local_files_only=True)
    assert _same_weights(model, build_tiny_model(7))  # router biases included: they are saved buffers
    assert len(tok) == TINY.vocab_size and tok.chat_template
    gen = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 4, 6] and gen["pad_token_id"] == 0
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "ls"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_init_tiny_refuses_to_overwrite(tiny_ckpt):
    before = (tiny_ckpt / "model.safetensors").read_bytes()
    result = runner.invoke(models_app, ["init-tiny", str(tiny_ckpt)])
    assert result.exit_code == 1 and "exists" in result.output
    assert (tiny_ckpt / "model.safetensors").read_bytes() == before


def test_init_tiny_and_export_smollm2_name_an_out_they_cannot_write(tmp_path):
    (tmp_path / "a_file").write_text("x")
    for command in ("init-tiny", "export-smollm2"):
        result = runner.invoke(models_app, [command, str(tmp_path / "a_file" / "ckpt")])
        assert result.exit_code == 1, result.output
        assert result.output.strip() == f"error: OUT {tmp_path / 'a_file' / 'ckpt'}: cannot write there (Not a directory); pass a writable path"


def test_load_policy_from_tiny_folder(tiny_ckpt):
    model, tok = load_policy(tiny_ckpt)
    assert _same_weights(model, build_tiny_model(7)) and not model.training
    assert tok.eos_token == "<|endoftext|>"


def test_init_tiny_with_mtp_layer(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "mtp"
    result = runner.invoke(models_app, ["init-tiny", str(out), "--mtp"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 5
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        mtp = {k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.5.")}  # noqa: SIM118
    hidden = TINY.hidden_size
    assert mtp["model.layers.5.eh_proj.weight"].shape == (hidden, 2 * hidden)
    for key in (
        "enorm.weight",
        "hnorm.weight",
        "shared_head.norm.weight",
        "self_attn.indexer.wk.weight",
        "mlp.gate.e_score_correction_bias",
        "mlp.experts.gate_up_proj",
    ):
        assert f"model.layers.5.{key}" in mtp, key
    assert mtp["model.layers.5.mlp.experts.gate_up_proj"].std() > 0
    # transformers has no MTP module: the main model still loads, with the MTP weights left aside.
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert _same_weights(model, build_tiny_model(0))


def test_load_policy_generic_hf_folder(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.models.tokenizer import build_tiny_tokenizer

    config = LlamaConfig(
        vocab_size=TINY.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(tmp_path))
    build_tiny_tokenizer(tmp_path)
    model, tok = load_policy(str(tmp_path), torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
    ids = tok("echo hi", return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], TINY.vocab_size)


def test_load_policy_errors(tmp_path):
    with pytest.raises(ValueError, match="GLM-5.2.*no built-in weights.*model.path"):
        load_policy("GLM-5.2")
    with pytest.raises(ValueError, match="neither a named model"):
        load_policy(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_policy(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "auto_map": {"AutoModel": "x.Y"}})
    )
    with pytest.raises(ValueError, match="auto_map.*never runs remote code"):
        load_policy(tmp_path)


def test_smollm2_gguf_is_located_without_importing_the_package():
    from agentrl.models.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


@pytest.mark.slow
def test_load_policy_smollm2_and_cache_in_run_dir(tmp_path):
    model, tok = load_policy("smollm2-135m", cache_dir=tmp_path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say hello."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0, prompt["input_ids"].shape[1] :]).strip()
    assert (tmp_path / "smollm2-135m" / "model.safetensors").is_file()
    again, _ = load_policy("smollm2-135m", cache_dir=tmp_path)  # from the exported folder, no GGUF
    assert _same_weights(model, again)
