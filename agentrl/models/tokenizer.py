"""Tokenizers of the named models, offline.

`tiny` gets a byte-level BPE trained here, deterministically, on text the package ships
(assets/tiny_corpus.txt) to exactly TINY.vocab_size tokens, with GLM-style role tokens and a chat
template (assets/tiny_chat_template.jinja). Training takes well under a second, so nothing is cached:
every call builds the same tokenizer from the same corpus.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.models.arch import TINY

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

BOS_TOKEN = "<|begin|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
# Order fixes the ids: pad=0, bos=1, eos=2, then the roles 3..6.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS)
# Tokens after which generation stops: end of turn, or the model starting the next user/tool turn.
STOP_TOKENS = (EOS_TOKEN, "<|user|>", "<|observation|>")
TINY_MAX_LENGTH = 16384


def _asset_text(name: str) -> str:
    return resources.files("agentrl.models").joinpath("assets", name).read_text(encoding="utf-8")


def build_tiny_tokenizer(out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Train the tiny byte-level BPE (vocab TINY.vocab_size) and wrap it for transformers.

    Deterministic: the corpus, its order and the trainer settings are fixed, so two builds give
    identical vocabularies and merges. With `out_dir`, the tokenizer files are also written there
    (loadable with AutoTokenizer.from_pretrained(out_dir))."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus_lines = _asset_text("tiny_corpus.txt").splitlines(keepends=True)
    bpe.train_from_iterator(corpus_lines, trainer=trainer, length=len(corpus_lines))
    if bpe.get_vocab_size() != TINY.vocab_size:
        # The corpus must yield enough merges; a shorter vocab would not match the model's embedding.
        raise RuntimeError(
            f"tiny tokenizer has {bpe.get_vocab_size()} tokens, expected {TINY.vocab_size}: "
            "agentrl/models/assets/tiny_corpus.txt is too small; add text to it"
        )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=list(ROLE_TOKENS),
        model_max_length=TINY_MAX_LENGTH,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = _asset_text("tiny_chat_template.jinja")
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids that end an assistant turn for the tiny tokenizer's template (eos, <|user|>, <|observation|>);
    for other tokenizers, just eos."""
    vocab = tokenizer.get_vocab()
    if all(t in vocab for t in STOP_TOKENS):
        return [vocab[t] for t in STOP_TOKENS]
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


# What an HF folder's tokenizer is read from (any one of them; tokenizer_config.json names the class).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a named model ("tiny", "smollm2-135m", "gemma3-270m") or of an HF folder, offline."""
    from agentrl.models.arch import NAMED_ARCHS

    name = str(name_or_path)
    if name == TINY.name:
        return build_tiny_tokenizer()
    if name == "smollm2-135m":
        from agentrl.models.smollm2 import load_smollm2_tokenizer

        return load_smollm2_tokenizer()
    if name == "gemma3-270m":
        from agentrl.models.gemma3 import load_gemma3_tokenizer

        return load_gemma3_tokenizer()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        from transformers import AutoTokenizer

        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(f"{path} holds none of the tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                             "pass an HF checkpoint folder that contains them")
        try:
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as e:  # transformers' messages span lines
            raise ValueError(f"{path}: transformers could not load its tokenizer: {' '.join(str(e).split())}") from e
    if name in NAMED_ARCHS:
        raise ValueError(
            f"model {name!r} ships no tokenizer with agentrl; pass the path of its HF checkpoint folder "
            "(model.path in the run config)"
        )
    raise ValueError(
        f"tokenizer {name!r} is neither a named model (tiny, smollm2-135m, gemma3-270m) nor an existing folder; "
        "pass an HF checkpoint folder that contains tokenizer files"
    )
