"""Tiny local tokenizers for the bench tests, trained here in well under a second (nothing downloaded).

`write_tokenizer(style, out_dir)` writes `out_dir/tokenizer.json` in one of the two shapes real
checkpoints use: "byte_level" (GPT-2 / Llama 3 / Qwen2: a word's token carries its leading space)
and "sentencepiece" (Llama 2 / Mistral: a leading '▁' that decoding strips at the start of a text).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_CORPUS = ("the quick brown fox jumps over the lazy dog while many people in large cities ask simple "
           "questions about rivers music models and light. serving systems route requests to replicas "
           "that hold cached prefixes; prefill computes the prompt and decode streams tokens back. "
           "every tenant has a system prompt and short questions arrive at random times.").split(". ")

STYLES = ("byte_level", "sentencepiece")


def write_tokenizer(style: str, out_dir: Path, vocab_size: int = 400) -> Path:
    if style == "byte_level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif style == "sentencepiece":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = []
    else:
        raise ValueError(f"unknown tokenizer style {style!r}")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return out_dir
