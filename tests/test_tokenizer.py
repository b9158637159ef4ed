"""The tiny tokenizer: trained offline and deterministically, GLM-style chat template."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentrl.models.arch import TINY
from agentrl.models.tokenizer import (
    EOS_TOKEN,
    ROLE_TOKENS,
    build_tiny_tokenizer,
    load_tokenizer,
    stop_token_ids,
)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_vocab_matches_tiny_arch_and_special_ids(tok):
    assert len(tok) == TINY.vocab_size
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids(list(ROLE_TOKENS)) == [3, 4, 5, 6]
    # Role tokens are atomic: never split into byte pieces.
    assert tok("<|user|>hi", add_special_tokens=False)["input_ids"][0] == 4


def test_build_is_deterministic_in_process_and_across_processes(tok):
    again = build_tiny_tokenizer()
    assert again.get_vocab() == tok.get_vocab()
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    code = (
        "import json; from agentrl.models.tokenizer import build_tiny_tokenizer; "
        "print(json.dumps(build_tiny_tokenizer().get_vocab(), sort_keys=True))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == tok.get_vocab()


def test_text_round_trips_through_bytes(tok):
    text = "$ grep -rn 'def parse' src/ | wc -l  # ünïcode ✓\n\ttab"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(text.encode())  # merges were learned
    assert tok.decode(ids) == text


def test_chat_template_generation_prompt_and_turn_ends(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List files."},
    ]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|begin|><|system|>\nBe brief.\n<|user|>\nList files.\n<|assistant|>\n"
    no_gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert not no_gen.endswith("<|assistant|>\n")
    full = tok.apply_chat_template(
        msgs + [{"role": "assistant", "content": "ls"}, {"role": "tool", "content": "a.txt"}], tokenize=False
    )
    # The assistant turn is the generation prompt + content + eos: prefix-consistent for token-in-token-out.
    assert full.startswith(prompt + "ls" + EOS_TOKEN + "<|observation|>\na.txt\n")


def test_chat_template_token_ids_are_prefix_consistent(tok):
    msgs = [{"role": "user", "content": "Write hello to a.txt"}]
    prompt_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    reply_ids = tok("echo hello > a.txt", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    full_ids = tok.apply_chat_template(
        msgs + [{"role": "assistant", "content": "echo hello > a.txt"}], return_dict=False
    )
    assert full_ids == prompt_ids + reply_ids


def test_chat_template_rejects_unknown_role(tok):
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_stop_token_ids(tok):
    assert stop_token_ids(tok) == [2, 4, 6]


def test_saved_tokenizer_loads_with_autotokenizer(tmp_path, tok):
    from transformers import AutoTokenizer

    build_tiny_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.chat_template == tok.chat_template
    assert loaded.eos_token == EOS_TOKEN
    text = "cat notes.txt\n"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert load_tokenizer(tmp_path).get_vocab() == tok.get_vocab()


def test_load_tokenizer_named_tiny(tok):
    assert load_tokenizer("tiny").get_vocab() == tok.get_vocab()


def test_load_tokenizer_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="GLM-5.2.*path of its HF checkpoint"):
        load_tokenizer("GLM-5.2")
    with pytest.raises(ValueError, match="neither a named model"):
        load_tokenizer(str(tmp_path / "missing"))


def test_a_folder_without_a_loadable_tokenizer_is_one_line_naming_it(tmp_path):
    from agentrl.models.tokenizer import load_tokenizer

    with pytest.raises(ValueError, match="holds none of the tokenizer files"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    with pytest.raises(ValueError, match=f"{tmp_path}: transformers could not load its tokenizer") as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value)
