"""Constrained decoding: a request's `StructuredOutput` compiled into a grammar, and a matcher
that says which tokens may come next.

In: a `StructuredOutput` (`sampling_params.py`) and the model's tokenizer (its tokenizer.json,
vocabulary size and EOS ids). Out: `GrammarCompiler.matcher(spec)`, a fresh `GrammarMatcher`
per request, and `allowed_token_bitmask(rows, num_rows, vocab_size)`, a batch's masks as one
packed bitmask (1 bit a token, llguidance's layout), which the sampler applies to the logits in
one pass (`ops.token_bitmask`).

The library is llguidance (benchmarks/grammar_mask.py and RESULTS.md say why: it installs
with no dependencies, it compiles a schema in milliseconds, and its masks cost tens of
microseconds to a few milliseconds a token on CPU at 32k-123k-token vocabularies). A spec is
compiled once per compiler and kept in a bounded LRU cache; a request's matcher is a copy of the
cached one (~10 us). Compiling is bounded by llguidance's parser limits (grammar size, lexer fuel
for the compile and for each mask), so a hostile schema fails with an error instead of costing
unbounded time; the caller bounds the text's size (gateway) and keeps compiles off the engine's
step loop (`AsyncLLMEngine.prepare`).

A matcher's state is the tokens it has accepted: it cannot be serialised, and need not be. The
engine advances it with every output token it appends (sampled, taken over from a prefill
replica, or replayed for a resumed request), so a request preempted by recompute keeps its
matcher, and a decode replica that continues another engine's sequence rebuilds it by replaying
the outputs. A spec with `reasoning` set is the constraint behind a thinking model's `<think>` section:
one llguidance grammar whose Lark start rule reads free text up to the first `</think>` (as
bytes, or as the special token the vocabulary has) and then refers to the constraint's own
grammar, so the reasoning is part of the matcher's state like any other token. It does not know
about requests, sampling or where the grammar text came from (the gateway names the request
field in its errors).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Iterable, Sequence

import numpy as np

from pdserve.engine.sampling_params import StructuredOutput

# llguidance's defaults but tighter where one request could hold the engine: a mask step's lexer
# fuel (~14k/ms) and Earley items (~20k/ms) bound each token's mask to a few milliseconds.
_LIMITS = dict(max_grammar_size=200_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=100_000,
               step_max_items=50_000, max_lexer_states=100_000, verbose_errors=False)


class GrammarError(ValueError):
    """The spec is not a grammar llguidance can compile (the message says why)."""


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - installed with pdserve[serve]
        raise GrammarError("structured output needs llguidance (pip install 'pdserve[serve]')") from e
    return llguidance


THINK_TAGS = ("<think>", "</think>")


def _reasoning_prefix(mode: str, tag_ids: dict[str, int]) -> str:
    """Lark for a thinking model's reasoning section before `@constraint`: free text ended by the
    first `</think>` (lazy), then up to two newlines; "optional": only if the output opens it.
    Where the vocabulary has a tag as one special token (`tag_ids`), the token ends it too: a
    special token is not its bytes to llguidance, and cannot sit inside a lazy terminal."""
    end = tag_ids.get("</think>")
    lines = ['think_bytes[lazy]: /(?s:.*)/ "</think>"', "NL: /\\n{1,2}/"]
    if end is None:
        lines.append("reasoning: think_bytes")
    else:  # free text that holds no "</think>", then the token
        lines += [f"reasoning: think_bytes | FREE <[{end}]>", "FREE: /(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/"]
    if mode == "open":
        start = "start: reasoning NL? @constraint"
    else:
        opening = '"<think>"' + (f" | <[{tag_ids['<think>']}]>" if "<think>" in tag_ids else "")
        start = "start: (open_think reasoning NL?)? @constraint"
        lines.append(f"open_think: {opening}")
    return "\n".join([start] + lines) + "\n"


def grammar_text(spec: StructuredOutput, tag_ids: dict[str, int] | None = None):
    """The spec as an llguidance grammar (its JSON form, or Lark); after a reasoning section when
    `spec.reasoning` says so (`tag_ids`: the think tags that are special tokens, by id)."""
    inner = _constraint_text(spec)
    if not spec.reasoning:
        return inner
    try:
        grammars = json.loads(inner)["grammars"]
    except ValueError:  # Lark text
        grammars = [{"lark_grammar": inner}]
    grammars[0] = {**grammars[0], "name": "constraint"}
    prefix = _reasoning_prefix(spec.reasoning, tag_ids or {})
    return json.dumps({"grammars": [{"lark_grammar": prefix}] + grammars})


def _constraint_text(spec: StructuredOutput):
    llg = _llguidance()
    ws = {"whitespace_flexible": spec.any_whitespace}
    try:
        if spec.kind == "json":
            return llg.LLMatcher.grammar_from_json_schema(spec.value, overrides=ws)
        if spec.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=ws)
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choice must be a non-empty list of strings")
            return llg.LLMatcher.grammar_from_regex("|".join(_literal(c) for c in choices))
        from llguidance.gbnf_to_lark import any_to_lark

        return llg.LLMatcher.grammar_from_lark(any_to_lark(spec.value))
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - a JSON, GBNF or schema error, in the library's words
        raise GrammarError(str(e)[:500]) from None


def _literal(text: str) -> str:
    """`text` as a regex that matches exactly it (every character but letters and digits escaped)."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text) or "(?:)"


