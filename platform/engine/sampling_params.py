"""Sampling parameters of one request, validated on construction.

Invalid values raise `InvalidRequestError` naming the parameter (the gateway turns that into an
OpenAI 400), so nothing a client sends reaches a tensor unchecked. Defaults follow vLLM/OpenAI:
temperature 1, top_p 1, no top_k/min_p, no penalties. The rules:

- integers are Python ints, never bools (`True` is an int in Python); numbers are finite;
- `top_k`: -1 or 0 (disabled) or 1..2**31-1; one above the vocabulary means every token (the
  sampler clamps it);
- `seed`: a signed 64-bit integer, [-2**63, 2**63-1] (vLLM's rule); each token is drawn from a
  generator seeded by the seed and the token's position (`sampler.counter_seed`);
- `stop_token_ids`: non-negative integers (the engine, which knows the vocabulary, checks that
  they lie inside it);
- `logit_bias`: (token id, bias) pairs, ids non-negative and distinct (the engine checks the
  vocabulary), biases finite in [-100, 100] (OpenAI's range), added to the logits before
  penalties, filters and sampling (greedy too);
- `structured`: a `StructuredOutput`, the grammar every output must follow (its text is checked
  where it is compiled: `pdserve.engine.grammar`).

It does not bound counts or lengths (stop strings, ids, bias entries, a grammar's text): the
gateway does, before this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.errors import InvalidRequestError

_MAX_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 512
MAX_TOP_K = 2**31 - 1
MIN_SEED, MAX_SEED = -2**63, 2**63 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
REASONING_MODES = ("", "open", "optional")
# name -> (lowest, highest, whether the lowest is excluded)
_RANGES = {"temperature": (0.0, 2.0, False), "top_p": (0.0, 1.0, True), "min_p": (0.0, 1.0, False),
           "repetition_penalty": (0.0, 2.0, True), "presence_penalty": (-2.0, 2.0, False),
           "frequency_penalty": (-2.0, 2.0, False)}


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the whole output (vLLM's structured outputs), the key its grammar is
    compiled and cached under.

    `kind` and `value`: "json" (a JSON schema, as JSON text), "json_object" (any JSON object;
    value ""), "regex" (a regular expression the whole output matches), "choice" (a JSON list of
    the strings the output may be), "grammar" (Lark, or GBNF as llama.cpp writes it).
    `any_whitespace`: JSON may carry free whitespace between tokens; off by default, as vLLM's
    `disable_any_whitespace`: a model can otherwise emit whitespace until `max_tokens`.
    `reasoning`: where a thinking model's `<think>` section stands, which the constraint follows
    (free text up to `</think>`): "" none, "open" the output starts inside it (the prompt
    opened it), "optional" the output may open one."""
    kind: str
    value: str = ""
    any_whitespace: bool = False
    reasoning: str = ""

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                                      f"got {describe_value(self.kind)}", param="structured_outputs")
        if self.reasoning not in REASONING_MODES:
            raise InvalidRequestError(f"a structured output's reasoning is one of {REASONING_MODES}",
                                      param="structured_outputs")
        if not isinstance(self.value, str) or not isinstance(self.any_whitespace, bool):
            raise InvalidRequestError("a structured output's value is text and any_whitespace a boolean",
                                      param="structured_outputs")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's only; N: plus the top N
    prompt_logprobs: int | None = None  # the same for each prompt token (after the first)
    skip_special_tokens: bool = True
    # Prefix-cache isolation (vLLM's request field): blocks are shared only between requests of
    # the same salt (`pdserve.engine.block_hash.root_hash`). Not a sampling setting, but it travels
    # with the request to every pool as these do.
    cache_salt: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if name == "stop" and isinstance(value, str):
                value = (value,)
            if not isinstance(value, (list, tuple)):
                raise InvalidRequestError(f"{name} must be a list, got {describe_value(value)}", param=name)
            object.__setattr__(self, name, tuple(value))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        if not isinstance(self.logit_bias, (list, tuple)):
            raise InvalidRequestError(f"logit_bias must map token ids to biases, got {describe_value(self.logit_bias)}",
                                      param="logit_bias")
        object.__setattr__(self, "logit_bias", tuple(tuple(e) if isinstance(e, (list, tuple)) else e
                                                     for e in self.logit_bias))
        if _is_int(self.top_k) and self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, msg: str):
            raise InvalidRequestError(f"{param} {msg}", param=param)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {describe_value(self.max_tokens)}")
        for name, (lo, hi, lo_excluded) in _RANGES.items():
            v = getattr(self, name)
            if not _is_number(v) or v > hi or v < lo or (lo_excluded and v == lo):
                interval = f"{'(' if lo_excluded else '['}{lo:g}, {hi:g}]"
                bad(name, f"must be a number in {interval}, got {describe_value(v)}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            bad("top_k", f"must be -1 or 0 (disabled) or an integer in [1, {MAX_TOP_K}], "
                         f"got {describe_value(self.top_k)}")
        if self.seed is not None and (not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            bad("seed", f"must be an integer in [-2**63, 2**63-1], got {describe_value(self.seed)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be a boolean, got {describe_value(getattr(self, name))}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= _MAX_LOGPROBS):
                bad(name, f"must be an integer between 0 and {_MAX_LOGPROBS}, got {describe_value(value)}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or len(self.cache_salt) > MAX_CACHE_SALT_CHARS):
            bad("cache_salt", f"must be a string of at most {MAX_CACHE_SALT_CHARS} characters")
        for entry in self.logit_bias:
            if (not isinstance(entry, tuple) or len(entry) != 2 or not _is_int(entry[0]) or entry[0] < 0
                    or not _is_number(entry[1]) or abs(entry[1]) > MAX_LOGIT_BIAS):
                bad("logit_bias", f"entries are (token id >= 0, bias in [-100, 100]), got {describe_value(entry)}")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            bad("logit_bias", "names a token id twice")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            bad("structured", f"must be a StructuredOutput, got {describe_value(self.structured)}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """An int or a finite float (a huge int is compared exactly, never converted)."""
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def describe_value(v) -> str:
    """A value for an error message, short whatever the client sent (Python refuses to print an
    int of more than 4,300 digits at all)."""
    if _is_int(v) and abs(v) >= 10**20:
        return f"an integer of {v.bit_length()} bits"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
