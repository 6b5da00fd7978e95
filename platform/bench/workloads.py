"""Benchmark workloads: prompts of exact token counts and how many tokens to ask for.

- random: input and output lengths drawn from fixed / uniform / histogram distributions;
- shared-prefix: tenants with their own system prompt, many short questions each, tenant
  popularity uniform or Zipf (what prefix-aware routing is for);
- long-prompt mix: a stream of short decode-heavy requests with occasional long prompts
  (what shows prefill/decode interference);
- replay: a JSONL trace of prompts or token counts with arrival offsets.

With a local tokenizer (`--tokenizer DIR`), prompts are built from vocabulary tokens that are
whole words (a leading space in byte-level BPE, a leading '▁' in SentencePiece-style tokenizers)
and survive decode -> encode in any position, so a prompt of n such tokens encodes to exactly
those n tokens, and prompts that share a prefix share exactly those tokens. Each prompt is
re-encoded once as a check: the token count a request carries is the tokenizer's own. Without a
tokenizer, words stand in for tokens and counts are approximate (the result says so).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_FALLBACK_WORDS = ("the quick brown fox jumps over a lazy dog while many people in large cities "
                   "ask simple questions about rivers music models and light").split()


@dataclass
class BenchRequest:
    prompt: str
    prompt_token_ids: list[int] | None  # the intended tokens, when a tokenizer built the prompt
    prompt_tokens: int
    max_tokens: int
    offset_s: float | None = None  # replay traces carry their own arrival offsets
    tenant: int | None = None


class PromptBuilder:
    """Builds texts of exact token counts from a tokenizer's whole-word tokens (or words)."""

    def __init__(self, tokenizer_dir: str | None = None):
        self.tokenizer = None
        if tokenizer_dir:
            from tokenizers import Tokenizer

            path = Path(tokenizer_dir) / "tokenizer.json"
            if not path.is_file():
                raise ValueError(f"{tokenizer_dir}: no tokenizer.json (a local Hugging Face tokenizer directory)")
            self.tokenizer = Tokenizer.from_file(str(path))
            self.word_ids = self._round_trip_words()
            if len(self.word_ids) < 16:
                raise ValueError(f"{tokenizer_dir}: too few whole-word tokens to build prompts from")

    @property
    def is_exact(self) -> bool:
        return self.tokenizer is not None

    def _round_trip_words(self) -> np.ndarray:
        # Decoding a lone token drops a SentencePiece word's leading space, so judge each candidate
        # by a run of three, first position included.
        tok = self.tokenizer
        words = tok.decode_batch([[i] for i in range(tok.get_vocab_size())])
        ids = [i for i, w in enumerate(words) if len(w.strip()) > 1 and w.strip().isalpha() and w.strip().isascii()]
        texts = tok.decode_batch([[i] * 3 for i in ids])
        runs = tok.encode_batch(texts, add_special_tokens=False)
        # Three separate words (so the token starts a word) that encode back to the same three tokens.
        return np.asarray([i for i, text, run in zip(ids, texts, runs)
                           if text.split() == [words[i].strip()] * 3 and run.ids == [i] * 3])

    def tokens(self, n: int, rng: np.random.Generator) -> list[int]:
        pool = self.word_ids if self.is_exact else np.arange(len(_FALLBACK_WORDS))
        return rng.choice(pool, size=n).tolist()

    def text(self, token_ids: list[int]) -> str:
        if self.is_exact:
            return self.tokenizer.decode(token_ids)
        return " " + " ".join(_FALLBACK_WORDS[i] for i in token_ids)

    def count(self, text: str) -> int:
        if self.is_exact:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return len(text.split())

    def request(self, token_ids: list[int], max_tokens: int, **kw) -> BenchRequest:
        text = self.text(token_ids)
        if not self.is_exact:
            return BenchRequest(text, None, len(token_ids), max_tokens, **kw)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids  # what the server will see
        return BenchRequest(text, ids, len(ids), max_tokens, **kw)


def sample_lengths(spec: str, n: int, rng: np.random.Generator) -> list[int]:
    """'128' (fixed), '16:256' (uniform, inclusive) or a histogram file of 'length weight' lines."""
    if Path(spec).is_file():
        rows = [line.split() for line in Path(spec).read_text().splitlines() if line.strip()]
        lengths = np.asarray([int(r[0]) for r in rows])
        weights = np.asarray([float(r[1]) if len(r) > 1 else 1.0 for r in rows])
        return rng.choice(lengths, size=n, p=weights / weights.sum()).tolist()
    if ":" in spec:
        lo, hi = (int(x) for x in spec.split(":"))
        if not 1 <= lo <= hi:
            raise ValueError(f"bad length range {spec!r}: need 1 <= low <= high")
        return rng.integers(lo, hi + 1, size=n).tolist()
    value = int(spec)
    if value < 1:
        raise ValueError(f"lengths must be >= 1, got {spec!r}")
    return [value] * n


def random_workload(builder: PromptBuilder, n: int, input_len: str, output_len: str, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    ins, outs = sample_lengths(input_len, n, rng), sample_lengths(output_len, n, rng)
    return [builder.request(builder.tokens(i, rng), o) for i, o in zip(ins, outs)]


def shared_prefix_workload(builder: PromptBuilder, n: int, num_tenants: int, system_len: int,
                           question_len: str, output_len: str, popularity: str = "zipf",
                           zipf_s: float = 1.1, seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    systems = [builder.tokens(system_len, rng) for _ in range(num_tenants)]
    if popularity == "zipf":
        weights = 1.0 / np.arange(1, num_tenants + 1) ** zipf_s
    elif popularity == "uniform":
        weights = np.ones(num_tenants)
    else:
        raise ValueError(f"unknown tenant popularity {popularity!r} (uniform or zipf)")
    tenants = rng.choice(num_tenants, size=n, p=weights / weights.sum())
    qs, outs = sample_lengths(question_len, n, rng), sample_lengths(output_len, n, rng)
    return [builder.request(systems[t] + builder.tokens(q, rng), o, tenant=int(t))
            for t, q, o in zip(tenants, qs, outs)]


def long_prompt_mix_workload(builder: PromptBuilder, n: int, short_len: str, long_len: str, output_len: str,
                             long_fraction: float, long_output_len: str = "16", seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        is_long = rng.random() < long_fraction
        length = sample_lengths(long_len if is_long else short_len, 1, rng)[0]
        max_tokens = sample_lengths(long_output_len if is_long else output_len, 1, rng)[0]
        out.append(builder.request(builder.tokens(length, rng), max_tokens))
    return out


def replay_workload(builder: PromptBuilder, path: str, seed: int = 0) -> list[BenchRequest]:
    """JSONL lines: {"prompt": str | "prompt_tokens": int, "output_tokens": int, "offset_s": float}."""
    rng = np.random.default_rng(seed)
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            max_tokens = int(row.get("output_tokens", 128))
            offset = float(row["offset_s"]) if "offset_s" in row else None
            if "prompt" in row:
                out.append(BenchRequest(row["prompt"], None, builder.count(row["prompt"]), max_tokens, offset))
            else:
                out.append(builder.request(builder.tokens(int(row["prompt_tokens"]), rng), max_tokens, offset_s=offset))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: bad trace line ({e}); need prompt or prompt_tokens") from e
    return out