def _first_line(error: str) -> str:
    return (error.strip().splitlines() or ["invalid grammar"])[0][:500]


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher, executor=None, vocab_size: int = 0):
        self._m = matcher
        self.executor = executor  # llguidance's thread pool, for a batch's masks
        self.vocab_size = vocab_size  # the model's: what a mask covers

    def advance(self, token_id: int) -> bool:
        """Accept the next output token; False when the grammar does not allow it."""
        return self._m.consume_token(token_id)

    @property
    def is_stopped(self) -> bool:
        """Nothing can follow: the output is complete (only EOS would be allowed), or in error."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def fill(self, bitmask: np.ndarray) -> None:
        """Write the next token's mask (1 bit a token, int32 words) into a contiguous row."""
        assert bitmask.dtype == np.int32 and bitmask.flags.c_contiguous
        self._m.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)


def allowed_token_bitmask(rows: Sequence[tuple[int, GrammarMatcher]], num_rows: int,
                          vocab_size: int) -> np.ndarray:
    """`[num_rows, ceil(vocab_size / 32)]` int32 words: bit t % 32 of word t // 32 of row i is set
    when token t may come next. `rows` pairs a row with its matcher; the other rows allow every
    token. The rows are filled in one call, in parallel on llguidance's threads when there are
    several (they let go of the GIL), straight into the array: nothing is unpacked here."""
    words = (vocab_size + 31) // 32
    bitmask = np.full((num_rows, words), -1, dtype=np.int32)
    executor = rows[0][1].executor if len(rows) > 1 else None
    if executor is not None:
        executor.unsafe_compute_mask_ptr([(m._m, i) for i, m in rows], bitmask.ctypes.data, words * 4, num_rows)
    else:
        for i, m in rows:
            m.fill(bitmask[i])
    for _, m in rows:
        if m.error is not None:
            raise GrammarError(f"the grammar failed: {m.error[:300]}")
    return bitmask


class GrammarCompiler:
    """Compiles specs for one tokenizer and keeps the last `cache_size` (thread-safe: compile on
    any thread; llguidance lets go of the GIL while it compiles)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int], cache_size: int = 256):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer = None  # built on first use (~0.1-1 s at 150k tokens)
        self._executor = None
        self._tag_ids: dict[str, int] | None = None
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def _setup(self):
        with self._lock:
            if self._tokenizer is None:
                llg = _llguidance()
                self._tokenizer = llg.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                  eos_token=self._eos or None)
                self._executor = llg.LLExecutor()
            return self._tokenizer

    def _special_tags(self, tokenizer) -> dict[str, int]:
        """The think tags this vocabulary holds as one special token (Qwen3's, to llguidance)."""
        if self._tag_ids is None:
            self._tag_ids = {}
            for tag in THINK_TAGS:
                ids = tokenizer.tokenize_str(tag)
                if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
                    self._tag_ids[tag] = ids[0]
        return self._tag_ids

    def is_cached(self, spec: StructuredOutput) -> bool:
        with self._lock:
            return spec in self._cache

    def compile(self, spec: StructuredOutput) -> None:
        """Compile `spec` into the cache (a hit only refreshes it); raises `GrammarError`."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return
        tokenizer = self._setup()
        llg = _llguidance()
        grammar = grammar_text(spec, self._special_tags(tokenizer) if spec.reasoning else None)
        # Building the matcher validates the grammar (an error leaves it in its error state).
        matcher = llg.LLMatcher(tokenizer, grammar, limits=llg.LLParserLimits(**_LIMITS), log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        # The first mask builds the lexer: paid here, not in an engine step.
        GrammarMatcher(matcher).fill(np.zeros((self.vocab_size + 31) // 32, dtype=np.int32))
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`'s grammar (compiled here on a miss)."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
        if compiled is None:
            self.compile(spec)
            with self._lock:
                compiled = self._cache.get(spec)
            if compiled is None:  # evicted at once (a cache of 0): use it uncached
                raise GrammarError("the grammar cache holds no entries")
        return GrammarMatcher(compiled.deep_copy(), self._executor, self.vocab_size)
